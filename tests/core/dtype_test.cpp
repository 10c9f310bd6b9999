#include <cmath>

#include <gtest/gtest.h>

#include "common/compare.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/tensor.h"

namespace chimera {
namespace {

TEST(DType, NamesRoundTrip) {
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16, DType::kF8E4M3, DType::kU8, DType::kI8, DType::kI32,
                  DType::kI64}) {
    auto back = dtype_from_name(dtype_name(t));
    ASSERT_TRUE(back.has_value());
    EXPECT_EQ(*back, t);
  }
  EXPECT_FALSE(dtype_from_name("F64").has_value());
}

TEST(DType, Bf16RoundsToNearestEven) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  // 1 + 2^-8 is exactly half way between two bf16 values: ties to even (down to 1.0).
  EXPECT_EQ(f32_to_bf16(1.00390625f), 0x3f80);
  // 1 + 3*2^-8 is half way between 1+2^-7 (odd) and 1+2^-6 (even): rounds up.
  EXPECT_EQ(f32_to_bf16(1.01171875f), 0x3f82);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(NAN))));
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(-2.5f)), -2.5f);
}

TEST(DType, F16KnownValues) {
  EXPECT_EQ(f32_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(f32_to_f16(-2.0f), 0xc000);
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(f32_to_f16(1e6f), 0x7c00);
  EXPECT_EQ(f16_to_f32(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -24)), 0x0001);
  // every f16 value survives a round trip through f32
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = f16_to_f32(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(f32_to_f16(f), h) << "h=" << h;
  }
}

TEST(DType, F8E4M3KnownValues) {
  EXPECT_EQ(f8e4m3_to_f32(0x7e), 448.0f);
  EXPECT_TRUE(std::isnan(f8e4m3_to_f32(0x7f)));
  EXPECT_EQ(f8e4m3_to_f32(0x38), 1.0f);
  EXPECT_EQ(f8e4m3_to_f32(0x01), std::ldexp(1.0f, -9));
  for (uint32_t v = 0; v < 256; ++v) {
    const float f = f8e4m3_to_f32(static_cast<uint8_t>(v));
    if (std::isnan(f) || (v == 0x80)) continue;  // -0 maps to 0x80 as well; checked below
    ASSERT_EQ(f32_to_f8e4m3(f), v) << "v=" << v;
  }
  EXPECT_EQ(f32_to_f8e4m3(-0.0f), 0x80);
  EXPECT_EQ(f32_to_f8e4m3(1000.0f), 0x7e);  // saturates
}

TEST(Tensor, ViewsShareStorage) {
  Tensor t = Tensor::from_f32({3, 2}, std::vector<float>{0, 1, 2, 3, 4, 5});
  Tensor r = t.rows(1, 3);
  EXPECT_EQ(r.shape(), (Shape{2, 2}));
  EXPECT_EQ(r.f32()[0], 2.0f);
  Tensor s = t.select(2);
  EXPECT_EQ(s.shape(), (Shape{2}));
  EXPECT_EQ(s.f32()[1], 5.0f);
  EXPECT_EQ(t.reshape({-1}).shape(), (Shape{6}));
  s.f32()[1] = 7.0f;
  EXPECT_EQ(t.f32()[5], 7.0f);
  EXPECT_THROW(t.reshape({4, 2}), Error);
  EXPECT_THROW(t.rows(2, 4), Error);
}

}  // namespace
}  // namespace chimera
