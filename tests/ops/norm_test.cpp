// Embedding and the RMSNorm family against naive double-accumulating loops.
#include <cmath>
#include <vector>

#include "common/backend_param.h"
#include "common/compare.h"

namespace chimera {
namespace {

using test::BackendTest;

// Naive oracle: out[t] = w * x[t] / sqrt(mean(x[t]^2) + eps), groups of `gs` channels normalised separately.
Tensor naive_rms_norm(const Tensor& x, const Tensor& w_any, float eps, int64_t gs = 0) {
  const int64_t T = x.dim(0), D = x.dim(1);
  if (gs == 0) gs = D;
  const Tensor w = w_any.to_f32();
  Tensor out = Tensor::empty(DType::kF32, {T, D});
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t g0 = 0; g0 < D; g0 += gs) {
      double ss = 0;
      for (int64_t c = g0; c < g0 + gs; ++c) ss += double(x.f32()[t * D + c]) * x.f32()[t * D + c];
      const double inv = 1.0 / std::sqrt(ss / double(gs) + eps);
      for (int64_t c = g0; c < g0 + gs; ++c) out.f32()[t * D + c] = float(w.f32()[c] * (x.f32()[t * D + c] * inv));
    }
  }
  return out;
}

class OpsNorm : public BackendTest {};

TEST_P(OpsNorm, RmsNormMatchesNaive) {
  auto rng = test::Rng::for_test();
  for (DType wt : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (int64_t T : {1, 3, 17, 111}) {
      for (int64_t D : {33, 500}) {
        SCOPED_TRACE(::testing::Message() << "T=" << T << " D=" << D << " w=" << dtype_name(wt));
        const Tensor x = rng.normal_tensor({T, D}, 2.0f);
        const Tensor w = test::cast_to(rng.uniform_tensor({D}, 0.5f, 1.5f), wt);
        Tensor out = Tensor::empty(DType::kF32, {T, D});
        test::poison(out);
        ops::rms_norm(ctx(), out, x, w, 1e-5f);
        EXPECT_ALL_CLOSE(out, naive_rms_norm(x, w, 1e-5f), test::kF32Elementwise);
      }
    }
  }
}

TEST_P(OpsNorm, RmsNormInPlace) {
  auto rng = test::Rng::for_test();
  const Tensor x = rng.normal_tensor({17, 500});
  const Tensor w = rng.uniform_tensor({500}, 0.5f, 1.5f);
  const Tensor want = naive_rms_norm(x, w, 1e-6f);
  Tensor y = x.clone();
  ops::rms_norm(ctx(), y, y, w, 1e-6f);
  EXPECT_ALL_CLOSE(y, want, test::kF32Elementwise);
}

TEST_P(OpsNorm, AddRmsNormUpdatesResidual) {
  auto rng = test::Rng::for_test();
  for (int64_t T : {1, 3, 111}) {
    const int64_t D = 33;
    const Tensor x = rng.normal_tensor({T, D});
    const Tensor res0 = rng.normal_tensor({T, D});
    const Tensor w = test::cast_to(rng.uniform_tensor({D}, 0.5f, 1.5f), DType::kBF16);
    Tensor sum = Tensor::empty(DType::kF32, {T, D});
    for (int64_t i = 0; i < T * D; ++i) sum.f32()[i] = res0.f32()[i] + x.f32()[i];
    Tensor residual = res0.clone(), out = Tensor::empty(DType::kF32, {T, D});
    test::poison(out);
    ops::add_rms_norm(ctx(), residual, out, x, w, 1e-5f);
    EXPECT_TRUE(test::bit_equal(residual, sum));  // one fp32 add per element, the same on both sides
    EXPECT_ALL_CLOSE(out, naive_rms_norm(sum, w, 1e-5f), test::kF32Elementwise);
  }
}

