// CPU tests of the custom AllReduce index arithmetic (src/dist/allreduce_index.h) and the strategy choice
// (src/dist/strategy.h) for 2, 4 and 8 ranks. These run in CI; the kernels use the same inline functions.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <set>
#include <span>
#include <vector>

#include "core/error.h"
#include "dist/allreduce_index.h"
#include "dist/strategy.h"

namespace chimera::dist {
namespace {

class RanksTest : public ::testing::TestWithParam<int> {};

TEST_P(RanksTest, TwoShotRangesPartitionEveryRow) {
  const int n = GetParam();
  for (int64_t vecs : {1, 2, 3, 7, 8, 16, 336, 560, 1024, 1025, 4096}) {
    int64_t next = 0, min_len = vecs, max_len = 0;
    for (int r = 0; r < n; ++r) {
      const Range range = twoshot_range(r, n, vecs);
      ASSERT_EQ(range.begin, next) << "rank " << r << " vecs " << vecs;  // contiguous, in rank order
      ASSERT_LE(range.begin, range.end);
      for (int64_t v = range.begin; v < range.end; ++v) ASSERT_EQ(twoshot_owner(v, n, vecs), r) << v;
      min_len = std::min(min_len, range.end - range.begin);
      max_len = std::max(max_len, range.end - range.begin);
      next = range.end;
    }
    EXPECT_EQ(next, vecs);            // covers the row
    EXPECT_LE(max_len - min_len, 1);  // balanced
  }
}

TEST_P(RanksTest, TwoShotStagingRegionsAreOnePerPeer) {
  // Every rank d's staging holds n - 1 regions: each peer s != d pushes into its own one, all in range.
  const int n = GetParam();
  for (int d = 0; d < n; ++d) {
    std::vector<int> users(static_cast<size_t>(n - 1), 0);
    for (int s = 0; s < n; ++s) {
      if (s == d) continue;
      const int region = twoshot_staging_region(s, d);
      ASSERT_GE(region, 0) << s << " -> " << d;
      ASSERT_LT(region, n - 1) << s << " -> " << d;
      ++users[static_cast<size_t>(region)];
    }
    for (int u : users) EXPECT_EQ(u, 1) << "rank " << d;
  }
}

TEST_P(RanksTest, LamportRegionsDoNotOverlap) {
  const int n = GetParam();
  const int64_t stride = 1000, msg = 640;  // a message smaller than the capacity
  std::set<int64_t> seen;
  for (int slot = 0; slot < kLamportSlots; ++slot) {
    for (int src = 0; src < n; ++src) {
      const int64_t first = lamport_offset(slot, src, 0, n, stride);
      const int64_t last = lamport_offset(slot, src, msg - 1, n, stride);
      EXPECT_EQ(last - first, msg - 1);
      EXPECT_TRUE(seen.insert(first / stride).second) << "slot " << slot << " src " << src;
      // The region lies inside its slot.
      EXPECT_GE(first, static_cast<int64_t>(slot) * n * stride);
      EXPECT_LT(last, static_cast<int64_t>(slot + 1) * n * stride);
    }
  }
  EXPECT_EQ(static_cast<int>(seen.size()), kLamportSlots * n);
}

TEST_P(RanksTest, LamportClearCoversExactlyTheWrittenRegions) {
  // The clear of a slot visits every element the call's pushes wrote there (every source rank's message), once,
  // and nothing else: not the unused tail of a region (the cost the clear must not pay), not another slot.
  const int n = GetParam();
  const int64_t stride = 1000;
  for (int64_t msg : {1, 7, 640, 1000}) {
    for (int slot = 0; slot < kLamportSlots; ++slot) {
      std::set<int64_t> written, cleared;
      for (int src = 0; src < n; ++src)
        for (int64_t e = 0; e < msg; ++e) written.insert(lamport_offset(slot, src, e, n, stride));
      const int64_t total = lamport_clear_elems(n, msg);
      for (int64_t j = 0; j < total; ++j) {
        EXPECT_TRUE(cleared.insert(lamport_clear_offset(slot, j, n, msg, stride)).second) << "twice: " << j;
      }
      EXPECT_EQ(cleared, written) << "msg " << msg << " slot " << slot;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(, RanksTest, ::testing::Values(2, 4, 8),
                         [](const ::testing::TestParamInfo<int>& i) { return "ranks" + std::to_string(i.param); });

TEST(LamportRotation, NeverClearsTheSlotBeingRead) {
  // Slot s is read, the slot read before it is cleared; the slot read next is untouched by this call, and every
  // slot is cleared exactly once between two reads of it.
  int slot = 0;
  std::vector<int> reads;
  for (int k = 0; k < 30; ++k) {
    const int next = lamport_next_slot(slot);
    EXPECT_NE(slot, lamport_clear_slot(slot));
    EXPECT_NE(next, lamport_clear_slot(slot));
    EXPECT_EQ(lamport_clear_slot(next), slot);
    reads.push_back(slot);
    slot = next;
  }
  for (size_t k = 3; k < reads.size(); ++k) EXPECT_EQ(reads[k], reads[k - 3]);
  EXPECT_EQ(std::set<int>(reads.begin(), reads.end()).size(), 3u);
}

TEST(Barrier, EpochComparisonIsWrapSafe) {
  EXPECT_TRUE(epoch_reached(5, 5));
  EXPECT_TRUE(epoch_reached(6, 5));  // a peer one barrier ahead
  EXPECT_FALSE(epoch_reached(4, 5));
  EXPECT_TRUE(epoch_reached(0, 0xffffffffu));
  EXPECT_FALSE(epoch_reached(0xffffffffu, 0));
}

TEST(Grid, SameRowsForEveryBlockOnEveryRank) {
  EXPECT_EQ(grid_blocks(1), 1);
  EXPECT_EQ(grid_blocks(64), 64);
  EXPECT_EQ(grid_blocks(4096), kMaxBlocks);
}

TEST(LookupKeys, Buckets) {
  EXPECT_EQ(ranks_index(2), 0);
  EXPECT_EQ(ranks_index(4), 1);
  EXPECT_EQ(ranks_index(8), 2);
  EXPECT_EQ(ranks_index(3), -1);
  // Hidden: the nearest listed size on a log scale (exact sizes their own row), clamped.
  const int64_t hidden[] = {128, 1024, 2048, 2688, 4096, 4480, 8192, 16384};
  const int nh = 8;
  EXPECT_EQ(table_hidden_index(hidden, nh, 2688), 3);
  EXPECT_EQ(table_hidden_index(hidden, nh, 4096), 4);
  EXPECT_EQ(table_hidden_index(hidden, nh, 4480), 5);
  EXPECT_EQ(table_hidden_index(hidden, nh, 8192), 6);
  EXPECT_EQ(table_hidden_index(hidden, nh, 16384), 7);
  EXPECT_EQ(table_hidden_index(hidden, nh, 128), 0);
  EXPECT_EQ(table_hidden_index(hidden, nh, 64), 0);
  EXPECT_EQ(table_hidden_index(hidden, nh, int64_t{1} << 40), 7);
  EXPECT_EQ(table_hidden_index(hidden, nh, 2300), 2);  // 2300^2 < 2048 x 2688: nearer 2048
  EXPECT_EQ(table_hidden_index(hidden, nh, 2400), 3);  // 2400^2 > 2048 x 2688: nearer 2688
  EXPECT_EQ(table_hidden_index(hidden, nh, 3000), 3);  // 3000 / 2688 = 1.12 < 4096 / 3000 = 1.37
  EXPECT_EQ(table_hidden_index(hidden, nh, 3400), 4);
  EXPECT_EQ(table_hidden_index(hidden, nh, 4200), 4);  // 4200 / 4096 < 4480 / 4200
  EXPECT_EQ(table_hidden_index(hidden, nh, 4300), 5);
  EXPECT_EQ(table_hidden_index(hidden, nh, 6144), 6);  // 6144^2 > 4480 x 8192
  EXPECT_EQ(table_hidden_index(hidden, nh, 256), 0);   // 256^2 < 128 x 1024: nearer 128
  EXPECT_EQ(table_hidden_index(hidden, nh, 512), 1);   // 512^2 > 128 x 1024: nearer 1024
  // Tokens: the smallest listed count >= tokens, clamped to the last.
  const int64_t tokens[] = {1, 2, 4, 64, 128, 192, 256, 8192};
  const int nt = 8;
  EXPECT_EQ(table_tokens_index(tokens, nt, 0), 0);
  EXPECT_EQ(table_tokens_index(tokens, nt, 1), 0);
  EXPECT_EQ(table_tokens_index(tokens, nt, 3), 2);
  EXPECT_EQ(table_tokens_index(tokens, nt, 64), 3);
  EXPECT_EQ(table_tokens_index(tokens, nt, 65), 4);
  EXPECT_EQ(table_tokens_index(tokens, nt, 128), 4);
  EXPECT_EQ(table_tokens_index(tokens, nt, 129), 5);
  EXPECT_EQ(table_tokens_index(tokens, nt, 192), 5);
  EXPECT_EQ(table_tokens_index(tokens, nt, 193), 6);
  EXPECT_EQ(table_tokens_index(tokens, nt, 8192), 7);
  EXPECT_EQ(table_tokens_index(tokens, nt, int64_t{1} << 30), 7);
}

TEST(LookupKeys, SweepGridIsAscendingAndHasTheModelSizes) {
  for (auto list : {std::span<const int64_t>(kSweepHidden), std::span<const int64_t>(kSweepTokens),
                    sm90_table_hidden(), sm90_table_tokens()}) {
    ASSERT_FALSE(list.empty());
    for (size_t i = 1; i < list.size(); ++i) EXPECT_LT(list[i - 1], list[i]);
  }
  // Nemotron-H hidden sizes have exact rows (the nearest-row rule would otherwise send 2688 to the 4096 row).
  for (int64_t h : {2688, 4096, 4480, 8192}) {
    EXPECT_NE(std::find(std::begin(kSweepHidden), std::end(kSweepHidden), h), std::end(kSweepHidden)) << h;
  }
  // Every token count the latency bench reports is a measured column.
  for (int64_t t : {1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096}) {
    EXPECT_NE(std::find(std::begin(kSweepTokens), std::end(kSweepTokens), t), std::end(kSweepTokens)) << t;
  }
}

TEST(LookupKeys, OneShotPerBlockChunksPartitionTheMessage) {
  // Block b of every rank pushes chunk b and the receiving rank's block b clears chunk b of the same total:
  // the chunks must tile [0, total) exactly for every total (so the clear covers exactly what was written).
  for (int64_t total : {0, 1, 16, 127, 128, 129, 336, 1024, 65536, 65537, 4096 * 2048}) {
    int64_t next = 0;
    for (int b = 0; b < kOneShotGrid; ++b) {
      const Range c = oneshot_chunk(b, kOneShotGrid, total);
      EXPECT_EQ(c.begin, next) << total << " block " << b;
      EXPECT_LE(c.begin, c.end);
      next = c.end;
    }
    EXPECT_EQ(next, total);
  }
  EXPECT_LE(kOneShotGrid, kMaxBlocks);
}

TEST(Strategy, NamesRoundTrip) {
  for (auto s : {AllReduceStrategy::kAuto, AllReduceStrategy::kNccl, AllReduceStrategy::kOneShot,
                 AllReduceStrategy::kTwoShot}) {
    EXPECT_EQ(strategy_from_name(strategy_name(s)), s);
  }
  EXPECT_EQ(strategy_from_name("ONESHOT"), AllReduceStrategy::kOneShot);
  EXPECT_FALSE(strategy_from_name("nvls").has_value());
  try {
    parse_strategy("nvls");
    FAIL() << "no exception";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidInput);
    EXPECT_NE(std::string(e.what()).find("oneshot"), std::string::npos) << e.what();
  }
}

constexpr FusionPattern kAllPatterns[] = {FusionPattern::kAllReduce, FusionPattern::kResidualRmsNorm,
                                          FusionPattern::kResidualRmsNormFp8, FusionPattern::kResidualRmsNormOutFp8,
                                          FusionPattern::kRmsNorm};

// The table (src/dist/sm90_allreduce_table.inc) is regenerated from measurements, so these tests check its shape
// and the lookup's clamping, not which strategy any entry holds.
TEST(Sm90Table, EveryEntryIsAConcreteStrategy) {
  for (int ranks : {2, 4, 8}) {
    for (FusionPattern p : kAllPatterns) {
      for (int64_t hidden : sm90_table_hidden()) {
        for (int64_t tokens : sm90_table_tokens()) {
          const AllReduceStrategy s = lookup_sm90(ranks, p, hidden, tokens);
          EXPECT_TRUE(s == AllReduceStrategy::kOneShot || s == AllReduceStrategy::kTwoShot ||
                      s == AllReduceStrategy::kNccl)
              << ranks << " ranks " << pattern_name(p) << " hidden " << hidden << " tokens " << tokens;
        }
      }
    }
  }
  // 4 and 8 ranks are not measured until a 4/8-GPU machine runs the sweep.
  EXPECT_FALSE(sm90_table_measured(4));
  EXPECT_FALSE(sm90_table_measured(8));
  EXPECT_FALSE(sm90_table_measured(3));
}

TEST(Sm90Table, BucketsRoundUpAndClampAtTheEdges) {
  for (int ranks : {2, 4, 8}) {
    for (FusionPattern p : kAllPatterns) {
      SCOPED_TRACE(std::to_string(ranks) + " ranks " + std::string(pattern_name(p)));
      // Whatever sizes the table lists: a token count between two columns takes the upper one, a hidden size
      // takes the nearest row (allreduce_index.h); below the first / above the last: the edge.
      const auto hs = sm90_table_hidden();
      const auto ts = sm90_table_tokens();
      for (size_t j = 1; j < ts.size(); ++j) {
        for (int64_t hidden : hs) {
          EXPECT_EQ(lookup_sm90(ranks, p, hidden, ts[j - 1] + 1), lookup_sm90(ranks, p, hidden, ts[j]));
        }
      }
      for (size_t i = 1; i < hs.size(); ++i) {
        for (int64_t tokens : ts) {
          EXPECT_EQ(lookup_sm90(ranks, p, hs[i] - 1, tokens), lookup_sm90(ranks, p, hs[i], tokens));
          EXPECT_EQ(lookup_sm90(ranks, p, hs[i - 1] + 1, tokens), lookup_sm90(ranks, p, hs[i - 1], tokens));
        }
      }
      for (int64_t tokens : {int64_t{1}, int64_t{64}, ts.back()}) {
        EXPECT_EQ(lookup_sm90(ranks, p, hs.front() / 2, tokens), lookup_sm90(ranks, p, hs.front(), tokens));
        EXPECT_EQ(lookup_sm90(ranks, p, 1, tokens), lookup_sm90(ranks, p, hs.front(), tokens));
        EXPECT_EQ(lookup_sm90(ranks, p, int64_t{1} << 20, tokens), lookup_sm90(ranks, p, hs.back(), tokens));
      }
      for (int64_t hidden : {hs.front(), hs.back()}) {
        EXPECT_EQ(lookup_sm90(ranks, p, hidden, 0), lookup_sm90(ranks, p, hidden, 1));
        EXPECT_EQ(lookup_sm90(ranks, p, hidden, int64_t{1} << 30), lookup_sm90(ranks, p, hidden, ts.back()));
      }
    }
  }
  // Rank counts the table has no rows for: NCCL.
  for (int ranks : {1, 3, 6, 16}) EXPECT_EQ(lookup_sm90(ranks, FusionPattern::kAllReduce, 4096, 1), AllReduceStrategy::kNccl);
}

TEST(Strategy, AutoReadsTheTableForEligibleCallsOnly) {
  StrategyQuery q{.n_ranks = 2, .pattern = FusionPattern::kResidualRmsNorm, .hidden = 8192, .tokens = 64,
                  .elem_bytes = 2, .peer_access = true, .max_message_bytes = 64 << 20};
  for (int64_t tokens : {1, 64, 128, 129, 1000, 4096}) {  // 4096 x 8192 x 2 = 64 MiB exactly: still fits
    q.tokens = tokens;
    EXPECT_EQ(select_strategy(q, AllReduceStrategy::kAuto), lookup_sm90(2, q.pattern, q.hidden, tokens)) << tokens;
    EXPECT_NE(select_strategy(q, AllReduceStrategy::kAuto), AllReduceStrategy::kAuto);
  }
  q.tokens = 4097;  // over the workspace: NCCL, even when forced
  EXPECT_EQ(select_strategy(q, AllReduceStrategy::kAuto), AllReduceStrategy::kNccl);
  EXPECT_EQ(select_strategy(q, AllReduceStrategy::kOneShot), AllReduceStrategy::kNccl);
  q.tokens = 1;
  EXPECT_EQ(select_strategy(q, AllReduceStrategy::kTwoShot), AllReduceStrategy::kTwoShot);  // forced wins
  EXPECT_EQ(select_strategy(q, AllReduceStrategy::kOneShot), AllReduceStrategy::kOneShot);
  EXPECT_EQ(select_strategy(q, AllReduceStrategy::kNccl), AllReduceStrategy::kNccl);
  q.peer_access = false;  // no peer access: only NCCL is eligible
  EXPECT_EQ(select_strategy(q, AllReduceStrategy::kOneShot), AllReduceStrategy::kNccl);
  EXPECT_EQ(select_strategy(q, AllReduceStrategy::kAuto), AllReduceStrategy::kNccl);
  q.peer_access = true;
  q.hidden = 100;  // 200 bytes a row: not whole 16-byte vectors
  EXPECT_EQ(select_strategy(q, AllReduceStrategy::kAuto), AllReduceStrategy::kNccl);
  q.hidden = 65536;  // 8192 vectors a row: over the register budget
  EXPECT_EQ(select_strategy(q, AllReduceStrategy::kAuto), AllReduceStrategy::kNccl);
  q.hidden = 8192;
  q.n_ranks = 16;
  EXPECT_EQ(select_strategy(q, AllReduceStrategy::kAuto), AllReduceStrategy::kNccl);
}

}  // namespace
}  // namespace chimera::dist
