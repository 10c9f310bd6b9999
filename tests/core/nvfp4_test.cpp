// E2M1 and NVFP4 against NVIDIA ModelOpt's own quantizer (goldens: scripts/make_quant_fixtures.py).
#include <cmath>
#include <vector>

#include <gtest/gtest.h>

#include "common/compare.h"
#include "core/error.h"
#include "core/fp8.h"
#include "core/nvfp4.h"
#include "io/npy.h"

namespace chimera {
namespace {

Tensor golden(const std::string& name) { return read_npy(test::source_path("tests/fixtures/quant/" + name)); }
const int32_t* i32(const Tensor& t) { return t.data_as<int32_t>(); }

TEST(Nvfp4, E2m1DecodesAsModelOptTable) {
  const Tensor want = golden("e2m1_decode.npy");
  ASSERT_EQ(want.numel(), 16);
  for (int c = 0; c < 16; ++c) EXPECT_EQ(f32_bits(e2m1_to_f32(static_cast<uint8_t>(c))), f32_bits(want.f32()[c]))
      << "code " << c;
}

TEST(Nvfp4, E2m1EncodesAsModelOptCast) {
  const Tensor x = golden("e2m1_encode_in.npy");
  const Tensor want = golden("e2m1_encode.npy");
  ASSERT_EQ(x.numel(), want.numel());
  ASSERT_GT(x.numel(), 100);
  for (int64_t i = 0; i < x.numel(); ++i) {
    EXPECT_EQ(f32_to_e2m1(x.f32()[i]), i32(want)[i]) << "x=" << x.f32()[i] << " (index " << i << ")";
  }
}

TEST(Nvfp4, PacksElementTwoIInTheLowNibble) {
  const std::vector<uint8_t> codes = {0x1, 0x2, 0xf, 0x8, 0x7, 0x0};
  EXPECT_EQ(pack_e2m1(codes), (std::vector<uint8_t>{0x21, 0x8f, 0x07}));
}

TEST(Nvfp4, QuantizesAsModelOpt) {
  const Tensor w = golden("nvfp4_w.npy");
  const Tensor packed = golden("nvfp4_packed.npy");
  const Tensor scale = golden("nvfp4_scale.npy");
  const float scale_2 = golden("nvfp4_scale_2.npy").f32()[0];
  const int64_t rows = w.dim(0), cols = w.dim(1);
  ASSERT_EQ(packed.dim(1), cols / 2);
  ASSERT_EQ(scale.dim(1), cols / 16);
  const Nvfp4Weight q = quantize_nvfp4({w.f32(), static_cast<size_t>(w.numel())}, rows, cols);
  EXPECT_EQ(f32_bits(q.weight_scale_2), f32_bits(scale_2));
  ASSERT_EQ(static_cast<int64_t>(q.packed.size()), packed.numel());
  ASSERT_EQ(static_cast<int64_t>(q.block_scale.size()), scale.numel());
  for (int64_t i = 0; i < packed.numel(); ++i) {
    EXPECT_EQ(q.packed[i], i32(packed)[i]) << "row " << i / (cols / 2) << " byte " << i % (cols / 2);
  }
  for (int64_t i = 0; i < scale.numel(); ++i) {
    EXPECT_EQ(q.block_scale[i], i32(scale)[i]) << "row " << i / (cols / 16) << " block " << i % (cols / 16);
  }
  // the fixture's special blocks: an all-zero block stores scale 1.0 (0x38), a tiny one the clamp's 2^-9 (0x01)
  EXPECT_EQ(q.block_scale[1 * (cols / 16) + 1], 0x38);
  EXPECT_EQ(q.block_scale[2 * (cols / 16) + 2], 0x01);
}

TEST(Nvfp4, DequantizesAsModelOpt) {
  const Tensor want = golden("nvfp4_dequant.npy");
  Nvfp4Weight q;
  q.rows = want.dim(0);
  q.cols = want.dim(1);
  const Tensor packed = golden("nvfp4_packed.npy"), scale = golden("nvfp4_scale.npy");
  for (int64_t i = 0; i < packed.numel(); ++i) q.packed.push_back(static_cast<uint8_t>(i32(packed)[i]));
  for (int64_t i = 0; i < scale.numel(); ++i) q.block_scale.push_back(static_cast<uint8_t>(i32(scale)[i]));
  q.weight_scale_2 = golden("nvfp4_scale_2.npy").f32()[0];
  const std::vector<float> got = dequantize_nvfp4(q);
  ASSERT_EQ(static_cast<int64_t>(got.size()), want.numel());
  for (int64_t i = 0; i < want.numel(); ++i) {
    EXPECT_EQ(f32_bits(got[i]), f32_bits(want.f32()[i])) << "row " << i / q.cols << " col " << i % q.cols << ": "
                                                        << got[i] << " vs " << want.f32()[i];
  }
  // a row range reads the same values
  std::vector<float> part(static_cast<size_t>(2 * q.cols));
  dequantize_nvfp4_rows(q.packed.data(), q.block_scale.data(), q.weight_scale_2, q.cols, 3, 2, part.data());
  for (int64_t i = 0; i < 2 * q.cols; ++i) EXPECT_EQ(part[i], got[3 * q.cols + i]);
}

TEST(Nvfp4, RefusesColumnsNotAMultipleOf16) {
  const std::vector<float> w(2 * 24, 1.0f);
  try {
    quantize_nvfp4(w, 2, 24);
    FAIL() << "did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidInput);
    EXPECT_NE(std::string(e.what()).find("multiple of 16"), std::string::npos) << e.what();
  }
}

TEST(Nvfp4, ErrorOfRandomWeightsIsBoundedByTheBlockScale) {
  test::Rng rng = test::Rng::for_test();
  const int64_t rows = 13, cols = 48;
  const Tensor w = rng.normal_tensor({rows, cols});
  const Nvfp4Weight q = quantize_nvfp4({w.f32(), static_cast<size_t>(w.numel())}, rows, cols);
  const std::vector<float> d = dequantize_nvfp4(q);
  // each element is within half the widest E2M1 gap (1, between 4 and 6) times its block's scale, plus the e4m3
  // rounding of that scale (<= 2^-4 relative, up to 6 * scale * 2^-4 on the largest element)
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const float s = e4m3_to_f32(q.block_scale[r * (cols / 16) + c / 16]) * q.weight_scale_2;
      EXPECT_LE(std::fabs(d[r * cols + c] - w.f32()[r * cols + c]), s * (1.0f + 6.0f * 0.0625f) * 1.0001f)
          << r << "," << c;
    }
  }
}

}  // namespace
}  // namespace chimera
