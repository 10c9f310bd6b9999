// Embedding and the RMSNorm family against naive double-accumulating loops, on every backend; on CUDA also
// with bf16 activations, the model's hidden sizes (2688, 4096, 4480, 8192) and awkward token counts.
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

// F32 values as they are after a round trip through `dtype` (what a kernel reading that dtype sees).
Tensor rounded(const Tensor& f32, DType dtype) {
  return test::cast_to(f32, dtype).to_f32();
}

class OpsNorm : public BackendTest {
 protected:
  // Activation dtypes under test: the CPU reference is F32 only; CUDA also runs bf16.
  std::vector<DType> act_dtypes() const {
    return on_cuda() ? std::vector<DType>{DType::kF32, DType::kBF16} : std::vector<DType>{DType::kF32};
  }
  static test::Tolerance tol(DType act) { return act == DType::kF32 ? test::kF32Elementwise : test::kBF16Elementwise; }

  // rms_norm of x (host F32, rounded to `act` first) against the oracle.
  void check_rms_norm(test::Rng& rng, const Tensor& x32, DType act, DType wt, float eps) {
    const Tensor x = rounded(x32, act);
    const Tensor w = test::cast_to(rng.uniform_tensor({x.dim(1)}, 0.5f, 1.5f), wt);
    Tensor out = output(act, x.shape());
    ops::rms_norm(ctx(), out, on_backend(x, act), on_backend(w), eps);
    EXPECT_ALL_CLOSE(host_f32(out), naive_rms_norm(x, w, eps), tol(act));
  }
};

TEST_P(OpsNorm, RmsNormMatchesNaive) {
  auto rng = test::Rng::for_test();
  for (DType act : act_dtypes()) {
    for (DType wt : {DType::kF32, DType::kBF16, DType::kF16}) {
      for (int64_t T : {1, 3, 17, 111}) {
        for (int64_t D : {33, 500}) {
          SCOPED_TRACE(::testing::Message()
                       << "T=" << T << " D=" << D << " act=" << dtype_name(act) << " w=" << dtype_name(wt));
          check_rms_norm(rng, rng.normal_tensor({T, D}, 2.0f), act, wt, 1e-5f);
        }
      }
    }
  }
}

// The model's hidden sizes and awkward token counts; 40000 and 65544 exceed the register-cached row and
// take the two-pass path (scalar and 16-byte accesses).
TEST_P(OpsNorm, RmsNormModelShapes) {
  if (!on_cuda()) GTEST_SKIP() << "large shapes: CUDA only (the CPU reference is covered at small shapes)";
  auto rng = test::Rng::for_test();
  const std::pair<int64_t, int64_t> shapes[] = {{1, 8192},    {3, 4480},  {111, 2688}, {989, 8192},
                                                {4099, 1024}, {3, 40000}, {2, 65544}};
  for (DType act : act_dtypes()) {
    for (const auto& [T, D] : shapes) {
      SCOPED_TRACE(::testing::Message() << "T=" << T << " D=" << D << " act=" << dtype_name(act));
      check_rms_norm(rng, rng.normal_tensor({T, D}), act, DType::kBF16, 1e-5f);
    }
  }
}

TEST_P(OpsNorm, RmsNormInPlace) {
  auto rng = test::Rng::for_test();
  for (DType act : act_dtypes()) {
    const Tensor x = rounded(rng.normal_tensor({17, 500}), act);
    const Tensor w = rng.uniform_tensor({500}, 0.5f, 1.5f);
    const Tensor want = naive_rms_norm(x, w, 1e-6f);
    Tensor y = on_backend(x, act);
    ops::rms_norm(ctx(), y, y, on_backend(w), 1e-6f);
    EXPECT_ALL_CLOSE(host_f32(y), want, tol(act));
  }
}

TEST_P(OpsNorm, AddRmsNormUpdatesResidual) {
  auto rng = test::Rng::for_test();
  std::vector<std::pair<int64_t, int64_t>> shapes = {{1, 33}, {3, 33}, {111, 33}};
  if (on_cuda()) shapes.insert(shapes.end(), {{1, 8192}, {17, 2688}, {989, 4480}, {4099, 512}, {3, 40001}});
  for (DType act : act_dtypes()) {
    for (const auto& [T, D] : shapes) {
      SCOPED_TRACE(::testing::Message() << "T=" << T << " D=" << D << " act=" << dtype_name(act));
      const Tensor x = rounded(rng.normal_tensor({T, D}), act);
      const Tensor res0 = rounded(rng.normal_tensor({T, D}), act);
      const Tensor w = test::cast_to(rng.uniform_tensor({D}, 0.5f, 1.5f), DType::kBF16);
      Tensor sum = Tensor::empty(DType::kF32, {T, D});
      for (int64_t i = 0; i < T * D; ++i) sum.f32()[i] = res0.f32()[i] + x.f32()[i];
      sum = rounded(sum, act);  // one fp32 add per element, rounded once to the activation dtype
      Tensor residual = on_backend(res0, act), out = output(act, {T, D});
      ops::add_rms_norm(ctx(), residual, out, on_backend(x, act), on_backend(w), 1e-5f);
      EXPECT_TRUE(test::bit_equal(host_f32(residual), sum));
      EXPECT_ALL_CLOSE(host_f32(out), naive_rms_norm(sum, w, 1e-5f), tol(act));
    }
  }
}

