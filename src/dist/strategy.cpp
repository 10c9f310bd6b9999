#include "dist/strategy.h"

#include <array>
#include <cctype>
#include <string>

#include "core/error.h"
#include "dist/allreduce_index.h"

namespace chimera::dist {

std::string_view strategy_name(AllReduceStrategy s) {
  switch (s) {
    case AllReduceStrategy::kAuto: return "auto";
    case AllReduceStrategy::kNccl: return "nccl";
    case AllReduceStrategy::kOneShot: return "oneshot";
    case AllReduceStrategy::kTwoShot: return "twoshot";
  }
  return "?";
}

std::string_view pattern_name(FusionPattern p) {
  switch (p) {
    case FusionPattern::kAllReduce: return "allreduce";
    case FusionPattern::kResidualRmsNorm: return "residual_rmsnorm";
    case FusionPattern::kResidualRmsNormFp8: return "residual_rmsnorm_fp8";
    case FusionPattern::kResidualRmsNormOutFp8: return "residual_rmsnorm_out_fp8";
    case FusionPattern::kRmsNorm: return "rmsnorm";
  }
  return "?";
}

std::optional<AllReduceStrategy> strategy_from_name(std::string_view name) {
  std::string lower(name);
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  for (AllReduceStrategy s : {AllReduceStrategy::kAuto, AllReduceStrategy::kNccl, AllReduceStrategy::kOneShot,
                              AllReduceStrategy::kTwoShot}) {
    if (lower == strategy_name(s)) return s;
  }
  return std::nullopt;
}

AllReduceStrategy parse_strategy(std::string_view name) {
  if (auto s = strategy_from_name(name)) return *s;
  invalid_input("AllReduce strategy '{}' is not known (supported: auto, nccl, oneshot, twoshot)", name);
}

bool custom_eligible(const StrategyQuery& q) {
  if (!q.peer_access || q.n_ranks < 2 || q.n_ranks > kMaxRanks) return false;
  if (q.hidden <= 0 || q.tokens <= 0 || (q.elem_bytes != 2 && q.elem_bytes != 4)) return false;
  if ((q.hidden * q.elem_bytes) % 16 != 0 || q.hidden * q.elem_bytes / 16 > kMaxRowVecs) return false;
  return q.tokens * q.hidden * q.elem_bytes <= q.max_message_bytes;
}

namespace {

constexpr int kRanksIndices = 3;  // 2, 4, 8
using Table = std::array<AllReduceStrategy, kRanksIndices * kNumFusionPatterns * kHiddenBuckets * kTokenBuckets>;

constexpr int table_index(int ranks_idx, int pattern, int hidden_b, int tokens_b) {
  return ((ranks_idx * kNumFusionPatterns + pattern) * kHiddenBuckets + hidden_b) * kTokenBuckets + tokens_b;
}

// PROVISIONAL (see strategy.h): generated from the seed's rule, not from a measurement on the H200s.
// Bucket b of tokens covers (2^(b-1), 2^b]; ONESHOT while 2^b <= kOneShotMaxTokens.
constexpr Table make_provisional_sm90_table() {
  Table t{};
  for (int r = 0; r < kRanksIndices; ++r)
    for (int p = 0; p < kNumFusionPatterns; ++p)
      for (int h = 0; h < kHiddenBuckets; ++h)
        for (int b = 0; b < kTokenBuckets; ++b)
          t[static_cast<size_t>(table_index(r, p, h, b))] =
              (int64_t{1} << b) <= kOneShotMaxTokens ? AllReduceStrategy::kOneShot : AllReduceStrategy::kTwoShot;
  return t;
}
constexpr Table kSm90Table = make_provisional_sm90_table();

}  // namespace

AllReduceStrategy lookup_sm90(int n_ranks, FusionPattern pattern, int64_t hidden, int64_t tokens) {
  const int r = ranks_index(n_ranks);
  if (r < 0) return AllReduceStrategy::kNccl;
  return kSm90Table[static_cast<size_t>(
      table_index(r, static_cast<int>(pattern), hidden_bucket(hidden), tokens_bucket(tokens)))];
}

AllReduceStrategy select_strategy(const StrategyQuery& q, AllReduceStrategy forced) {
  if (!custom_eligible(q)) return AllReduceStrategy::kNccl;
  if (forced != AllReduceStrategy::kAuto) return forced;
  return lookup_sm90(q.n_ranks, q.pattern, q.hidden, q.tokens);
}

}  // namespace chimera::dist
