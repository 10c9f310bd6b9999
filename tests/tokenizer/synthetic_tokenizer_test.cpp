// synthetic_byte_level_tokenizer: exact size, byte-level round trips, every id decodes, the eos token.
#include "tokenizer/synthetic_tokenizer.h"

#include <chrono>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"

namespace chimera {
namespace {

const std::vector<int64_t> kEos = {2};  // the presets' eos_token_id

TEST(SyntheticTokenizer, HasExactlyTheRequestedVocabSize) {
  EXPECT_EQ(synthetic_byte_level_tokenizer(257, kEos).vocab_size(), 257);  // bytes and eos, no filler
  for (int64_t v : {4096, 131072, 262144}) {
    const Tokenizer t = synthetic_byte_level_tokenizer(v, kEos);
    EXPECT_EQ(t.vocab_size(), v);
    EXPECT_EQ(t.id_to_token(static_cast<int32_t>(v - 1)), "<|t" + std::to_string(v - 1) + "|>");
    EXPECT_THROW(t.decode(std::vector<int32_t>{static_cast<int32_t>(v)}), Error);
  }
}

TEST(SyntheticTokenizer, LargeVocabulariesBuildQuickly) {
  const auto t0 = std::chrono::steady_clock::now();
  const Tokenizer t = synthetic_byte_level_tokenizer(262144, kEos);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(t.vocab_size(), 262144);
  EXPECT_LT(s, 5.0) << "a 262144-entry vocabulary took " << s << " s";  // generous: a loaded 2-core CI machine
}

TEST(SyntheticTokenizer, TextEncodesToOneIdPerByteAndRoundTrips) {
  const Tokenizer t = synthetic_byte_level_tokenizer(131072, kEos);
  const std::vector<std::string> texts = {
      "Hello, world!",
      " leading and  double  spaces\tand\ttabs\nnew lines\n",
      "The quick brown fox jumps over the lazy dog 0123456789 ~!@#$%^&*()_+{}|:\"<>?",
      "caf\xC3\xA9 na\xC3\xAFve \xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E \xF0\x9F\x98\x80 \xD0\x9F\xD1\x80\xD0\xB8",
      "text around the special token <|eos|> and after it",
  };
  for (const std::string& text : texts) {
    const std::vector<int32_t> ids = t.encode(text);
    EXPECT_EQ(t.decode(ids), text) << text;
    EXPECT_EQ(t.encode(text, /*add_special_tokens=*/true), ids) << "the post-processor must add nothing";
  }
  // Text without "<|eos|>" in it is one id per byte, each below 257.
  const std::string utf8 = texts[3];
  const std::vector<int32_t> ids = t.encode(utf8);
  ASSERT_EQ(ids.size(), utf8.size());
  for (int32_t id : ids) {
    EXPECT_GE(id, 0);
    EXPECT_LE(id, 256);
  }
  // Every single byte, the control characters included (0x02 is the eos id's byte, moved to id 256).
  std::string all;
  for (int b = 1; b < 128; ++b) all += static_cast<char>(b);
  const std::vector<int32_t> all_ids = t.encode(all);
  ASSERT_EQ(all_ids.size(), all.size());
  EXPECT_EQ(t.decode(all_ids), all);
  EXPECT_EQ(all_ids[1], 256) << "byte 0x02";
  EXPECT_EQ(all_ids[0], 1);
  EXPECT_EQ(all_ids['A' - 1], 'A');
}

TEST(SyntheticTokenizer, EveryIdDecodesToText) {
  const int64_t v = 131072;
  const Tokenizer t = synthetic_byte_level_tokenizer(v, kEos);
  std::vector<int32_t> ids;
  for (int32_t id = 0; id < 600; ++id) ids.push_back(id);
  for (int32_t id = 600; id < v; id += 997) ids.push_back(id);
  ids.push_back(static_cast<int32_t>(v - 1));
  for (int32_t id : ids) {
    const std::string text = t.decode(std::vector<int32_t>{id});
    EXPECT_FALSE(text.empty()) << "id " << id;
    if (id >= 257) {
      EXPECT_EQ(text, "<|t" + std::to_string(id) + "|>");
      // A filler decodes to its spelling, which encodes back to bytes, not to the filler (no merges).
      EXPECT_EQ(t.encode(text).size(), text.size());
    }
  }
  EXPECT_EQ(t.decode(std::vector<int32_t>{'H', 'i', 257, ' ', 300}), "Hi<|t257|> <|t300|>");
}

TEST(SyntheticTokenizer, StreamingDecoderOverRandomIdsNeverThrows) {
  const int64_t v = 131072;
  const Tokenizer t = synthetic_byte_level_tokenizer(v, kEos);
  std::mt19937 rng(7);
  for (int trial = 0; trial < 20; ++trial) {
    // Half the ids are bytes so that partial / invalid UTF-8 sequences occur often.
    std::uniform_int_distribution<int32_t> any(0, static_cast<int32_t>(v - 1)), byte(0, 255);
    StreamingDecoder stream(t, /*skip_special_tokens=*/trial % 2 == 0);
    std::vector<int32_t> ids;
    std::string text;
    for (int i = 0; i < 200; ++i) {
      const int32_t id = (rng() & 1) != 0 ? any(rng) : byte(rng);
      ids.push_back(id);
      EXPECT_NO_THROW(text += stream.feed(id));
    }
    EXPECT_NO_THROW(text += stream.flush());
    EXPECT_EQ(text, t.decode(ids, trial % 2 == 0));
  }
}

TEST(SyntheticTokenizer, EosIdIsASpecialToken) {
  const Tokenizer t = synthetic_byte_level_tokenizer(131072, kEos);
  EXPECT_TRUE(t.is_special(2));
  EXPECT_EQ(t.id_to_token(2), "<|eos|>");
  EXPECT_EQ(t.token_to_id("<|eos|>"), 2);
  EXPECT_EQ(t.decode(std::vector<int32_t>{'o', 'k', 2}), "ok<|eos|>");
  EXPECT_EQ(t.decode(std::vector<int32_t>{'o', 'k', 2}, /*skip_special_tokens=*/true), "ok");
  EXPECT_EQ(t.encode("ok<|eos|>"), (std::vector<int32_t>{'o', 'k', 2}));
  for (int32_t id : {0, 1, 3, 255, 256, 131071}) EXPECT_FALSE(t.is_special(id)) << id;

  // Several eos ids (generation_config.json may list more): each a special token; out-of-range ones ignored.
  const std::vector<int64_t> eos = {2, 300, 11, 999999};
  const Tokenizer u = synthetic_byte_level_tokenizer(1024, eos);
  EXPECT_EQ(u.vocab_size(), 1024);
  for (int32_t id : {2, 11, 300}) EXPECT_TRUE(u.is_special(id)) << id;
  EXPECT_EQ(u.id_to_token(2), "<|eos|>");
  EXPECT_EQ(u.id_to_token(11), "<|eos_1|>");
  EXPECT_EQ(u.id_to_token(300), "<|eos_2|>");
  // The bytes of the eos ids below 256 (0x02, 0x0B) move to the first free ids from 256 on.
  const std::vector<int32_t> ids = u.encode(std::string("\x02\x0b"));
  EXPECT_EQ(ids, (std::vector<int32_t>{256, 257}));
  EXPECT_EQ(u.decode(ids), "\x02\x0b");
  EXPECT_EQ(u.id_to_token(258), "<|t258|>");
}

TEST(SyntheticTokenizer, TooSmallAVocabularyIsABadInput) {
  try {
    synthetic_byte_level_tokenizer(256, kEos);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidInput);
    EXPECT_NE(std::string(e.what()).find("vocab_size 256"), std::string::npos) << e.what();
  }
  EXPECT_EQ(synthetic_byte_level_tokenizer(256, {}).vocab_size(), 256);
}

}  // namespace
}  // namespace chimera
