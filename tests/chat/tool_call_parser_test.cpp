// ToolCallParser: Nemotron 3's XML tool calls -> OpenAI tool_calls. The reference output is what the published
// Nemotron 3 template renders for an assistant message with tool_calls (the format the model is trained on).
#include "chat/tool_call_parser.h"

#include <fstream>
#include <sstream>

#include <gtest/gtest.h>

#include "chat/chat_template.h"
#include "common/compare.h"

namespace chimera::chat {
namespace {

using nlohmann::json;
using nlohmann::ordered_json;

const char* kTools = R"([
  {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "scale": {"type": "number"},
    "metric": {"type": "boolean"}, "opts": {"type": "object"}, "tags": {"type": "array"},
    "note": {"type": ["string", "null"]}, "maybe": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}}}},
  {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}])";

TEST(ToolCallParser, ParsesTheFormat) {
  ToolCallParser p(json::parse(kTools), 1);
  ToolCallResult r = p.parse(
      "I will check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco, CA\n</parameter>\n"
      "<parameter=days>\n3\n</parameter>\n<parameter=scale>\n1.5\n</parameter>\n<parameter=metric>\nTrue\n"
      "</parameter>\n<parameter=opts>\n{\"a\": [1, 2]}\n</parameter>\n<parameter=tags>\n[\"x\"]\n</parameter>\n"
      "<parameter=note>\nnull\n</parameter>\n<parameter=maybe>\nNone\n</parameter>\n<parameter=unknown>\n7\n"
      "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=now>\n</function>\n</tool_call>\n");
  EXPECT_EQ(r.content, "I will check.\n");
  ASSERT_EQ(r.tool_calls.size(), 2u);
  EXPECT_EQ(r.tool_calls[0].name, "get_weather");
  EXPECT_EQ(
      r.tool_calls[0].arguments,
      "{\"city\": \"San Francisco, CA\", \"days\": 3, \"scale\": 1.5, \"metric\": true, \"opts\": {\"a\": [1, 2]}, "
      "\"tags\": [\"x\"], \"note\": null, \"maybe\": null, \"unknown\": \"7\"}");
  EXPECT_EQ(r.tool_calls[1].name, "now");
  EXPECT_EQ(r.tool_calls[1].arguments, "{}");
  EXPECT_EQ(r.tool_calls[0].id.size(), 5u + 24u);
  EXPECT_EQ(r.tool_calls[0].id.rfind("call_", 0), 0u);
  EXPECT_NE(r.tool_calls[0].id, r.tool_calls[1].id);
}

TEST(ToolCallParser, ValuesThatDoNotParseStayStrings) {
  ToolCallParser p(json::parse(kTools));
  ToolCallResult r = p.parse(
      "<tool_call><function=get_weather><parameter=days>three</parameter><parameter=scale>2</parameter>"
      "<parameter=opts>{broken</parameter><parameter=city>\n\nmulti\nline\n\n</parameter></function></tool_call>");
  ASSERT_EQ(r.tool_calls.size(), 1u);
  EXPECT_EQ(r.tool_calls[0].arguments,
            "{\"days\": \"three\", \"scale\": 2, \"opts\": \"{broken\", \"city\": \"\\nmulti\\nline\\n\"}");
  EXPECT_EQ(r.content, "");
}

TEST(ToolCallParser, InvalidUtf8BecomesReplacementCharacters) {
  ToolCallResult r = ToolCallParser().parse(
      "<tool_call><function=f\xfa><parameter=x>a\xff\xfe"
      "b</parameter></function></tool_call>");
  ASSERT_EQ(r.tool_calls.size(), 1u);
  EXPECT_EQ(r.tool_calls[0].name, "f\xEF\xBF\xBD");
  EXPECT_EQ(r.tool_calls[0].arguments,
            "{\"x\": \"a\xEF\xBF\xBD\xEF\xBF\xBD"
            "b\"}");
  EXPECT_TRUE(ordered_json::accept(r.tool_calls[0].arguments));
}

TEST(ToolCallParser, NoToolCallIsAllContent) {
  ToolCallParser p;
  ToolCallResult r = p.parse("Just an answer with a < sign and <tool_ almost.");
  EXPECT_TRUE(r.tool_calls.empty());
  EXPECT_EQ(r.content, "Just an answer with a < sign and <tool_ almost.");
}

TEST(ToolCallParser, UnterminatedCall) {
  ToolCallParser p(json::parse(kTools));
  ToolCallResult r = p.parse("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo");
  ASSERT_EQ(r.tool_calls.size(), 1u);  // cut off by max_tokens: parsed as far as it goes
  EXPECT_EQ(r.tool_calls[0].arguments, "{\"city\": \"Oslo\"}");
  ToolCallParser q;
  r = q.parse("text <tool_call> no function");
  EXPECT_TRUE(r.tool_calls.empty());
  EXPECT_EQ(r.content, "text <tool_call> no function");
}

