// The random dataset and the arrival times of chimera bench serve: lengths, the shared prefix, ids within
// the allowed vocabulary, determinism by seed, and vLLM's arrival-time normalization.
#include "bench_serve/dataset.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <set>

#include <gtest/gtest.h>

#include "common/backend_param.h"
#include "core/error.h"

namespace chimera::bench_serve {
namespace {

std::vector<int32_t> allowed_ids() {
  std::vector<int32_t> ids;
  for (int32_t i = 0; i < 500; ++i) {
    if (i % 100 != 0) ids.push_back(i);  // 0, 100, ... stand for special tokens
  }
  return ids;
}

TEST(BenchServeDataset, FixedLengthsAndSequentialIds) {
  RandomDatasetParams p;
  p.num_prompts = 7;
  p.input_len = 19;
  p.output_len = 5;
  const auto ids = allowed_ids();
  const auto reqs = random_dataset(p, ids);
  ASSERT_EQ(reqs.size(), 7u);
  const std::set<int32_t> allowed(ids.begin(), ids.end());
  for (size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_EQ(reqs[i].prompt_len, 19);
    EXPECT_EQ(reqs[i].prompt_ids.size(), 19u);
    EXPECT_EQ(reqs[i].output_len, 5);
    // allowed[(offset + i + k) % n]: consecutive positions step by one through the allowed list.
    const auto pos0 = std::find(ids.begin(), ids.end(), reqs[i].prompt_ids[0]) - ids.begin();
    for (size_t k = 0; k < reqs[i].prompt_ids.size(); ++k) {
      EXPECT_TRUE(allowed.count(reqs[i].prompt_ids[k]));
      EXPECT_EQ(reqs[i].prompt_ids[k], ids[(static_cast<size_t>(pos0) + k) % ids.size()]);
    }
  }
}

TEST(BenchServeDataset, RangeRatioPrefixAndSeed) {
  RandomDatasetParams p;
  p.num_prompts = 200;
  p.input_len = 100;
  p.output_len = 10;
  p.range_ratio = 0.25;
  p.prefix_len = 33;
  p.seed = 5;
  const auto ids = allowed_ids();
  const auto a = random_dataset(p, ids);
  int64_t min_in = 1 << 30, max_in = 0, min_out = 1 << 30, max_out = 0;
  for (const auto& r : a) {
    const int64_t own = r.prompt_len - 33;
    min_in = std::min(min_in, own);
    max_in = std::max(max_in, own);
    min_out = std::min(min_out, r.output_len);
    max_out = std::max(max_out, r.output_len);
    ASSERT_EQ(r.prompt_ids.size(), static_cast<size_t>(r.prompt_len));
    // Every prompt starts with the same 33-token prefix.
    EXPECT_TRUE(std::equal(r.prompt_ids.begin(), r.prompt_ids.begin() + 33, a[0].prompt_ids.begin()));
  }
  EXPECT_GE(min_in, 75);
  EXPECT_LE(max_in, 125);
  EXPECT_LT(min_in, 85);  // 200 uniform draws over [75, 125] reach near both ends
  EXPECT_GT(max_in, 115);
  EXPECT_GE(min_out, 7);
  EXPECT_LE(max_out, 13);
  EXPECT_LT(min_out, max_out);
  // Same seed, same prompts; another seed, other prompts.
  const auto b = random_dataset(p, ids);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i].prompt_ids, b[i].prompt_ids);
  p.seed = 6;
  const auto c = random_dataset(p, ids);
  EXPECT_NE(a[0].prompt_ids, c[0].prompt_ids);
}

