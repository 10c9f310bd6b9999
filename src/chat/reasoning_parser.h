// --reasoning-parser nemotron_v3: splits model output into reasoning_content (inside <think>...</think>) and
// content, with vLLM's NemotronV3ReasoningParser semantics (DeepSeek-R1's, since Nemotron 3's template opens
// "<think>\n" in the generation prompt so the output usually has no opening tag):
//   * an opening <think> is dropped; text up to the first </think> is reasoning, text after it is content;
//   * output without </think> is all reasoning, unless enable_thinking is false (chat_template_kwargs), in
//     which case it is all content.
// Streaming works on text deltas of any split: a tag may arrive across several deltas, so a suffix that could
// begin a tag is held back until the next delta (or finish()) decides it.
#pragma once

#include <string>
#include <string_view>

namespace chimera::chat {

struct ReasoningSplit {
  std::string reasoning;  // reasoning_content
  std::string content;
  // Whole-output results only: whether a </think> closed the reasoning (false: reasoning ran to the end).
  bool reasoning_ended = false;
};

class ReasoningParser {
 public:
  // enable_thinking: the request's chat_template_kwargs.enable_thinking (true when absent).
  explicit ReasoningParser(bool enable_thinking = true);

  // Streaming: the reasoning / content text this delta completes (either may be empty).
  ReasoningSplit feed(std::string_view delta);
  // End of output: whatever was held back.
  ReasoningSplit finish();

  // The whole output at once (non-streaming responses).
  static ReasoningSplit parse(std::string_view output, bool enable_thinking = true);

 private:
  enum class Phase { kStart, kReasoning, kContent };
  Phase phase_ = Phase::kStart;
  std::string pending_;  // held-back text that may begin a tag
};

}  // namespace chimera::chat
