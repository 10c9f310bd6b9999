// linear, relu2, relu2_mlp against naive loops; the 4096x4096 bf16 speed check.
#include <chrono>
#include <cmath>

#include "common/backend_param.h"
#include "common/compare.h"
#include "core/parallel.h"

namespace chimera {
namespace {

using test::BackendTest;

// y = x @ W^T + b with double accumulation; W any float dtype.
Tensor naive_linear(const Tensor& x, const Tensor& w_any, const Tensor& b_any = Tensor()) {
  const Tensor w = w_any.to_f32();
  const int64_t T = x.dim(0), in = x.dim(1), out = w.dim(0);
  Tensor y = Tensor::empty(DType::kF32, {T, out});
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t o = 0; o < out; ++o) {
      double acc = b_any ? double(b_any.to_f32().f32()[o]) : 0.0;
      for (int64_t i = 0; i < in; ++i) acc += double(x.f32()[t * in + i]) * w.f32()[o * in + i];
      y.f32()[t * out + o] = float(acc);
    }
  }
  return y;
}

Tensor naive_relu2(Tensor h) {
  for (int64_t i = 0; i < h.numel(); ++i) h.f32()[i] = h.f32()[i] > 0 ? h.f32()[i] * h.f32()[i] : 0.0f;
  return h;
}

class OpsLinear : public BackendTest {};

TEST_P(OpsLinear, MatchesNaiveForEveryWeightDtype) {
  auto rng = test::Rng::for_test();
  for (DType wt : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (bool with_bias : {false, true}) {
      for (int64_t T : {1, 3, 17, 111}) {
        for (int64_t in : {33, 500}) {
          for (int64_t out_f : {1, 7, 65}) {
            SCOPED_TRACE(::testing::Message()
                         << dtype_name(wt) << " bias=" << with_bias << " T=" << T << " in=" << in << " out=" << out_f);
            const Tensor x = rng.normal_tensor({T, in});
            const Tensor w = test::cast_to(rng.normal_tensor({out_f, in}, 0.1f), wt);
            const Tensor b = with_bias ? test::cast_to(rng.normal_tensor({out_f}), wt) : Tensor();
            Tensor y = Tensor::empty(DType::kF32, {T, out_f});
            test::poison(y);
            ops::linear(ctx(), y, x, w, b);
            EXPECT_TRUE(test::nmse_close(y, naive_linear(x, w, b), test::kF32ReductionNmse, test::kF32Reduction));
          }
        }
      }
    }
  }
}

TEST_P(OpsLinear, ResultDoesNotDependOnThreadCount) {
  auto rng = test::Rng::for_test();
  const Tensor x = rng.normal_tensor({111, 500});
  const Tensor w = test::cast_to(rng.normal_tensor({257, 500}), DType::kBF16);
  Tensor y1 = Tensor::empty(DType::kF32, {111, 257}), y2 = Tensor::empty(DType::kF32, {111, 257});
  const int saved = num_threads();
  set_num_threads(1);
  ops::linear(ctx(), y1, x, w);
  set_num_threads(3);
  ops::linear(ctx(), y2, x, w);
  set_num_threads(saved);
  EXPECT_TRUE(test::bit_equal(y1, y2));
}

TEST_P(OpsLinear, BadShapesThrowNamingTheOp) {
  const Tensor x = Tensor::zeros(DType::kF32, {5, 31});
  const Tensor w = Tensor::zeros(DType::kBF16, {64, 32});
  Tensor y = Tensor::empty(DType::kF32, {5, 64});
  EXPECT_TRUE(test::throws_error([&] { ops::linear(ctx(), y, x, w); }, ErrorKind::kRuntime,
                                 "ops::linear: weight BF16[64, 32] does not match x F32[5, 31]"));
  const Tensor x32 = Tensor::zeros(DType::kF32, {5, 32});
  EXPECT_TRUE(test::throws_error([&] { ops::linear(ctx(), y, x32, w, Tensor::zeros(DType::kF32, {63})); },
                                 ErrorKind::kRuntime, "ops::linear: bias F32[63] does not match weight"));
  Tensor y_bad = Tensor::empty(DType::kF32, {5, 63});
  EXPECT_TRUE(test::throws_error([&] { ops::linear(ctx(), y_bad, x32, w); }, ErrorKind::kRuntime,
                                 "ops::linear: out F32[5, 63]"));
  EXPECT_TRUE(test::throws_error(
      [&] {
        ops::linear(ctx(), y, x32, Tensor::zeros(DType::kI32, {64, 32}));
      },
      ErrorKind::kRuntime, "ops::linear: weight I32[64, 32] must be F32, BF16 or F16"));
}

TEST_P(OpsLinear, Relu2InPlace) {
  auto rng = test::Rng::for_test();
  const Tensor x = rng.normal_tensor({3, 5, 7});
  Tensor y = x.clone();
  ops::relu2(ctx(), y);
  EXPECT_TRUE(test::bit_equal(y, naive_relu2(x.clone())));
}

TEST_P(OpsLinear, Relu2MlpMatchesNaive) {
  auto rng = test::Rng::for_test();
  for (DType wt : {DType::kF32, DType::kBF16}) {
    for (int64_t T : {1, 17}) {
      const int64_t D = 33, I = 70;
      const Tensor x = rng.normal_tensor({T, D});
      const Tensor up = test::cast_to(rng.normal_tensor({I, D}, 0.2f), wt);
      const Tensor down = test::cast_to(rng.normal_tensor({D, I}, 0.2f), wt);
      Tensor out = Tensor::empty(DType::kF32, {T, D});
      test::poison(out);
      ops::relu2_mlp(ctx(), out, x, up, down);
      EXPECT_TRUE(test::nmse_close(out, naive_linear(naive_relu2(naive_linear(x, up)), down), test::kF32ReductionNmse,
                                   test::kF32Reduction));
    }
  }
}

// 4096x4096 bf16 weight times 64 tokens: the brief asks for well under a second on 2 cores.
TEST_P(OpsLinear, Bf16Gemm4096Speed) {
  auto rng = test::Rng::for_test();
  const int64_t T = 64, D = 4096;
  const Tensor x = rng.normal_tensor({T, D});
  Tensor w = Tensor::empty(DType::kBF16, {D, D});
  auto* wp = w.data_as<uint16_t>();
  for (int64_t i = 0; i < D * D; ++i) wp[i] = f32_to_bf16(rng.uniform(-0.05f, 0.05f));
  Tensor y = Tensor::empty(DType::kF32, {T, D});
  const auto t0 = std::chrono::steady_clock::now();
  ops::linear(ctx(), y, x, w);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("linear bf16 [%lld x %lld] x %lld tokens: %.3f s, %.2f GFLOP/s (%d threads)\n", (long long)D,
              (long long)D, (long long)T, s, 2.0 * T * D * D / s * 1e-9, num_threads());
  // A loose bound (shared CI cores); the printed figure is the real check.
  EXPECT_LT(s, 3.0);
  // Spot-check a few outputs against a double dot product.
  const Tensor wf = w.to_f32();
  for (int64_t o : {0, 1, 4095}) {
    double acc = 0;
    for (int64_t i = 0; i < D; ++i) acc += double(x.f32()[7 * D + i]) * wf.f32()[o * D + i];
    EXPECT_NEAR(y.f32()[7 * D + o], acc, 1e-4 + 1e-4 * std::fabs(acc));
  }
}

CHIMERA_INSTANTIATE_BACKENDS(OpsLinear);

}  // namespace
}  // namespace chimera
