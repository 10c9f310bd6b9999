// The UTF-8 helpers of src/chat/jinja_value.cpp: the one-pass invalid-byte replacement against its definition
// through the code-point decoder (every byte that starts no well-formed sequence becomes U+FFFD).
#include "chat/jinja_value.h"

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace chimera::chat::jinja {
namespace {

// The definition: decode (invalid bytes as U+DC80..U+DCFF escapes), map the escapes to U+FFFD, encode.
std::string replace_by_definition(std::string_view s) {
  std::vector<uint32_t> cps = utf8_decode(s);
  for (uint32_t& cp : cps) {
    if (cp >= 0xDC80 && cp <= 0xDCFF) cp = 0xFFFD;
  }
  return utf8_encode(cps, 0, cps.size());
}

TEST(JinjaUtf8, ReplaceInvalidMatchesTheDecoderDefinition) {
  const std::string fffd = "\xEF\xBF\xBD";
  EXPECT_EQ(utf8_replace_invalid(""), "");
  EXPECT_EQ(utf8_replace_invalid("plain ascii"), "plain ascii");
  EXPECT_EQ(utf8_replace_invalid("\xC3\xBC \xE2\x82\xAC \xF0\x9F\x98\x80"), "\xC3\xBC \xE2\x82\xAC \xF0\x9F\x98\x80");
  EXPECT_EQ(utf8_replace_invalid("a\x80z"), "a" + fffd + "z");                     // stray continuation byte
  EXPECT_EQ(utf8_replace_invalid("\xE2\x82"), fffd + fffd);                        // cut off: one per byte
  EXPECT_EQ(utf8_replace_invalid("\xC0\xAF"), fffd + fffd);                        // overlong
  EXPECT_EQ(utf8_replace_invalid("\xED\xA0\x80"), fffd + fffd + fffd);             // a surrogate
  EXPECT_EQ(utf8_replace_invalid("\xF4\x90\x80\x80"), fffd + fffd + fffd + fffd);  // past U+10FFFF
  EXPECT_EQ(utf8_replace_invalid("\xFF\xC3\xBC"), fffd + "\xC3\xBC");
  // Random bytes biased towards UTF-8 lead and continuation bytes, every length up to 40.
  std::mt19937 rng(7);
  const unsigned char pool[] = {'a',  ' ',  0x80, 0xBF, 0xC2, 0xC3, 0xC0, 0xE0, 0xE2, 0xED,
                                0xEF, 0xF0, 0xF4, 0xF5, 0xFF, 0xA0, 0x9F, 0x8F, 0x90, 0x82};
  for (int trial = 0; trial < 20000; ++trial) {
    std::string s(static_cast<size_t>(rng() % 41), '\0');
    for (char& c : s) c = static_cast<char>(pool[rng() % sizeof pool]);
    ASSERT_EQ(utf8_replace_invalid(s), replace_by_definition(s)) << "trial " << trial;
  }
}

TEST(JinjaUtf8, SequenceAtGivesLengthAndCodePoint) {
  uint32_t cp = 0;
  EXPECT_EQ(utf8_sequence_at("\xF0\x9F\x98\x80", 0, &cp), 4u);
  EXPECT_EQ(cp, 0x1F600u);
  EXPECT_EQ(utf8_sequence_at("x\xC3\xBC", 1, &cp), 2u);
  EXPECT_EQ(cp, 0xFCu);
  EXPECT_EQ(utf8_sequence_at("\xC3", 0, &cp), 0u);
  EXPECT_EQ(utf8_sequence_at("\xBC", 0, nullptr), 0u);
}

}  // namespace
}  // namespace chimera::chat::jinja