// A runaway or hostile output: one call of 40,000 parameters none of which is closed (each value ends at the next
// <parameter=), 1 MB, streamed a byte at a time, then a </parameter> at the very end. Every value is parsed; the
// parser's work is linear in the text (a value search per parameter used to rescan the rest of the call, and each
// streamed byte the whole open call: about 10^10 byte comparisons here, minutes, now well under a second).
TEST(ToolCallParser, ManyUnclosedParametersStreamedByteByByte) {
  std::string text = "<tool_call>\n<function=f>\n";
  const int n = 40000;
  for (int i = 0; i < n; ++i) text += "<parameter=p" + std::to_string(i) + ">v" + std::to_string(i) + "\n";
  text += "</parameter>\n</function>\n</tool_call>";
  ToolCallParser p;
  size_t calls = 0;
  for (size_t i = 0; i < text.size(); ++i) calls += p.feed(std::string_view(text).substr(i, 1)).tool_calls.size();
  calls += p.finish().tool_calls.size();
  ASSERT_EQ(calls, 1u);
  const ToolCallResult whole = ToolCallParser().parse(text);
  ASSERT_EQ(whole.tool_calls.size(), 1u);
  const json args = json::parse(whole.tool_calls[0].arguments);
  ASSERT_EQ(args.size(), static_cast<size_t>(n));
  EXPECT_EQ(args["p0"], "v0");
  EXPECT_EQ(args["p39999"], "v39999");
}

TEST(ToolCallParser, StreamingOverEverySplit) {
  const std::string text =
      "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>\n"
      "<tool_call>\n<function=now>\n</function>\n</tool_call>";
  ToolCallResult whole = ToolCallParser(json::parse(kTools), 5).parse(text);
  ASSERT_EQ(whole.tool_calls.size(), 2u);
  for (size_t i = 0; i <= text.size(); ++i) {
    ToolCallParser p(json::parse(kTools), 5);
    std::string content;
    std::vector<ToolCall> calls;
    for (auto piece : {std::string_view(text).substr(0, i), std::string_view(text).substr(i)}) {
      ToolCallDelta d = p.feed(piece);
      EXPECT_EQ(d.first_index, calls.size());
      content += d.content;
      for (auto& c : d.tool_calls) calls.push_back(c);
    }
    ToolCallDelta d = p.finish();
    content += d.content;
    for (auto& c : d.tool_calls) calls.push_back(c);
    EXPECT_EQ(content, whole.content) << "cut at " << i;
    ASSERT_EQ(calls.size(), 2u) << "cut at " << i;
    for (size_t k = 0; k < 2; ++k) {
      EXPECT_EQ(calls[k].name, whole.tool_calls[k].name);
      EXPECT_EQ(calls[k].arguments, whole.tool_calls[k].arguments);
      EXPECT_EQ(calls[k].id, whole.tool_calls[k].id);
    }
  }
  // Content is emitted as it arrives; "<tool" is held back until it is known not to start a call.
  ToolCallParser p;
  EXPECT_EQ(p.feed("Hello <to").content, "Hello ");
  EXPECT_EQ(p.feed("day").content, "<today");
}

TEST(ToolCallParser, RoundTripsWhatTheNemotron3TemplateRenders) {
  std::ifstream in(test::source_path("tests/fixtures/chat_templates/nvidia-nemotron-3-nano-30b-a3b.jinja"),
                   std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  ChatTemplate t = ChatTemplate::from_string(ss.str(), "", "<|im_end|>");
  const ordered_json args = ordered_json::parse(
      R"({"city": "Zürich", "days": 2, "scale": 0.25, "metric": false, "opts": {"k": [1, "two"]}, "tags": ["a", "b"],
          "note": "line one\nline two"})");
  ordered_json msgs = ordered_json::array();
  msgs.push_back({{"role", "user"}, {"content", "weather?"}});
  msgs.push_back(
      {{"role", "assistant"},
       {"content", "Checking."},
       {"tool_calls",
        ordered_json::array(
            {{{"id", "c1"}, {"type", "function"}, {"function", {{"name", "get_weather"}, {"arguments", args}}}}})}});
  const std::string prompt = t.render(msgs, ordered_json::parse(kTools), false,
                                      ordered_json::parse(R"({"truncate_history_thinking": false})"));
  // The assistant turn as the model would have generated it (after the "<think>" the generation prompt opens).
  const std::string open = "<|im_start|>assistant\n";
  size_t a = prompt.rfind(open);
  ASSERT_NE(a, std::string::npos);
  std::string turn = prompt.substr(a + open.size());
  turn = turn.substr(0, turn.rfind("<|im_end|>"));
  ASSERT_NE(turn.find("<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich\n</parameter>"), std::string::npos)
      << turn;
  ToolCallResult r = ToolCallParser(json::parse(kTools)).parse(turn);
  EXPECT_EQ(r.content, "<think></think>Checking.\n");
  ASSERT_EQ(r.tool_calls.size(), 1u);
  EXPECT_EQ(r.tool_calls[0].name, "get_weather");
  // The template writes the metric flag as Python's "False"; booleans parse case-insensitively.
  EXPECT_EQ(ordered_json::parse(r.tool_calls[0].arguments), args);
}

}  // namespace
}  // namespace chimera::chat