// add2_rms_norm == add(mix, a, b) then add_rms_norm(residual, out, mix), bit for bit on every backend (the
// roundings of the two-op path are kept: a + b rounded to the activation dtype, then the residual add rounded),
// and against the naive oracle.
TEST_P(OpsNorm, Add2RmsNormEqualsAddThenAddRmsNorm) {
  auto rng = test::Rng::for_test();
  std::vector<std::pair<int64_t, int64_t>> shapes = {{1, 33}, {3, 33}, {111, 40}, {8, 512}};
  if (on_cuda()) shapes.insert(shapes.end(), {{1, 2688}, {8, 2688}, {64, 2688}, {1, 4096}, {989, 4480}, {3, 40001}});
  for (DType act : act_dtypes()) {
    for (const auto& [T, D] : shapes) {
      SCOPED_TRACE(::testing::Message() << "T=" << T << " D=" << D << " act=" << dtype_name(act));
      const Tensor a = rounded(rng.normal_tensor({T, D}), act);
      const Tensor b = rounded(rng.normal_tensor({T, D}), act);
      const Tensor res0 = rounded(rng.normal_tensor({T, D}, 4.0f), act);
      const Tensor w = test::cast_to(rng.uniform_tensor({D}, 0.5f, 1.5f), DType::kBF16);
      // The two-op path on this backend.
      Tensor mix = output(act, {T, D}), res_want = on_backend(res0, act), out_want = output(act, {T, D});
      ops::add(ctx(), mix, on_backend(a, act), on_backend(b, act));
      ops::add_rms_norm(ctx(), res_want, out_want, mix, on_backend(w), 1e-5f);
      // The fused op.
      Tensor residual = on_backend(res0, act), out = output(act, {T, D});
      ops::add2_rms_norm(ctx(), residual, out, on_backend(a, act), on_backend(b, act), on_backend(w), 1e-5f);
      EXPECT_TRUE(test::bit_equal(host_f32(residual), host_f32(res_want)));
      EXPECT_TRUE(test::bit_equal(host_f32(out), host_f32(out_want)));
      // Naive: sum = round(res0 + round(a + b)), then the norm.
      Tensor sum = Tensor::empty(DType::kF32, {T, D});
      for (int64_t i = 0; i < T * D; ++i) sum.f32()[i] = a.f32()[i] + b.f32()[i];
      sum = rounded(sum, act);
      for (int64_t i = 0; i < T * D; ++i) sum.f32()[i] += res0.f32()[i];
      sum = rounded(sum, act);
      EXPECT_TRUE(test::bit_equal(host_f32(residual), sum));
      EXPECT_ALL_CLOSE(host_f32(out), naive_rms_norm(sum, w, 1e-5f), tol(act));
    }
  }
}

