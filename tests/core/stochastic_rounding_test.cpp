// Stochastic rounding of fp32 to fp16 (core/stochastic_rounding.h): every result is one of the two fp16 values
// bracketing the input; over all 2^16 random inputs the mean is the input exactly (|v| >= 2^-16, where 16 bits
// cover the dropped fraction); over the counter-based bits of many positions the mean is the input within its
// standard error; the edges (zero, subnormals, overflow, inf, NaN) behave as documented.
#include "core/stochastic_rounding.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "core/dtype.h"

namespace chimera {
namespace {

// The fp16 neighbours of v: lo <= v <= hi (equal when v is representable), from the round-to-nearest value.
std::pair<double, double> f16_bracket(float v) {
  const uint16_t rn = f32_to_f16(v);
  const double r = f16_to_f32(rn);
  if (r == v) return {r, r};
  // The other neighbour is one step away in the direction of v (fp16 bit patterns are monotone per sign).
  const bool away = std::fabs(static_cast<double>(v)) > std::fabs(r);
  const uint16_t other = static_cast<uint16_t>(away ? rn + 1 : rn - 1);
  const double o = f16_to_f32(other);
  return {std::min(r, o), std::max(r, o)};
}

std::vector<float> sample_values() {
  std::mt19937 gen(7);
  std::vector<float> vs = {1.0f, -1.0f, 1.0f + 0x1p-12f, 3.14159265f, -2.71828f, 1000.1f, 65000.3f, -65500.0f,
                           0x1p-14f * 1.337f, 0x1p-15f * 1.5f, -0x1p-16f * 1.25f, 0x1p-14f - 0x1p-30f};
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  std::uniform_int_distribution<int> ex(-16, 15);
  for (int i = 0; i < 200; ++i) {
    const float v = std::ldexp(mant(gen), ex(gen));
    vs.push_back(i % 2 ? v : -v);
  }
  return vs;
}

TEST(StochasticRounding, ResultIsABracketingNeighbourAndTheMeanOverAllBitsIsExact) {
  for (const float v : sample_values()) {
    const auto [lo, hi] = f16_bracket(v);
    double sum = 0;
    for (uint32_t r = 0; r < (1u << 16); ++r) {
      const double w = f16_to_f32(f32_to_f16_stochastic(v, r));
      ASSERT_TRUE(w == lo || w == hi) << v << " -> " << w << " (bracket " << lo << ", " << hi << ")";
      sum += w;
    }
    // Every term is a multiple of v's fp16 step below 2^12 steps, so the 2^16-term sum needs < 29 bits: exact.
    EXPECT_EQ(sum, static_cast<double>(v) * 65536.0) << v;
  }
}

TEST(StochasticRounding, RepresentableValuesStayAndEdgesFollowTheContract) {
  for (uint32_t bits = 0; bits < 0x7c00u; bits += 37) {  // every 37th finite positive fp16, and its negative
    for (const uint32_t sign : {0u, 0x8000u}) {
      const auto h = static_cast<uint16_t>(bits | sign);
      const float v = f16_to_f32(h);
      for (const uint32_t r : {0u, 1u, 0x1fffu, 0x8000u, 0xffffu}) {
        ASSERT_EQ(f32_to_f16_stochastic(v, r), h) << std::hex << h << " r " << r;
      }
    }
  }
  EXPECT_EQ(f32_to_f16_stochastic(0.0f, 0xffffu), 0x0000u);
  EXPECT_EQ(f32_to_f16_stochastic(-0.0f, 0xffffu), 0x8000u);
  EXPECT_EQ(f32_to_f16_stochastic(70000.0f, 0), 0x7bffu);  // finite beyond 65504: saturated
  EXPECT_EQ(f32_to_f16_stochastic(-1e30f, 0xffffu), 0xfbffu);
  EXPECT_EQ(f32_to_f16_stochastic(std::numeric_limits<float>::infinity(), 0), 0x7c00u);
  EXPECT_EQ(f32_to_f16_stochastic(-std::numeric_limits<float>::infinity(), 0), 0xfc00u);
  const uint16_t nan = f32_to_f16_stochastic(std::numeric_limits<float>::quiet_NaN(), 0);
  EXPECT_TRUE(std::isnan(f16_to_f32(nan)));
  // Far below the smallest subnormal (2^-24): zero unless the bits are tiny; never anything but 0 or 2^-24.
  for (uint32_t r = 0; r < (1u << 16); r += 255) {
    const uint16_t h = f32_to_f16_stochastic(0x1p-30f, r);
    ASSERT_TRUE(h == 0 || h == 1) << h;
  }
  EXPECT_EQ(f32_to_f16_stochastic(std::numeric_limits<float>::denorm_min(), 0xffffu), 0u);
}

// The counter-based bits of the SSM state (ssm_rounding_bits over positions) are uniform enough that the mean of
// n roundings is the input within 5 standard errors (each rounding's error is at most one fp16 step, so the
// standard deviation is at most step / 2).
TEST(StochasticRounding, MeanOverCounterBitsOfManyPositionsIsUnbiased) {
  constexpr int kN = 20000;
  const uint64_t seed = splitmix64(12345);
  for (const float v : {1.0f + 0x1p-12f, 0.3333333f, -7.77f, 0x1p-15f * 1.3f, 1234.56f}) {
    for (const uint32_t e : {0u, 1u, 77u, 4096u}) {
      const auto [lo, hi] = f16_bracket(v);
      double sum = 0;
      for (int t = 0; t < kN; ++t) {
        sum += f16_to_f32(f32_to_f16_stochastic(v, ssm_rounding_bits(ssm_rounding_key(seed, t), e)));
      }
      const double mean = sum / kN, bound = 5.0 * (hi - lo) / 2.0 / std::sqrt(static_cast<double>(kN));
      EXPECT_NEAR(mean, v, bound) << "v " << v << " element " << e;
      // Round to nearest would sit a whole fraction of a step away: the test can tell.
      EXPECT_GT(std::fabs(static_cast<double>(f16_to_f32(f32_to_f16(v))) - v), bound) << v;
    }
  }
}

// The bits of neighbouring elements and positions differ (one hash per element pair, halves distinct).
TEST(StochasticRounding, BitsVaryWithElementAndPosition) {
  const uint64_t k0 = ssm_rounding_key(1, 0), k1 = ssm_rounding_key(1, 1), k2 = ssm_rounding_key(2, 0);
  int same_e = 0, same_t = 0, same_s = 0;
  for (uint32_t e = 0; e < 4096; ++e) {
    same_e += ssm_rounding_bits(k0, e) == ssm_rounding_bits(k0, e + 1);
    same_t += ssm_rounding_bits(k0, e) == ssm_rounding_bits(k1, e);
    same_s += ssm_rounding_bits(k0, e) == ssm_rounding_bits(k2, e);
  }
  // Independent 16-bit values agree with probability 2^-16: a handful at most out of 4096.
  EXPECT_LE(same_e, 3);
  EXPECT_LE(same_t, 3);
  EXPECT_LE(same_s, 3);
}

}  // namespace
}  // namespace chimera
