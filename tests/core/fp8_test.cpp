// FP8 E4M3 against torch's float8_e4m3fn and ModelOpt's FP8 export (goldens: scripts/make_quant_fixtures.py).
#include <algorithm>
#include <cmath>
#include <vector>

#include <gtest/gtest.h>

#include "common/compare.h"
#include "core/fp8.h"
#include "io/npy.h"

namespace chimera {
namespace {

Tensor golden(const std::string& name) { return read_npy(test::source_path("tests/fixtures/quant/" + name)); }

std::span<const float> f32s(const Tensor& t) { return {t.f32(), static_cast<size_t>(t.numel())}; }
std::span<const int32_t> i32s(const Tensor& t) { return {t.data_as<int32_t>(), static_cast<size_t>(t.numel())}; }

TEST(Fp8, DecodesEveryByteAsTorch) {
  const Tensor want = golden("e4m3_decode.npy");
  ASSERT_EQ(want.numel(), 256);
  for (int v = 0; v < 256; ++v) {
    const float got = e4m3_to_f32(static_cast<uint8_t>(v));
    const float w = want.f32()[v];
    if (std::isnan(w)) {
      EXPECT_TRUE(std::isnan(got)) << "byte " << v;
      EXPECT_EQ(std::signbit(got), std::signbit(w)) << "byte " << v;
    } else {
      EXPECT_EQ(f32_bits(got), f32_bits(w)) << "byte " << v << ": " << got << " vs torch " << w;
    }
  }
  // the existing host conversion in core/dtype.h agrees on every byte
  for (int v = 0; v < 256; ++v) {
    const float a = e4m3_to_f32(static_cast<uint8_t>(v)), b = f8e4m3_to_f32(static_cast<uint8_t>(v));
    if (!std::isnan(a)) {
      EXPECT_EQ(a, b) << "byte " << v;
    }
  }
}

TEST(Fp8, EncodesAsTorchCastAndClampedCast) {
  const Tensor x = golden("e4m3_encode_in.npy");
  const Tensor cast = golden("e4m3_encode_cast.npy");
  const Tensor sat = golden("e4m3_encode_sat.npy");
  ASSERT_EQ(x.numel(), cast.numel());
  ASSERT_EQ(x.numel(), sat.numel());
  ASSERT_GT(x.numel(), 500);
  int n_nan_cast = 0;
  for (int64_t i = 0; i < x.numel(); ++i) {
    const float v = x.f32()[i];
    EXPECT_EQ(f32_to_e4m3(v, E4m3Overflow::kNaN), i32s(cast)[i]) << "x=" << v << " (index " << i << ")";
    EXPECT_EQ(f32_to_e4m3(v, E4m3Overflow::kSaturate), i32s(sat)[i]) << "x=" << v << " (index " << i << ")";
    n_nan_cast += (i32s(cast)[i] & 0x7f) == 0x7f;
  }
  EXPECT_GE(n_nan_cast, 5);  // the overflow cases are really in the set
}

TEST(Fp8, RoundTripsEveryFiniteByte) {
  for (int v = 0; v < 256; ++v) {
    const float f = e4m3_to_f32(static_cast<uint8_t>(v));
    if (std::isnan(f)) continue;
    EXPECT_EQ(f32_to_e4m3(f), v) << "byte " << v;
  }
}

TEST(Fp8, PerTensorWeightMatchesModelOptExport) {
  const Tensor w = golden("fp8_w.npy");
  const Tensor want = golden("fp8_weight.npy");
  const float want_scale = golden("fp8_scale.npy").f32()[0];
  const Fp8Weight q = quantize_fp8_per_tensor(f32s(w));
  EXPECT_EQ(f32_bits(q.weight_scale), f32_bits(want_scale));
  ASSERT_EQ(static_cast<int64_t>(q.data.size()), want.numel());
  for (int64_t i = 0; i < want.numel(); ++i) EXPECT_EQ(q.data[i], i32s(want)[i]) << "element " << i;
  // dequantized: each value within half an e4m3 step (2^-4 relative) of the original, the amax exactly
  std::vector<float> d(q.data.size());
  dequantize_fp8(q.data, q.weight_scale, d);
  for (size_t i = 0; i < d.size(); ++i) {
    const float orig = w.f32()[i];
    EXPECT_LE(std::fabs(d[i] - orig), std::fabs(orig) * 0.0625f + q.weight_scale * 1.0f / 512.0f) << i;
  }
  // the amax element maps to +-448 and back to itself within one fp32 rounding of each step
  EXPECT_EQ(q.data[0], 0xfe);
  EXPECT_NEAR(d[0], w.f32()[0], std::fabs(w.f32()[0]) * 3e-7);
}

TEST(Fp8, ZeroTensorGetsUnitScale) {
  const std::vector<float> z(10, 0.0f);
  const Fp8Weight q = quantize_fp8_per_tensor(z);
  EXPECT_EQ(q.weight_scale, 1.0f);
  for (uint8_t b : q.data) EXPECT_EQ(b, 0);
}

// Dynamic per-tensor activation quantization: the scale is the weight rule's amax / 448 over the input itself (so
// nothing saturates: the largest |x| maps to 448 exactly), then the static fake quantization with it; zeros get 1.
TEST(Fp8, DynamicActivationFakeQuantUsesTheTensorsOwnAmax) {
  const Tensor x = golden("fp8_x.npy");
  std::vector<float> got(f32s(x).begin(), f32s(x).end());
  float amax = 0.0f;
  for (float v : got) amax = std::max(amax, std::fabs(v));
  const float s = fake_quantize_fp8_dynamic(got);
  EXPECT_EQ(s, amax / 448.0f);
  std::vector<float> want(f32s(x).begin(), f32s(x).end());
  fake_quantize_fp8(want, s);
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(f32_bits(got[i]), f32_bits(want[i])) << i;
    EXPECT_LE(std::fabs(got[i]), amax * (1.0f + 1e-6f)) << i;  // 448 * s rounds to the amax: no saturation
  }
  std::vector<float> zeros(5, 0.0f);
  EXPECT_EQ(fake_quantize_fp8_dynamic(zeros), 1.0f);
  for (float v : zeros) EXPECT_EQ(v, 0.0f);
}

TEST(Fp8, StaticActivationFakeQuantMatchesTorch) {
  const Tensor x = golden("fp8_x.npy");
  const Tensor want = golden("fp8_x_fq.npy");
  const float s = golden("fp8_input_scale.npy").f32()[0];
  std::vector<float> got(f32s(x).begin(), f32s(x).end());
  fake_quantize_fp8(got, s);
  int saturated = 0;
  for (int64_t i = 0; i < x.numel(); ++i) {
    EXPECT_EQ(f32_bits(got[i]), f32_bits(want.f32()[i])) << "x=" << x.f32()[i] << " (index " << i << ")";
    saturated += std::fabs(x.f32()[i]) > 448.0f * s;
  }
  EXPECT_GT(saturated, 0);
}

}  // namespace
}  // namespace chimera