// ops::residual_rms_norm (the residual step out of place, one launch on CUDA) == convert then add_rms_norm /
// add2_rms_norm in place, bit for bit, and the input residual untouched.
TEST_P(OpsNorm, ResidualRmsNormEqualsCopyThenAddRmsNorm) {
  auto rng = test::Rng::for_test();
  std::vector<std::pair<int64_t, int64_t>> shapes = {{1, 33}, {3, 40}, {8, 512}};
  if (on_cuda()) shapes.insert(shapes.end(), {{1, 2688}, {2, 2688}, {64, 4096}, {3, 40001}});
  for (DType act : act_dtypes()) {
    for (const auto& [T, D] : shapes) {
      for (bool two : {false, true}) {
        SCOPED_TRACE(::testing::Message() << "T=" << T << " D=" << D << " act=" << dtype_name(act) << " b=" << two);
        const Tensor a = on_backend(rounded(rng.normal_tensor({T, D}), act), act);
        const Tensor b = two ? on_backend(rounded(rng.normal_tensor({T, D}), act), act) : Tensor();
        const Tensor res0 = rounded(rng.normal_tensor({T, D}, 4.0f), act);
        const Tensor w = on_backend(test::cast_to(rng.uniform_tensor({D}, 0.5f, 1.5f), DType::kBF16));
        Tensor res_want = on_backend(res0, act), out_want = output(act, {T, D});
        if (two) {
          ops::add2_rms_norm(ctx(), res_want, out_want, a, b, w, 1e-5f);
        } else {
          ops::add_rms_norm(ctx(), res_want, out_want, a, w, 1e-5f);
        }
        ops::ResidualNorm rn;
        rn.residual = on_backend(res0, act);
        rn.residual_out = output(act, {T, D});
        rn.a = a;
        rn.b = b;
        rn.norm_weight = w;
        rn.eps = 1e-5f;
        rn.x = output(act, {T, D});
        ops::residual_rms_norm(ctx(), rn);
        EXPECT_TRUE(test::bit_equal(host_f32(rn.residual_out), host_f32(res_want)));
        EXPECT_TRUE(test::bit_equal(host_f32(rn.x), host_f32(out_want)));
        EXPECT_TRUE(test::bit_equal(host_f32(rn.residual), rounded(res0, act)));
      }
    }
  }
  // The output residual may not overlap its inputs.
  ops::ResidualNorm bad;
  bad.a = output(DType::kF32, {2, 8});
  bad.residual = output(DType::kF32, {2, 8});
  bad.residual_out = bad.residual;
  bad.norm_weight = on_backend(test::cast_to(rng.uniform_tensor({8}, 0.5f, 1.5f), DType::kBF16));
  bad.x = output(DType::kF32, {2, 8});
  EXPECT_THROW(ops::residual_rms_norm(ctx(), bad), Error);
}

TEST_P(OpsNorm, GatedRmsNormMatchesNaive) {
  auto rng = test::Rng::for_test();
  struct Case {
    int64_t T, D, n_groups;
  };
  std::vector<Case> cases;
  for (int64_t n_groups : {1, 2, 8}) {
    for (int64_t T : {1, 17, 111}) {
      for (int64_t D : {40, 504}) cases.push_back({T, D, n_groups});
    }
  }
  // Nano (Di 4096) and Super (Di 8192) with 8 groups; groups of 37 channels (scalar path).
  if (on_cuda()) cases.insert(cases.end(), {{1, 4096, 8}, {989, 4096, 8}, {3, 8192, 8}, {111, 8192, 8}, {17, 296, 8}});
  for (DType act : act_dtypes()) {
    for (const Case& k : cases) {
      SCOPED_TRACE(::testing::Message() << "T=" << k.T << " D=" << k.D << " groups=" << k.n_groups
                                        << " act=" << dtype_name(act));
      const Tensor y = rounded(rng.normal_tensor({k.T, k.D}), act);
      const Tensor z = rounded(rng.normal_tensor({k.T, k.D}, 2.0f), act);
      const Tensor w = rng.uniform_tensor({k.D}, 0.5f, 1.5f);
      Tensor u = Tensor::empty(DType::kF32, {k.T, k.D});
      for (int64_t i = 0; i < k.T * k.D; ++i) {
        const double zz = z.f32()[i];
        u.f32()[i] = float(y.f32()[i] * (zz / (1.0 + std::exp(-zz))));
      }
      Tensor out = output(act, {k.T, k.D});
      ops::gated_rms_norm(ctx(), out, on_backend(y, act), on_backend(z, act), on_backend(w), k.n_groups, 1e-5f);
      EXPECT_ALL_CLOSE(host_f32(out), naive_rms_norm(u, w, 1e-5f, k.D / k.n_groups), tol(act));
    }
  }
}

TEST_P(OpsNorm, EmbeddingGathersRows) {
  auto rng = test::Rng::for_test();
  struct Case {
    int64_t V, D, T;
  };
  std::vector<Case> cases = {{37, 33, 5}};
  if (on_cuda()) cases.insert(cases.end(), {{1000, 2688, 989}, {50, 4480, 1}, {64, 8192, 17}, {300, 64, 4099}});
  for (DType out_dt : act_dtypes()) {
    for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
      for (const Case& k : cases) {
        SCOPED_TRACE(::testing::Message() << "table " << dtype_name(dt) << " out " << dtype_name(out_dt) << " V=" << k.V
                                          << " D=" << k.D << " T=" << k.T);
        const Tensor table = test::cast_to(rng.normal_tensor({k.V, k.D}), dt);
        std::vector<int32_t> ids = {5, 0, int32_t(k.V - 1), 5, 17};
        ids.resize(static_cast<size_t>(k.T));
        for (size_t t = 5; t < ids.size(); ++t) ids[t] = int32_t(rng.integer(0, k.V - 1));
        Tensor out = output(out_dt, {k.T, k.D});
        ops::embedding(ctx(), out, on_backend(table), ids);
        const Tensor got = host_f32(out);
        const Tensor tf = table.to_f32();
        for (size_t t = 0; t < ids.size(); ++t) {
          ASSERT_TRUE(test::bit_equal(got.select(int64_t(t)), rounded(tf.select(ids[t]).clone(), out_dt)))
              << "token " << t;
        }
      }
    }
  }
}

