#include "runtime/sampler.h"

#include <cmath>
#include <map>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"

namespace chimera {
namespace {

TEST(Sampler, GreedyTakesArgmaxAndLowestIdOnTies) {
  SamplingParams p;
  std::vector<float> l{0.1f, 3.0f, -1.0f, 3.0f};
  EXPECT_EQ(sample_token(l, p, 0), 1);
  l[3] = 3.5f;
  EXPECT_EQ(sample_token(l, p, 0), 3);
}

TEST(Sampler, TopKOneIsGreedy) {
  SamplingParams p;
  p.temperature = 5.0f;
  p.top_k = 1;
  std::vector<float> l{0.1f, 0.2f, 0.15f};
  for (uint64_t s = 0; s < 50; ++s) EXPECT_EQ(sample_token(l, p, s), 1);
}

TEST(Sampler, SeededAndReproducible) {
  SamplingParams p;
  p.temperature = 1.0f;
  p.seed = 42;
  std::vector<float> l(100);
  for (size_t i = 0; i < l.size(); ++i) l[i] = std::sin(static_cast<float>(i));
  std::vector<int32_t> a, b;
  for (uint64_t s = 0; s < 64; ++s) a.push_back(sample_token(l, p, s));
  for (uint64_t s = 0; s < 64; ++s) b.push_back(sample_token(l, p, s));
  EXPECT_EQ(a, b);
  p.seed = 43;
  std::vector<int32_t> c;
  for (uint64_t s = 0; s < 64; ++s) c.push_back(sample_token(l, p, s));
  EXPECT_NE(a, c);
}

TEST(Sampler, FrequenciesFollowTheSoftmax) {
  SamplingParams p;
  p.temperature = 1.0f;
  std::vector<float> l{std::log(0.5f), std::log(0.3f), std::log(0.2f)};
  std::map<int32_t, int> n;
  const int draws = 20000;
  for (int s = 0; s < draws; ++s) ++n[sample_token(l, p, static_cast<uint64_t>(s))];
  EXPECT_NEAR(n[0] / double(draws), 0.5, 0.02);
  EXPECT_NEAR(n[1] / double(draws), 0.3, 0.02);
  EXPECT_NEAR(n[2] / double(draws), 0.2, 0.02);
}

TEST(Sampler, TopKAndTopPRestrictTheSupport) {
  std::vector<float> l{std::log(0.4f), std::log(0.3f), std::log(0.2f), std::log(0.1f)};
  SamplingParams p;
  p.temperature = 1.0f;
  p.top_k = 2;
  for (uint64_t s = 0; s < 2000; ++s) EXPECT_LT(sample_token(l, p, s), 2);
  p.top_k = 0;
  p.top_p = 0.65f;  // 0.4 + 0.3 >= 0.65: only the two most likely survive
  std::map<int32_t, int> n;
  for (uint64_t s = 0; s < 4000; ++s) ++n[sample_token(l, p, s)];
  EXPECT_EQ(n.count(2) + n.count(3), 0u);
  EXPECT_NEAR(n[0] / 4000.0, 0.4 / 0.7, 0.03);
  p.top_p = 0.1f;  // always keeps at least the best token
  for (uint64_t s = 0; s < 100; ++s) EXPECT_EQ(sample_token(l, p, s), 0);
}

TEST(Sampler, TemperatureSharpens) {
  std::vector<float> l{1.0f, 0.0f};
  SamplingParams p;
  p.temperature = 0.05f;
  int zeros = 0;
  for (uint64_t s = 0; s < 1000; ++s) zeros += sample_token(l, p, s) == 0;
  EXPECT_GT(zeros, 995);
}

TEST(Sampler, RejectsBadParameters) {
  SamplingParams p;
  p.temperature = -1.0f;
  EXPECT_THROW(p.validate(), Error);
  p = SamplingParams{};
  p.top_p = 0.0f;
  try {
    p.validate();
    FAIL() << "top_p = 0 accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.exit_code(), 2);
    EXPECT_NE(std::string(e.what()).find("--top-p"), std::string::npos);
  }
  p = SamplingParams{};
  p.top_k = -3;
  EXPECT_THROW(p.validate(), Error);
}

TEST(Sampler, CounterUniformIsInUnitInterval) {
  double lo = 1.0, hi = 0.0;
  for (uint64_t s = 0; s < 10000; ++s) {
    const double u = counter_uniform(7, s);
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    lo = std::min(lo, u);
    hi = std::max(hi, u);
  }
  EXPECT_LT(lo, 0.01);
  EXPECT_GT(hi, 0.99);
}

}  // namespace
}  // namespace chimera
