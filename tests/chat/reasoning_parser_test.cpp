// ReasoningParser (nemotron_v3): vLLM's NemotronV3ReasoningParser semantics, whole and streamed over every
// split of the output.
#include "chat/reasoning_parser.h"

#include <optional>

#include <gtest/gtest.h>

namespace chimera::chat {
namespace {

struct Split {
  std::string reasoning, content;
};

Split stream(std::string_view text, const std::vector<size_t>& cuts, bool enable_thinking) {
  ReasoningParser p(enable_thinking);
  Split out;
  size_t prev = 0;
  for (size_t c : cuts) {
    ReasoningSplit s = p.feed(text.substr(prev, c - prev));
    out.reasoning += s.reasoning;
    out.content += s.content;
    prev = c;
  }
  ReasoningSplit s = p.feed(text.substr(prev));
  out.reasoning += s.reasoning;
  out.content += s.content;
  s = p.finish();
  out.reasoning += s.reasoning;
  out.content += s.content;
  return out;
}

TEST(ReasoningParser, WholeOutputAsVllm) {
  // The Nemotron 3 generation prompt already opened "<think>\n": the output starts inside the reasoning.
  ReasoningSplit r = ReasoningParser::parse("Let me think.\n</think>\nThe answer is 4.");
  EXPECT_EQ(r.reasoning, "Let me think.\n");
  EXPECT_EQ(r.content, "\nThe answer is 4.");
  EXPECT_TRUE(r.reasoning_ended);
  // An explicit opening tag is dropped (with what precedes it, as str.partition does in vLLM).
  r = ReasoningParser::parse("<think>abc</think>def");
  EXPECT_EQ(r.reasoning, "abc");
  EXPECT_EQ(r.content, "def");
  // No closing tag: all reasoning (the output was cut off while thinking).
  r = ReasoningParser::parse("still thinking");
  EXPECT_EQ(r.reasoning, "still thinking");
  EXPECT_EQ(r.content, "");
  EXPECT_FALSE(r.reasoning_ended);
  // enable_thinking false (the prompt ended "<think></think>"): no closing tag means all content.
  r = ReasoningParser::parse("Plain answer.", false);
  EXPECT_EQ(r.reasoning, "");
  EXPECT_EQ(r.content, "Plain answer.");
  // ... but a closing tag still splits, as in vLLM.
  r = ReasoningParser::parse("x</think>y", false);
  EXPECT_EQ(r.reasoning, "x");
  EXPECT_EQ(r.content, "y");
  // Only the first </think> splits; later tags are content.
  r = ReasoningParser::parse("a</think>b</think>c");
  EXPECT_EQ(r.reasoning, "a");
  EXPECT_EQ(r.content, "b</think>c");
  // vLLM partitions on the first <think> wherever it is, even after </think> (streaming never does).
  r = ReasoningParser::parse("a</think>b<think>c");
  EXPECT_EQ(r.reasoning, "c");
  EXPECT_EQ(r.content, "");
  r = ReasoningParser::parse("</think>");
  EXPECT_EQ(r.reasoning, "");
  EXPECT_EQ(r.content, "");
}

TEST(ReasoningParser, TagsSplitAcrossDeltas) {
  ReasoningParser p;
  EXPECT_EQ(p.feed("I think").reasoning, "I think");
  ReasoningSplit s = p.feed(" so</th");  // "</th" may begin </think>: held back
  EXPECT_EQ(s.reasoning, " so");
  EXPECT_EQ(s.content, "");
  s = p.feed("ink>\nDone");
  EXPECT_EQ(s.reasoning, "");
  EXPECT_EQ(s.content, "\nDone");
  s = p.feed(" <think>more");  // after the reasoning everything is content
  EXPECT_EQ(s.content, " <think>more");
  EXPECT_EQ(p.finish().content, "");

  // A held-back prefix that turns out not to be a tag is released.
  ReasoningParser q;
  EXPECT_EQ(q.feed("a <").reasoning, "a ");
  EXPECT_EQ(q.feed("b").reasoning, "<b");
  EXPECT_EQ(q.feed("</thin").reasoning, "");
  EXPECT_EQ(q.finish().reasoning, "</thin");  // cut off mid-tag: the text is reasoning

  // The opening tag split across deltas is dropped.
  ReasoningParser o;
  EXPECT_EQ(o.feed("<thi").reasoning, "");
  EXPECT_EQ(o.feed("nk>abc").reasoning, "abc");
}

TEST(ReasoningParser, ThinkingOffStreamsContent) {
  ReasoningParser p(false);
  EXPECT_EQ(p.feed("Hello").content, "Hello");
  EXPECT_EQ(p.feed(" world").content, " world");
  EXPECT_EQ(p.finish().content, "");
}

TEST(ReasoningParser, EverySplitEqualsTheWhole) {
  const std::vector<std::string> outputs = {
      "Reasoning here.\n</think>\n\nFinal answer.",
      "<think>\nA\n</think>\nB",
      "no end tag at all <",
      "</think>only content",
      "x</thi</think>y</think>",
      "héllo 🚀 </think> wörld",
      "<think></think>",
      "",
  };
  for (const auto& text : outputs) {
    ReasoningSplit whole = ReasoningParser::parse(text);
    // Every single cut and every pair of cuts.
    for (size_t i = 0; i <= text.size(); ++i) {
      for (size_t j = i; j <= text.size(); j += 3) {
        Split s = stream(text, {i, j}, true);
        std::string drop = text.find("<think>") != std::string::npos ? text.substr(0, text.find("<think>")) : "";
        // vLLM drops what precedes an opening tag in the whole output; streaming keeps it as reasoning.
        EXPECT_EQ(s.reasoning, drop + whole.reasoning) << text << " cut at " << i << "," << j;
        EXPECT_EQ(s.content, whole.content) << text << " cut at " << i << "," << j;
      }
    }
  }
}

}  // namespace
}  // namespace chimera::chat

