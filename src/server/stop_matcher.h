// Stop strings over streamed text: a stop string may span any number of tokens and is never emitted. Text that
// could still become the start of a stop string is held back until it either completes one (then it and
// everything after it are dropped) or cannot any more (then it is released).
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace chimera::server {

class StopMatcher {
 public:
  explicit StopMatcher(std::vector<std::string> stops);
  // Appends newly decoded text; returns the text that is now safe to emit. After a match, returns the text
  // before the stop string and stopped() turns true; later calls return "". The match is the stop string that
  // completes first, as if the text arrived one byte at a time (of two completing at the same byte, the longer),
  // so any cut of the text into pieces gives the same output.
  std::string feed(std::string_view text);
  // At the end of the sequence (no stop matched): the held-back text.
  std::string flush();
  bool stopped() const { return stopped_; }
  // The stop string that matched ("" before a match).
  const std::string& matched() const { return matched_; }

 private:
  std::vector<std::string> stops_;
  std::string pending_;  // text not yet emitted: a suffix that is a proper prefix of some stop string
  std::string matched_;
  bool stopped_ = false;
};

}  // namespace chimera::server
