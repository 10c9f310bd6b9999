// Quantized linear layers (ops/quant_ops.h) on awkward sizes against a plain dequantize-then-matmul in double
// precision (the dequantization itself is checked bit for bit against torch / ModelOpt in tests/core).
#include <cmath>
#include <cstring>
#include <vector>

#include <gtest/gtest.h>

#include "common/compare.h"
#include "core/error.h"
#include "core/fp8.h"
#include "core/nvfp4.h"
#include "io/io_test_util.h"
#include "ops/quant_ops.h"

namespace chimera {
namespace {

Tensor bytes_tensor(DType t, Shape shape, const std::vector<uint8_t>& bytes) {
  Tensor r = Tensor::empty(t, std::move(shape));
  EXPECT_EQ(r.nbytes(), bytes.size());
  std::memcpy(r.data(), bytes.data(), bytes.size());
  return r;
}
Tensor scalar(float v) { return Tensor::from_f32({}, std::vector<float>{v}); }

// want[t, n] = sum_k x[t, k] * w[n, k] (+ b[n]) in double; bound[t, n] = the fp32 summation error bound
// 2 * K * 2^-24 * sum_k |x w| (+ |b| 2^-24), from the standard bound gamma_K on a K-term fp32 sum.
void reference(const std::vector<float>& x, const std::vector<float>& w, const float* b, int64_t T, int64_t K,
               int64_t N, std::vector<float>& want, std::vector<float>& bound) {
  want.assign(static_cast<size_t>(T * N), 0.0f);
  bound.assign(want.size(), 0.0f);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t n = 0; n < N; ++n) {
      double s = b ? b[n] : 0.0, a = b ? std::fabs(b[n]) : 0.0;
      for (int64_t k = 0; k < K; ++k) {
        s += static_cast<double>(x[t * K + k]) * w[n * K + k];
        a += std::fabs(static_cast<double>(x[t * K + k]) * w[n * K + k]);
      }
      want[t * N + n] = static_cast<float>(s);
      bound[t * N + n] = static_cast<float>(2.0 * (K + 1) * std::ldexp(1.0, -24) * a + 1e-30);
    }
  }
}

void expect_within(const Tensor& got, const std::vector<float>& want, const std::vector<float>& bound) {
  ASSERT_EQ(got.numel(), static_cast<int64_t>(want.size()));
  int64_t worst = 0;
  double worst_ratio = 0.0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double err = std::fabs(static_cast<double>(got.f32()[i]) - want[i]);
    const double ratio = err / bound[i];
    if (!(ratio <= worst_ratio) || std::isnan(got.f32()[i])) {
      worst_ratio = std::isnan(got.f32()[i]) ? INFINITY : ratio;
      worst = i;
    }
  }
  EXPECT_LE(worst_ratio, 1.0) << "worst element " << worst << ": got " << got.f32()[worst] << ", want "
                              << want[worst] << ", bound " << bound[worst];
}

std::vector<float> values(const Tensor& t) { return {t.f32(), t.f32() + t.numel()}; }

struct Size {
  int64_t T, K, N;
};

std::string size_name(const ::testing::TestParamInfo<Size>& p) {
  return fmt::format("T{}_K{}_N{}", p.param.T, p.param.K, p.param.N);
}

class QuantLinear : public ::testing::TestWithParam<Size> {};

TEST_P(QuantLinear, Fp8WeightOnlyAndW8A8) {
  const auto [T, K, N] = GetParam();
  test::Rng rng = test::Rng::for_test();
  const Tensor wf = rng.normal_tensor({N, K}, 0.3f);
  const Tensor x = rng.normal_tensor({T, K}, 2.0f);
  const Tensor bias = rng.normal_tensor({N});
  const Fp8Weight q = quantize_fp8_per_tensor(values(wf));
  std::vector<float> w(q.data.size());
  dequantize_fp8(q.data, q.weight_scale, w);
  ops::Fp8Linear lin{"m", bytes_tensor(DType::kF8E4M3, {N, K}, q.data), scalar(q.weight_scale),
                     scalar(3.0f / kE4m3Max)};
  const ops::Context ctx;
  std::vector<float> want, bound;

  Tensor out = Tensor::empty(DType::kF32, {T, N});
  test::poison(out);
  ops::fp8_linear(ctx, out, x, lin, ops::ActQuant::kNone, bias);
  reference(values(x), w, bias.f32(), T, K, N, want, bound);
  expect_within(out, want, bound);

  // W8A8: x fake-quantized with input_scale (amax 3: some |x| saturate)
  std::vector<float> xq = values(x);
  fake_quantize_fp8(xq, 3.0f / kE4m3Max);
  Tensor out8 = Tensor::empty(DType::kF32, {T, N});
  test::poison(out8);
  ops::fp8_linear(ctx, out8, x, lin, ops::ActQuant::kStatic);
  reference(xq, w, nullptr, T, K, N, want, bound);
  expect_within(out8, want, bound);
  if (T * K >= 16) {
    EXPECT_NE(xq, values(x));  // the activations really were quantized
  }
}