namespace chimera::chat {
namespace {

// One piece of a stream by token id: text, or a tag token in its place.
struct Piece {
  std::string text;
  std::optional<ThinkTag> tag;
};

Split stream_by_token(const std::vector<Piece>& pieces, bool enable_thinking) {
  ReasoningParser p(enable_thinking, /*tags_in_text=*/false);
  Split out;
  auto add = [&](const ReasoningSplit& s) {
    out.reasoning += s.reasoning;
    out.content += s.content;
  };
  for (const Piece& piece : pieces) add(piece.tag ? p.tag(*piece.tag) : p.feed(piece.text));
  add(p.finish());
  return out;
}

TEST(ReasoningParser, TagsByTokenSplitWithoutTagText) {
  // The tag tokens come as tag(), never as text: the split needs no tag text (skip_special_tokens dropped it).
  Split s = stream_by_token({{"Let me think.\n", {}}, {"", ThinkTag::kClose}, {"\nThe answer is 4.", {}}}, true);
  EXPECT_EQ(s.reasoning, "Let me think.\n");
  EXPECT_EQ(s.content, "\nThe answer is 4.");
  // An opening tag token is dropped; the text after it is reasoning.
  s = stream_by_token({{"", ThinkTag::kOpen}, {"abc", {}}, {"", ThinkTag::kClose}, {"def", {}}}, true);
  EXPECT_EQ(s.reasoning, "abc");
  EXPECT_EQ(s.content, "def");
  // No closing tag: all reasoning.
  s = stream_by_token({{"still ", {}}, {"thinking", {}}}, true);
  EXPECT_EQ(s.reasoning, "still thinking");
  EXPECT_EQ(s.content, "");
}

TEST(ReasoningParser, TagsByTokenLeaveTagTextAlone) {
  // Tag text spelled by other tokens is not a tag (the tag is the token), in either phase.
  Split s = stream_by_token({{"a </think> b", {}}, {"", ThinkTag::kClose}, {"c <think> d</think>", {}}}, true);
  EXPECT_EQ(s.reasoning, "a </think> b");
  EXPECT_EQ(s.content, "c <think> d</think>");
}

TEST(ReasoningParser, TagsByTokenThatChangeNothingAreDropped) {
  // A second opening tag, tags after the reasoning ended: dropped, never in either field.
  Split s = stream_by_token({{"", ThinkTag::kOpen}, {"r", {}}, {"", ThinkTag::kOpen}, {"s", {}},
                             {"", ThinkTag::kClose}, {"c", {}}, {"", ThinkTag::kClose}, {"", ThinkTag::kOpen},
                             {"d", {}}},
                            true);
  EXPECT_EQ(s.reasoning, "rs");
  EXPECT_EQ(s.content, "cd");
  // enable_thinking false: all content, tag tokens dropped (the stream cannot take back content it sent).
  s = stream_by_token({{"x", {}}, {"", ThinkTag::kClose}, {"y", {}}}, false);
  EXPECT_EQ(s.reasoning, "");
  EXPECT_EQ(s.content, "xy");
}

TEST(ReasoningParser, TagTokenAfterTextTagsReleasesHeldText) {
  // In text mode a tag() still works: text held back as a possible tag start is released before it.
  ReasoningParser p;
  EXPECT_EQ(p.feed("a </th").reasoning, "a ");
  ReasoningSplit s = p.tag(ThinkTag::kClose);
  EXPECT_EQ(s.reasoning, "</th");
  EXPECT_TRUE(s.reasoning_ended);
  EXPECT_EQ(p.feed("b").content, "b");
}

}  // namespace
}  // namespace chimera::chat
