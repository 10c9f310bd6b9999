// --reasoning-parser nemotron_v3: splits model output into reasoning_content (inside <think>...</think>) and
// content, with vLLM's NemotronV3ReasoningParser semantics (DeepSeek-R1's, since Nemotron 3's template opens
// "<think>\n" in the generation prompt so the output usually has no opening tag):
//   * an opening <think> is dropped; text up to the first </think> is reasoning, text after it is content;
//   * output without </think> is all reasoning, unless enable_thinking is false (chat_template_kwargs), in
//     which case it is all content.
// The tags are found in one of two ways:
//   * by token id (tags_in_text false): where the tokenizer has <think> / </think> as single tokens (Nemotron 3's
//     are special tokens, which skip_special_tokens drops from the text), the caller reports each tag token
//     through tag() in its place in the stream, and the text is never searched, as vLLM's think-tag parsers
//     look for the start / end token ids. The split then does not depend on skip_special_tokens, and tag text
//     spelled with other tokens stays text.
//   * by text (tags_in_text true): a tag may arrive across several deltas, so a suffix that could begin a tag
//     is held back until the next delta (or finish()) decides it.
// A tag never appears in either field: one that does not change the phase (a second <think>, a tag after
// </think>, any tag when enable_thinking is false) is dropped.
#pragma once

#include <string>
#include <string_view>

namespace chimera::chat {

enum class ThinkTag { kOpen, kClose };

struct ReasoningSplit {
  std::string reasoning;  // reasoning_content
  std::string content;
  // Whole-output results only: whether a </think> closed the reasoning (false: reasoning ran to the end).
  bool reasoning_ended = false;
};

class ReasoningParser {
 public:
  // enable_thinking: the request's chat_template_kwargs.enable_thinking (true when absent).
  explicit ReasoningParser(bool enable_thinking = true, bool tags_in_text = true);

  // Streaming: the reasoning / content text this delta completes (either may be empty).
  ReasoningSplit feed(std::string_view delta);
  // A tag token at this point of the stream (after the text fed so far): the held-back text it completes.
  ReasoningSplit tag(ThinkTag t);
  // End of output: whatever was held back.
  ReasoningSplit finish();

  // The whole output at once, tags by text.
  static ReasoningSplit parse(std::string_view output, bool enable_thinking = true);

 private:
  enum class Phase { kStart, kReasoning, kContent };
  Phase phase_ = Phase::kStart;
  bool tags_in_text_ = true;
  std::string pending_;  // held-back text that may begin a tag
};

}  // namespace chimera::chat