TEST_P(OpsNorm, EmbeddingRejectsOutOfRangeIds) {
  const Tensor table = on_backend(Tensor::zeros(DType::kF32, {10, 4}));
  Tensor out = output(DType::kF32, {2, 4});
  const std::vector<int32_t> bad = {3, 10}, negative = {-1, 0};
  EXPECT_TRUE(test::throws_error([&] { ops::embedding(ctx(), out, table, bad); }, ErrorKind::kInvalidInput,
                                 "token id 10 at position 1 is out of range for vocab size 10"));
  EXPECT_TRUE(test::throws_error([&] { ops::embedding(ctx(), out, table, negative); }, ErrorKind::kInvalidInput,
                                 "token id -1"));
}

TEST_P(OpsNorm, BadShapesThrowNamingTheOp) {
  const Tensor x = on_backend(Tensor::zeros(DType::kF32, {3, 8}));
  Tensor out = output(DType::kF32, {3, 8});
  EXPECT_TRUE(
      test::throws_error([&] { ops::rms_norm(ctx(), out, x, on_backend(Tensor::zeros(DType::kF32, {7})), 1e-5f); },
                         ErrorKind::kRuntime, "ops::rms_norm: weight F32[7] does not match x F32[3, 8]"));
  EXPECT_TRUE(test::throws_error(
      [&] { ops::gated_rms_norm(ctx(), out, x, x, on_backend(Tensor::zeros(DType::kF32, {8})), 3, 1e-5f); },
      ErrorKind::kRuntime, "ops::gated_rms_norm: n_groups 3"));
  const Tensor w = on_backend(Tensor::zeros(DType::kF32, {8}));
  Tensor res8 = output(DType::kF32, {3, 8});
  EXPECT_TRUE(test::throws_error(
      [&] { ops::add2_rms_norm(ctx(), res8, out, x, on_backend(Tensor::zeros(DType::kF32, {3, 7})), w, 1e-5f); },
      ErrorKind::kRuntime, "ops::add2_rms_norm: b F32[3, 7] does not match a F32[3, 8]"));
  if (!on_cuda()) {
    EXPECT_TRUE(test::throws_error(
        [&] {
          ops::rms_norm(ctx(), out, Tensor::zeros(DType::kBF16, {3, 8}), w, 1e-5f);
        },
        ErrorKind::kRuntime, "ops::rms_norm: x BF16[3, 8] must be F32"));
  } else {
    EXPECT_TRUE(test::throws_error(
        [&] {
          ops::rms_norm(ctx(), out, on_backend(Tensor::zeros(DType::kI32, {3, 8})), w, 1e-5f);
        },
        ErrorKind::kRuntime, "ops::rms_norm: x I32[3, 8] must be F32, BF16 or F16"));
    // One activation dtype per call on CUDA.
    const Tensor xb = on_backend(Tensor::zeros(DType::kF32, {3, 8}), DType::kBF16);
    EXPECT_TRUE(test::throws_error([&] { ops::rms_norm(ctx(), out, xb, w, 1e-5f); }, ErrorKind::kRuntime,
                                   "ops::rms_norm: the activations of one call must share a dtype on CUDA, got x "
                                   "BF16[3, 8], out F32[3, 8]"));
    Tensor res = on_backend(Tensor::zeros(DType::kF32, {3, 8}));
    EXPECT_TRUE(test::throws_error([&] { ops::add_rms_norm(ctx(), res, out, xb, w, 1e-5f); }, ErrorKind::kRuntime,
                                   "ops::add_rms_norm: the activations of one call must share a dtype"));
    EXPECT_TRUE(test::throws_error([&] { ops::add2_rms_norm(ctx(), res, out, x, xb, w, 1e-5f); }, ErrorKind::kRuntime,
                                   "ops::add2_rms_norm: the activations of one call must share a dtype"));
  }
}

CHIMERA_INSTANTIATE_BACKENDS(OpsNorm);

}  // namespace
}  // namespace chimera