// The chat replay: turn t of a conversation resends its turn t - 1 prompt and that turn's recorded reply, then a new
// user message; requests come turn by turn, each after its conversation's previous one.
TEST(BenchServeDataset, MultiTurnResendsTheConversationTurnByTurn) {
  MultiTurnParams p;
  p.conversations = 3;
  p.turns = 4;
  p.input_len = 7;
  p.output_len = 5;
  p.prefix_len = 11;
  p.seed = 9;
  const auto ids = allowed_ids();
  const auto r = multi_turn_dataset(p, ids);
  ASSERT_EQ(r.size(), 12u);
  for (size_t i = 0; i < r.size(); ++i) {
    const int64_t turn = static_cast<int64_t>(i) / 3;
    EXPECT_EQ(r[i].sample.prompt_len, 11 + 7 * (turn + 1) + 5 * turn) << i;
    EXPECT_EQ(r[i].sample.output_len, 5);
    EXPECT_EQ(r[i].after, turn == 0 ? -1 : static_cast<int64_t>(i) - 3);
    // Every prompt opens with the shared prefix; a turn's prompt starts with its previous turn's.
    EXPECT_TRUE(std::equal(r[0].sample.prompt_ids.begin(), r[0].sample.prompt_ids.begin() + 11,
                           r[i].sample.prompt_ids.begin()));
    if (turn > 0) {
      const auto& prev = r[static_cast<size_t>(r[i].after)].sample.prompt_ids;
      EXPECT_TRUE(std::equal(prev.begin(), prev.end(), r[i].sample.prompt_ids.begin())) << i;
    }
  }
  EXPECT_NE(r[0].sample.prompt_ids, r[1].sample.prompt_ids);  // conversations differ past the prefix
  p.turns = 0;
  EXPECT_TRUE(test::throws_error([&] { multi_turn_dataset(p, ids); }, ErrorKind::kInvalidInput, "--multi-turn-turns"));
}

TEST(BenchServeDataset, BadParametersNameTheFlag) {
  RandomDatasetParams p;
  p.range_ratio = 1.0;
  try {
    random_dataset(p, allowed_ids());
    FAIL() << "range ratio 1 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--random-range-ratio"), std::string::npos) << e.what();
  }
  EXPECT_THROW(random_dataset(RandomDatasetParams{}, {}), Error);
  RandomDatasetParams tiny;
  tiny.input_len = 1;
  tiny.range_ratio = 0.5;  // floor(0.5) = 0 tokens possible, no prefix
  EXPECT_THROW(random_dataset(tiny, allowed_ids()), Error);
  EXPECT_THROW(arrival_times(3, 0.0, 1.0, 0), Error);
  EXPECT_THROW(arrival_times(3, 1.0, 0.0, 0), Error);
}

TEST(BenchServeArrivals, InfiniteRateSendsAllAtOnce) {
  const auto t = arrival_times(5, std::numeric_limits<double>::infinity(), 1.0, 0);
  EXPECT_EQ(t, std::vector<double>(5, 0.0));
}

TEST(BenchServeArrivals, PoissonGapsNormalizedToNOverRate) {
  const int64_t n = 2000;
  const double rate = 50.0;
  const auto t = arrival_times(n, rate, 1.0, 3);
  ASSERT_EQ(t.size(), static_cast<size_t>(n));
  EXPECT_NEAR(t.back(), n / rate, 1e-9);
  std::vector<double> gaps(t.size());
  std::adjacent_difference(t.begin(), t.end(), gaps.begin());
  EXPECT_TRUE(std::all_of(gaps.begin(), gaps.end(), [](double g) { return g >= 0.0; }));
  double m = 0.0;
  for (double g : gaps) m += g;
  m /= static_cast<double>(gaps.size());
  double var = 0.0;
  for (double g : gaps) var += (g - m) * (g - m);
  const double cv = std::sqrt(var / static_cast<double>(gaps.size())) / m;
  EXPECT_NEAR(m, 1.0 / rate, 1e-9);
  EXPECT_NEAR(cv, 1.0, 0.1);  // exponential gaps: std = mean
  // Burstiness 4: Gamma(4) gaps, cv 1/2; infinite burstiness: evenly spaced.
  const auto g4 = arrival_times(n, rate, 4.0, 3);
  std::adjacent_difference(g4.begin(), g4.end(), gaps.begin());
  double var4 = 0.0;
  for (double g : gaps) var4 += (g - m) * (g - m);
  EXPECT_NEAR(std::sqrt(var4 / static_cast<double>(n)) / m, 0.5, 0.06);
  const auto even = arrival_times(4, 2.0, std::numeric_limits<double>::infinity(), 0);
  EXPECT_NEAR(even[0], 0.5, 1e-12);
  EXPECT_NEAR(even[3], 2.0, 1e-12);
}

}  // namespace
}  // namespace chimera::bench_serve