TEST_P(QuantLinear, Nvfp4WeightOnly) {
  const auto [T, K0, N] = GetParam();
  const int64_t K = (K0 + 15) / 16 * 16;
  test::Rng rng = test::Rng::for_test();
  const Tensor wf = rng.normal_tensor({N, K}, 0.3f);
  const Tensor x = rng.normal_tensor({T, K});
  const Nvfp4Weight q = quantize_nvfp4(values(wf), N, K);
  const std::vector<float> w = dequantize_nvfp4(q);
  ops::Nvfp4Linear lin{"m", bytes_tensor(DType::kU8, {N, K / 2}, q.packed),
                       bytes_tensor(DType::kF8E4M3, {N, K / 16}, q.block_scale), scalar(q.weight_scale_2), Tensor()};
  Tensor out = Tensor::empty(DType::kF32, {T, N});
  test::poison(out);
  ops::nvfp4_linear(ops::Context{}, out, x, lin);
  std::vector<float> want, bound;
  reference(values(x), w, nullptr, T, K, N, want, bound);
  expect_within(out, want, bound);
}

INSTANTIATE_TEST_SUITE_P(AwkwardSizes, QuantLinear,
                         ::testing::Values(Size{1, 16, 1}, Size{1, 37, 5}, Size{3, 111, 19}, Size{19, 500, 7},
                                           Size{2, 1024, 99}, Size{7, 1, 3}),
                         size_name);

TEST(QuantLinearErrors, BadCheckpointTensorsNameTheModule) {
  const std::string m = "backbone.layers.1.mixer.experts.0.up_proj";
  const Tensor x = Tensor::from_f32({1, 32}, std::vector<float>(32, 1.0f));
  Tensor out = Tensor::empty(DType::kF32, {1, 8});
  auto nv = [&] {
    return ops::Nvfp4Linear{m, Tensor::zeros(DType::kU8, {8, 16}), Tensor::zeros(DType::kF8E4M3, {8, 2}),
                            scalar(1.0f), Tensor()};
  };
  ops::Nvfp4Linear bad = nv();
  bad.weight_scale = Tensor::zeros(DType::kF8E4M3, {8, 3});
  EXPECT_INVALID(ops::nvfp4_linear(ops::Context{}, out, x, bad), m + ".weight_scale", "[8, 3]", "[8, 2]");
  bad = nv();
  bad.weight = Tensor::zeros(DType::kU8, {8, 15});
  EXPECT_INVALID(ops::nvfp4_linear(ops::Context{}, out, x, bad), m + ".weight", "[8, 15]", "[8, 16]");
  bad = nv();
  bad.weight_scale = Tensor::zeros(DType::kF32, {8, 2});
  EXPECT_INVALID(ops::nvfp4_linear(ops::Context{}, out, x, bad), m + ".weight_scale", "dtype F32", "F8_E4M3");
  bad = nv();
  bad.weight_scale_2 = Tensor::from_f32({2}, std::vector<float>{1.0f, 2.0f});
  EXPECT_INVALID(ops::nvfp4_linear(ops::Context{}, out, x, bad), m + ".weight_scale_2", "scalar");
  bad = nv();
  bad.weight_scale_2 = scalar(0.0f);
  EXPECT_INVALID(ops::nvfp4_linear(ops::Context{}, out, x, bad), m + ".weight_scale_2", "positive finite");
  // an in_features that is not a multiple of 16 (odd included)
  EXPECT_INVALID(ops::validate(nv(), 33), m + ".weight", "multiple of 16", "K = 33");

  ops::Fp8Linear f{m, Tensor::zeros(DType::kF8E4M3, {8, 32}), scalar(1.0f), Tensor()};
  EXPECT_INVALID(ops::fp8_linear(ops::Context{}, out, x, f, ops::ActQuant::kStatic), m + ".input_scale", "missing");
  f.weight = Tensor::zeros(DType::kBF16, {8, 32});
  EXPECT_INVALID(ops::fp8_linear(ops::Context{}, out, x, f, ops::ActQuant::kNone), m + ".weight", "dtype BF16");
  f.weight = Tensor::zeros(DType::kF8E4M3, {8, 31});
  EXPECT_INVALID(ops::fp8_linear(ops::Context{}, out, x, f, ops::ActQuant::kNone), m + ".weight", "[8, 31]");
  f.weight = Tensor::zeros(DType::kF8E4M3, {8, 32});
  f.weight_scale = scalar(NAN);
  EXPECT_INVALID(ops::fp8_linear(ops::Context{}, out, x, f, ops::ActQuant::kNone), m + ".weight_scale");
}

}  // namespace
}  // namespace chimera
