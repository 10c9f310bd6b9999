#include "dist/strategy.h"

#include <cctype>
#include <iterator>
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

// The generated table: kSm90Hidden[] and kSm90Tokens[] (the measured sizes, ascending), kSm90Measured[3] and
// kSm90Rows[3][kNumFusionPatterns][size of kSm90Hidden], one letter per entry of kSm90Tokens (O, T, N).
#include "dist/sm90_allreduce_table.inc"

constexpr int kTableHidden = static_cast<int>(std::size(kSm90Hidden));
constexpr int kTableTokens = static_cast<int>(std::size(kSm90Tokens));

constexpr AllReduceStrategy from_letter(char c) {
  return c == 'O' ? AllReduceStrategy::kOneShot : c == 'T' ? AllReduceStrategy::kTwoShot : AllReduceStrategy::kNccl;
}

// A malformed generated file fails the build, not a call: sizes positive and strictly ascending, every row one
// letter from {O, T, N} per measured token count.
constexpr bool ascending(const int64_t* v, int n) {
  for (int i = 0; i < n; ++i)
    if (v[i] <= 0 || (i > 0 && v[i] <= v[i - 1])) return false;
  return true;
}
constexpr bool table_well_formed() {
  if (!ascending(kSm90Hidden, kTableHidden) || !ascending(kSm90Tokens, kTableTokens)) return false;
  for (const auto& ranks : kSm90Rows)
    for (const auto& pattern : ranks)
      for (std::string_view row : pattern) {
        if (row.size() != static_cast<size_t>(kTableTokens)) return false;
        for (char c : row)
          if (c != 'O' && c != 'T' && c != 'N') return false;
      }
  return true;
}
static_assert(table_well_formed(),
              "sm90_allreduce_table.inc: ascending sizes, every row one letter from O, T, N per kSm90Tokens entry");

int hidden_index(int64_t hidden) { return table_hidden_index(kSm90Hidden, kTableHidden, hidden); }
int tokens_index(int64_t tokens) { return table_tokens_index(kSm90Tokens, kTableTokens, tokens); }

}  // namespace

AllReduceStrategy lookup_sm90(int n_ranks, FusionPattern pattern, int64_t hidden, int64_t tokens) {
  const int r = ranks_index(n_ranks);
  const int p = static_cast<int>(pattern);
  if (r < 0 || p < 0 || p >= kNumFusionPatterns) return AllReduceStrategy::kNccl;
  const std::string_view row = kSm90Rows[r][p][hidden_index(hidden)];
  return from_letter(row[static_cast<size_t>(tokens_index(tokens))]);
}

std::span<const int64_t> sm90_table_hidden() { return std::span<const int64_t>(kSm90Hidden); }
std::span<const int64_t> sm90_table_tokens() { return std::span<const int64_t>(kSm90Tokens); }

bool sm90_table_measured(int n_ranks) {
  const int r = ranks_index(n_ranks);
  return r >= 0 && kSm90Measured[r];
}

AllReduceStrategy select_strategy(const StrategyQuery& q, AllReduceStrategy forced) {
  if (!custom_eligible(q)) return AllReduceStrategy::kNccl;
  if (forced != AllReduceStrategy::kAuto) return forced;
  return lookup_sm90(q.n_ranks, q.pattern, q.hidden, q.tokens);
}

}  // namespace chimera::dist
