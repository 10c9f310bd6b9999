// ChatTemplate vs transformers' apply_chat_template: every case of tests/fixtures/chat_templates/goldens.json
// (made by scripts/make_chat_goldens.py from the published templates kept beside it) must render byte for byte,
// and must fail where transformers raises.
#include "chat/chat_template.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include <gtest/gtest.h>

#include "common/compare.h"
#include "core/error.h"

namespace chimera::chat {
namespace {

using nlohmann::ordered_json;

std::string fixture_dir() {
  return test::source_path("tests/fixtures/chat_templates");
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << path;
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Where two prompts first differ, with some context, escaped so that whitespace is visible.
std::string show_difference(const std::string& got, const std::string& want) {
  size_t i = 0;
  while (i < got.size() && i < want.size() && got[i] == want[i]) ++i;
  size_t from = i > 60 ? i - 60 : 0;
  auto esc = [](const std::string& s) { return ordered_json(s).dump(); };
  return "first difference at byte " + std::to_string(i) + " (got " + std::to_string(got.size()) + " bytes, want " +
         std::to_string(want.size()) + ")\n  got : " + esc(got.substr(from, 160)) +
         "\n  want: " + esc(want.substr(from, 160));
}

TEST(ChatTemplateGoldens, EveryCaseMatchesTransformers) {
  const ordered_json goldens = ordered_json::parse(read_text(fixture_dir() + "/goldens.json"));
  std::map<std::string, ChatTemplate> templates;
  for (const auto& [file, tokens] : goldens["special_tokens"].items()) {
    templates.emplace(
        file, ChatTemplate::from_string(read_text(fixture_dir() + "/" + file), tokens["bos_token"].get<std::string>(),
                                        tokens["eos_token"].get<std::string>(), file));
  }
  size_t matched = 0, raised = 0;
  for (const auto& c : goldens["cases"]) {
    const std::string name = c["template"].get<std::string>() + "/" + c["messages"].get<std::string>() + "/" +
                             c["tools"].get<std::string>() + "/" + c["kwargs"].get<std::string>() + "/" +
                             (c["add_generation_prompt"].get<bool>() ? "gen" : "nogen");
    const ChatTemplate& t = templates.at(c["template"].get<std::string>());
    const ordered_json& messages = goldens["conversations"][c["messages"].get<std::string>()];
    const ordered_json& tools = goldens["toolsets"][c["tools"].get<std::string>()];
    const ordered_json& kwargs = goldens["kwargs"][c["kwargs"].get<std::string>()];
    const bool gen = c["add_generation_prompt"].get<bool>();
    if (c.contains("error")) {
      try {
        std::string out = t.render(messages, tools, gen, kwargs);
        ADD_FAILURE() << name << ": transformers raised (" << c["error"].get<std::string>()
                      << ") but the render succeeded:\n"
                      << out;
      } catch (const Error& e) {
        EXPECT_EQ(e.kind(), ErrorKind::kInvalidInput) << name << ": " << e.what();
        ++raised;
      }
      continue;
    }
    const std::string want = c["expected"].get<std::string>();
    try {
      std::string got = t.render(messages, tools, gen, kwargs);
      if (got == want)
        ++matched;
      else
        ADD_FAILURE() << name << ": " << show_difference(got, want);
    } catch (const Error& e) {
      ADD_FAILURE() << name << ": render failed: " << e.what();
    }
  }
  EXPECT_GT(matched, 500u);
  EXPECT_GT(raised, 0u);
  std::cout << "[ chat goldens ] " << matched << " prompts equal transformers', " << raised
            << " raise where transformers raises\n";
}

TEST(ChatTemplateLoad, ReadsTokenizerConfigAndJinjaFile) {
  const auto dir = std::filesystem::temp_directory_path() / ("chimera_chat_load_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  auto write = [&](const std::string& name, const std::string& text) { std::ofstream(dir / name) << text; };

  // No template anywhere: nullopt.
  write("tokenizer_config.json", R"({"bos_token": "<s>", "eos_token": {"content": "</s>", "lstrip": false}})");
  EXPECT_FALSE(ChatTemplate::load(dir).has_value());

  // The string form; bos / eos from strings or AddedToken objects.
  write(
      "tokenizer_config.json",
      R"({"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"})");
  auto t = ChatTemplate::load(dir);
  ASSERT_TRUE(t.has_value());
  ordered_json msgs = ordered_json::parse(R"([{"role": "user", "content": "hi"}])");
  EXPECT_EQ(t->render(msgs, nullptr, false, nullptr), "<s>hi</s>");

  // The list form: "default" for chats, "tool_use" when tools are given (even an empty list), as transformers.
  write(
      "tokenizer_config.json",
      R"({"chat_template": [{"name": "tool_use", "template": "T{{ tools | length }}"}, {"name": "default", "template": "D"}]})");
  t = ChatTemplate::load(dir);
  ASSERT_TRUE(t.has_value());
  EXPECT_TRUE(t->has_tool_use_variant());
  EXPECT_EQ(t->render(msgs, nullptr, false, nullptr), "D");
  EXPECT_EQ(t->render(msgs, ordered_json::array(), false, nullptr), "T0");

  // chat_template.jinja takes precedence over tokenizer_config, as in transformers.
  write("chat_template.jinja", "J{{ add_generation_prompt }}\n");
  t = ChatTemplate::load(dir);
  ASSERT_TRUE(t.has_value());
  EXPECT_EQ(t->render(msgs, nullptr, true, nullptr), "JTrue");

  // A broken template names the file and the line.
  write("chat_template.jinja", "line one\n{% if x %}\nno endif");
  try {
    ChatTemplate::load(dir);
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidInput);
    EXPECT_NE(std::string(e.what()).find("chat_template.jinja line 2"), std::string::npos) << e.what();
  }
  write("chat_template.jinja", "");
  std::filesystem::remove(dir / "chat_template.jinja");
  write("tokenizer_config.json", "{not json");
  EXPECT_THROW(ChatTemplate::load(dir), Error);
  std::filesystem::remove_all(dir);
}

TEST(ChatTemplateRender, BadArgumentsAreInvalidInput) {
  ChatTemplate t = ChatTemplate::from_string("{{ messages | length }}", "", "");
  try {
    t.render(ordered_json::object(), nullptr, false, nullptr);
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidInput);
  }
  EXPECT_THROW(t.render(ordered_json::array(), nullptr, false, nullptr), Error);  // empty conversation
  EXPECT_THROW(t.render(ordered_json::parse(R"([{"role":"user","content":"x"}])"), ordered_json("x"), false, nullptr),
               Error);
  // kwargs become variables and may override the defaults.
  ChatTemplate k = ChatTemplate::from_string("{{ enable_thinking }} {{ add_generation_prompt }}", "", "");
  EXPECT_EQ(k.render(ordered_json::parse(R"([{"role":"user","content":"x"}])"), nullptr, true,
                     ordered_json::parse(R"({"enable_thinking": false})")),
            "False True");
}

TEST(ChatTemplateRender, NormalizesMessagesAsTransformers) {
  // None-valued keys are dropped; reasoning under any of its names is aliased to reasoning_content / thinking.
  ChatTemplate t = ChatTemplate::from_string(
      "{% for m in messages %}{{ m.keys() | list }}|{{ m.reasoning_content }}|{{ m.thinking }};{% endfor %}", "", "");
  ordered_json msgs =
      ordered_json::parse(R"([{"role":"user","content":null},{"role":"assistant","content":"a","reasoning":"r"}])");
  EXPECT_EQ(t.render(msgs, nullptr, false, nullptr),
            "['role']||;['thinking', 'role', 'content', 'reasoning', 'reasoning_content']|r|r;");
}

TEST(ChatTemplateRender, ToolCallArgumentsAsObjects) {
  ordered_json msgs = ordered_json::parse(R"([{"role":"assistant","content":"","tool_calls":[
      {"id":"1","type":"function","function":{"name":"f","arguments":"{\"b\": 1, \"a\": [2]}"}},
      {"id":"2","type":"function","function":{"name":"g","arguments":"not json"}}]}])");
  ordered_json out = tool_call_arguments_as_objects(msgs);
  EXPECT_EQ(out[0]["tool_calls"][0]["function"]["arguments"].dump(), R"({"b":1,"a":[2]})");
  EXPECT_EQ(out[0]["tool_calls"][1]["function"]["arguments"], "not json");
}

}  // namespace
}  // namespace chimera::chat
