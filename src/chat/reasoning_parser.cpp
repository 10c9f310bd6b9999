#include "chat/reasoning_parser.h"

#include <algorithm>

namespace chimera::chat {
namespace {

constexpr std::string_view kOpen = "<think>";
constexpr std::string_view kClose = "</think>";

// Length of the longest suffix of s that is a proper prefix of tag (text that may still become the tag).
size_t partial_tag_suffix(std::string_view s, std::string_view tag) {
  for (size_t n = std::min(s.size(), tag.size() - 1); n > 0; --n) {
    if (s.substr(s.size() - n) == tag.substr(0, n)) return n;
  }
  return 0;
}

}  // namespace

ReasoningParser::ReasoningParser(bool enable_thinking, bool tags_in_text)
    : phase_(enable_thinking ? Phase::kStart : Phase::kContent), tags_in_text_(tags_in_text) {}

ReasoningSplit ReasoningParser::feed(std::string_view delta) {
  ReasoningSplit out;
  if (phase_ == Phase::kContent) {
    // pending_ is empty here: the phase only turns to content after releasing it.
    out.content.assign(delta);
    return out;
  }
  if (!tags_in_text_) {
    out.reasoning.assign(delta);
    return out;
  }
  pending_.append(delta);
  // kStart: the opening tag has not been seen; the first <think> before </think> is dropped.
  size_t close = pending_.find(kClose);
  if (phase_ == Phase::kStart) {
    size_t open = pending_.find(kOpen);
    if (open != std::string::npos && (close == std::string::npos || open < close)) {
      pending_.erase(open, kOpen.size());
      phase_ = Phase::kReasoning;
      close = pending_.find(kClose);
    }
  }
  if (close != std::string::npos) {
    out.reasoning = pending_.substr(0, close);
    out.content = pending_.substr(close + kClose.size());
    pending_.clear();
    phase_ = Phase::kContent;
    return out;
  }
  size_t hold = partial_tag_suffix(pending_, kClose);
  if (phase_ == Phase::kStart) hold = std::max(hold, partial_tag_suffix(pending_, kOpen));
  out.reasoning = pending_.substr(0, pending_.size() - hold);
  pending_.erase(0, pending_.size() - hold);
  return out;
}

ReasoningSplit ReasoningParser::tag(ThinkTag t) {
  // Text held back as a possible tag start is plain text now: a tag token follows it.
  ReasoningSplit out = finish();
  if (t == ThinkTag::kOpen && phase_ == Phase::kStart) {
    phase_ = Phase::kReasoning;
  } else if (t == ThinkTag::kClose && phase_ != Phase::kContent) {
    phase_ = Phase::kContent;
    out.reasoning_ended = true;
  }
  return out;
}

ReasoningSplit ReasoningParser::finish() {
  ReasoningSplit out;
  if (phase_ == Phase::kContent) {
    out.content = std::move(pending_);
  } else {
    out.reasoning = std::move(pending_);
  }
  pending_.clear();
  return out;
}

ReasoningSplit ReasoningParser::parse(std::string_view output, bool enable_thinking) {
  ReasoningSplit out;
  size_t open = output.find(kOpen);
  std::string_view rest = open == std::string_view::npos ? output : output.substr(open + kOpen.size());
  size_t close = rest.find(kClose);
  if (close == std::string_view::npos) {
    // No closing tag: all reasoning, or all content when the request turned thinking off.
    if (enable_thinking)
      out.reasoning.assign(rest);
    else
      out.content.assign(rest);
    return out;
  }
  out.reasoning.assign(rest.substr(0, close));
  out.content.assign(rest.substr(close + kClose.size()));
  out.reasoning_ended = true;
  return out;
}

}  // namespace chimera::chat