TEST_P(OpsNorm, GatedRmsNormMatchesNaive) {
  auto rng = test::Rng::for_test();
  for (int64_t n_groups : {1, 2, 8}) {
    for (int64_t T : {1, 17, 111}) {
      for (int64_t D : {40, 504}) {
        SCOPED_TRACE(::testing::Message() << "T=" << T << " D=" << D << " groups=" << n_groups);
        const Tensor y = rng.normal_tensor({T, D}), z = rng.normal_tensor({T, D}, 2.0f);
        const Tensor w = rng.uniform_tensor({D}, 0.5f, 1.5f);
        Tensor u = Tensor::empty(DType::kF32, {T, D});
        for (int64_t i = 0; i < T * D; ++i) {
          const double zz = z.f32()[i];
          u.f32()[i] = float(y.f32()[i] * (zz / (1.0 + std::exp(-zz))));
        }
        Tensor out = Tensor::empty(DType::kF32, {T, D});
        test::poison(out);
        ops::gated_rms_norm(ctx(), out, y, z, w, n_groups, 1e-5f);
        EXPECT_ALL_CLOSE(out, naive_rms_norm(u, w, 1e-5f, D / n_groups), test::kF32Elementwise);
      }
    }
  }
}

TEST_P(OpsNorm, EmbeddingGathersRows) {
  auto rng = test::Rng::for_test();
  for (DType dt : {DType::kF32, DType::kBF16}) {
    const int64_t V = 37, D = 33;
    const Tensor table = test::cast_to(rng.normal_tensor({V, D}), dt);
    const std::vector<int32_t> ids = {5, 0, 36, 5, 17};
    Tensor out = Tensor::empty(DType::kF32, {5, D});
    test::poison(out);
    ops::embedding(ctx(), out, table, ids);
    const Tensor tf = table.to_f32();
    for (size_t t = 0; t < ids.size(); ++t) {
      EXPECT_TRUE(test::bit_equal(out.select(int64_t(t)), tf.select(ids[t])));
    }
  }
}

TEST_P(OpsNorm, EmbeddingRejectsOutOfRangeIds) {
  const Tensor table = Tensor::zeros(DType::kF32, {10, 4});
  Tensor out = Tensor::empty(DType::kF32, {2, 4});
  const std::vector<int32_t> bad = {3, 10}, negative = {-1, 0};
  EXPECT_TRUE(test::throws_error([&] { ops::embedding(ctx(), out, table, bad); }, ErrorKind::kInvalidInput,
                                 "token id 10 at position 1 is out of range for vocab size 10"));
  EXPECT_TRUE(test::throws_error([&] { ops::embedding(ctx(), out, table, negative); }, ErrorKind::kInvalidInput,
                                 "token id -1"));
}

TEST_P(OpsNorm, BadShapesThrowNamingTheOp) {
  const Tensor x = Tensor::zeros(DType::kF32, {3, 8});
  Tensor out = Tensor::empty(DType::kF32, {3, 8});
  EXPECT_TRUE(test::throws_error([&] { ops::rms_norm(ctx(), out, x, Tensor::zeros(DType::kF32, {7}), 1e-5f); },
                                 ErrorKind::kRuntime, "ops::rms_norm: weight F32[7] does not match x F32[3, 8]"));
  EXPECT_TRUE(
      test::throws_error([&] { ops::gated_rms_norm(ctx(), out, x, x, Tensor::zeros(DType::kF32, {8}), 3, 1e-5f); },
                         ErrorKind::kRuntime, "ops::gated_rms_norm: n_groups 3"));
  EXPECT_TRUE(test::throws_error(
      [&] {
        ops::rms_norm(ctx(), out, Tensor::zeros(DType::kBF16, {3, 8}), Tensor::zeros(DType::kF32, {8}), 1e-5f);
      },
      ErrorKind::kRuntime, "ops::rms_norm: x BF16[3, 8] must be F32"));
}

CHIMERA_INSTANTIATE_BACKENDS(OpsNorm);

}  // namespace
}  // namespace chimera
