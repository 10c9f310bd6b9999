// The BPE model of tokenizer.json: vocab, ranked merges, unk / byte_fallback / ignore_merges.
// tokenize() follows HF's Word::merge_all: a min-heap of (rank, position) over adjacent symbol pairs,
// stale entries skipped, so ties go to the leftmost pair exactly as in tokenizers.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace chimera::tok {

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using TokenMap = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

// Unused ids allowed in a vocabulary's id space (model.vocab, added_tokens) beyond the tokens it defines.
inline constexpr int64_t kMaxIdHoles = 1 << 16;

class Bpe {
 public:
  // model: the "model" object of tokenizer.json; source names the file in errors.
  Bpe(const nlohmann::json& model, const std::string& source);
  Bpe(Bpe&& other) noexcept;

  // Appends the ids of one pre-tokenized piece (non-empty, valid UTF-8).
  void tokenize(std::string_view piece, std::vector<int32_t>& out) const;

  std::optional<int32_t> token_to_id(std::string_view token) const;
  const std::string* id_to_token(int32_t id) const;  // nullptr when the id is not in the vocab
  int32_t max_id() const { return static_cast<int32_t>(id_to_token_.size()) - 1; }

 private:
  struct Merge {
    int32_t rank;
    int32_t new_id;
  };
  static uint64_t pair_key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }
  void merge_word(std::string_view piece, std::vector<int32_t>& out) const;

  TokenMap vocab_;
  std::vector<std::string> id_to_token_;
  std::vector<bool> has_id_;
  std::unordered_map<uint64_t, Merge> merges_;
  std::optional<int32_t> unk_id_;
  bool fuse_unk_ = false;
  bool byte_fallback_ = false;
  bool ignore_merges_ = false;
  std::array<int32_t, 256> byte_fallback_ids_{};  // id of "<0xXX>", -1 when absent

  // Cache of whole pieces (words repeat a lot in natural text).
  static constexpr size_t kCacheCapacity = 1 << 16;
  static constexpr size_t kCacheMaxPieceBytes = 128;
  mutable std::mutex cache_mu_;
  mutable std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>> cache_;
};

}  // namespace chimera::tok
