#include "tokenizer/synthetic_tokenizer.h"

#include <algorithm>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "tokenizer/unicode.h"

namespace chimera {

using nlohmann::json;

Tokenizer synthetic_byte_level_tokenizer(int64_t vocab_size, std::span<const int64_t> eos_token_ids) {
  std::vector<int64_t> eos;
  for (int64_t id : eos_token_ids) {
    if (id >= 0 && id < vocab_size) eos.push_back(id);
  }
  std::sort(eos.begin(), eos.end());
  eos.erase(std::unique(eos.begin(), eos.end()), eos.end());
  const int64_t needed = 256 + static_cast<int64_t>(eos.size());
  if (vocab_size < needed || vocab_size > INT32_MAX) {
    invalid_input("synthetic tokenizer: vocab_size {} must be in [{}, {}] (256 byte ids plus {} eos id(s))",
                  vocab_size, needed, INT32_MAX, eos.size());
  }
  const auto is_eos = [&](int64_t id) { return std::binary_search(eos.begin(), eos.end(), id); };

  // id -> token string; the byte of an eos id takes the next free id from 256 on.
  std::vector<std::string> tokens(static_cast<size_t>(vocab_size));
  const auto& bytes = tok::byte_to_unicode();
  int64_t next_free = 256;
  for (int b = 0; b < 256; ++b) {
    int64_t id = b;
    if (is_eos(id)) {
      while (is_eos(next_free)) ++next_free;
      id = next_free++;
    }
    tokens[static_cast<size_t>(id)] = bytes[static_cast<size_t>(b)];
  }
  json added = json::array();
  for (size_t i = 0; i < eos.size(); ++i) {
    const std::string content = i == 0 ? std::string("<|eos|>") : "<|eos_" + std::to_string(i) + "|>";
    tokens[static_cast<size_t>(eos[i])] = content;
    added.push_back({{"id", eos[i]},
                     {"content", content},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", true}});
  }
  // Fillers use only '<', '|', 't', digits and '>': printable ASCII, which the byte-level alphabet maps to
  // itself, so they decode to exactly their spelling and never collide with a byte symbol or each other.
  for (int64_t id = 256; id < vocab_size; ++id) {
    std::string& t = tokens[static_cast<size_t>(id)];
    if (t.empty()) t = "<|t" + std::to_string(id) + "|>";
  }

  // The vocab object is written as text directly rather than built as a nlohmann object (a std::map of up to
  // 262144 keys) only to be dumped. Byte-level symbols are printable, so only '"' and '\\' need escaping.
  std::string vocab_text = "{";
  vocab_text.reserve(static_cast<size_t>(vocab_size) * 20);
  for (size_t id = 0; id < tokens.size(); ++id) {
    if (id > 0) vocab_text += ',';
    vocab_text += '"';
    for (char c : tokens[id]) {
      if (c == '"' || c == '\\') vocab_text += '\\';
      vocab_text += c;
    }
    vocab_text += "\":";
    vocab_text += std::to_string(id);
  }
  vocab_text += '}';
  const json byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true},
                           {"use_regex", true}};
  const json root = {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", added},
      {"normalizer", nullptr},
      {"pre_tokenizer", byte_level},
      {"post_processor", nullptr},
      {"decoder", byte_level},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", nullptr},
        {"continuing_subword_prefix", nullptr},
        {"end_of_word_suffix", nullptr},
        {"fuse_unk", false},
        {"byte_fallback", false},
        {"ignore_merges", false},
        {"merges", json::array()},
        {"vocab", "@VOCAB@"}}},
  };
  // Splice the vocab text in place of its placeholder (the only occurrence: no other string contains '@').
  std::string text = root.dump();
  const std::string placeholder = "\"@VOCAB@\"";
  text.replace(text.find(placeholder), placeholder.size(), vocab_text);
  return Tokenizer::from_json(text,
                              "synthetic byte-level tokenizer (vocab_size " + std::to_string(vocab_size) + ")");
}

}  // namespace chimera
