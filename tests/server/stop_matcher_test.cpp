// Stop strings over text that arrives in pieces: never emitted, matched across pieces, held back only while
// the text could still become a stop string.
#include "server/stop_matcher.h"

#include <gtest/gtest.h>

namespace chimera::server {
namespace {

// Feeds `pieces` one by one; returns everything emitted (feeds + final flush).
std::string run(StopMatcher& m, const std::vector<std::string>& pieces) {
  std::string out;
  for (const std::string& p : pieces) out += m.feed(p);
  return out + m.flush();
}

TEST(StopMatcher, NoStopsPassesThrough) {
  StopMatcher m({});
  EXPECT_EQ(m.feed("abc"), "abc");
  EXPECT_EQ(m.feed(""), "");
  EXPECT_FALSE(m.stopped());
}

TEST(StopMatcher, MatchWithinOnePiece) {
  StopMatcher m({"STOP"});
  EXPECT_EQ(m.feed("helloSTOPworld"), "hello");
  EXPECT_TRUE(m.stopped());
  EXPECT_EQ(m.matched(), "STOP");
  EXPECT_EQ(m.feed("more"), "");
  EXPECT_EQ(m.flush(), "");
}

TEST(StopMatcher, MatchAcrossPiecesIsHeldBack) {
  StopMatcher m({"</end>"});
  EXPECT_EQ(m.feed("text <"), "text ");  // "<" may start the stop string
  EXPECT_EQ(m.feed("/e"), "");
  EXPECT_EQ(m.feed("nd"), "");
  EXPECT_EQ(m.feed(">tail"), "");
  EXPECT_TRUE(m.stopped());
}

TEST(StopMatcher, FalseStartIsReleased) {
  StopMatcher m({"abc"});
  EXPECT_EQ(m.feed("xa"), "x");
  EXPECT_EQ(m.feed("b"), "");
  EXPECT_EQ(m.feed("d"), "abd");
  EXPECT_FALSE(m.stopped());
  EXPECT_EQ(m.feed("ab"), "");
  EXPECT_EQ(m.flush(), "ab");  // the sequence ended without completing it
}

TEST(StopMatcher, OverlappingPrefixes) {
  // "aab" inside "aaab": the held suffix must restart correctly.
  StopMatcher m({"aab"});
  EXPECT_EQ(run(m, {"a", "a", "a", "b", "z"}), "a");
  EXPECT_TRUE(m.stopped());
}

TEST(StopMatcher, EarliestOfSeveralWins) {
  StopMatcher m({"world", "lo w"});
  EXPECT_EQ(run(m, {"hel", "lo wor", "ld"}), "hel");
  EXPECT_EQ(m.matched(), "lo w");
}

TEST(StopMatcher, EveryPieceSplitAgreesWithWholeText) {
  // All ways to cut the text into two or three pieces give the same output as feeding it whole.
  const std::string text = "one <stop> two </stop> three";
  const std::vector<std::string> stops = {"</stop>", "<stop>x", "two"};
  StopMatcher whole(stops);
  const std::string expected = run(whole, {text});
  EXPECT_EQ(expected, "one <stop> ");
  for (size_t i = 0; i <= text.size(); ++i) {
    for (size_t j = i; j <= text.size(); ++j) {
      StopMatcher m(stops);
      EXPECT_EQ(run(m, {text.substr(0, i), text.substr(i, j - i), text.substr(j)}), expected) << i << "," << j;
    }
  }
}

TEST(StopMatcher, FirstToCompleteWinsOverAnEarlierStart) {
  // "cd" completes inside "abcdef": fed in pieces the text stops at "cd" before "abcdef" can complete, so fed
  // whole it must stop there too (it used to pick "abcdef", the earliest start, and give "xx").
  const std::string text = "xxabcdefyy";
  const std::vector<std::string> stops = {"abcdef", "cd"};
  for (size_t i = 0; i <= text.size(); ++i) {
    StopMatcher m(stops);
    EXPECT_EQ(run(m, {text.substr(0, i), text.substr(i)}), "xxab") << i;
    EXPECT_EQ(m.matched(), "cd") << i;
  }
  // Two ending at the same byte: the longer one (it starts first).
  StopMatcher m({"ef", "cdef"});
  EXPECT_EQ(run(m, {text}), "xxab");
  EXPECT_EQ(m.matched(), "cdef");
}

TEST(StopMatcher, Utf8StopString) {
  StopMatcher m({"\xc3\xa9t\xc3\xa9"});  // "été"
  EXPECT_EQ(m.feed("un \xc3\xa9"), "un ");
  EXPECT_EQ(m.feed("t"), "");
  EXPECT_EQ(m.feed("\xc3\xa9 chaud"), "");
  EXPECT_TRUE(m.stopped());
}

}  // namespace
}  // namespace chimera::server
