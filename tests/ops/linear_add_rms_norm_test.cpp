// ops::linear_add_rms_norm and ops::relu2_mlp_add_rms_norm: a decode layer's last dense layer with the residual norm
// behind it. On every backend the op is exactly linear (relu2_mlp) then add_rms_norm, bit for bit; on CUDA the norm
// runs inside the GEMV's launch where it can (gemm/gemv.h, GemvNormEpilogue), which must not change a bit either:
// fold on vs off at every GEMV split of a row (1, 2, 4, 8 warps), token counts 1..8, awkward K / N, rows the epilogue
// does not take (fallback to the norm kernel), with and without bias, bf16 and f16, and replayed in a CUDA graph (the
// epilogue's ticket word must wrap back to zero after every launch). Also against naive double loops.
#include <cmath>
#include <tuple>
#include <vector>

#include "common/backend_param.h"
#include "common/compare.h"
#ifdef CHIMERA_HAVE_CUDA
#include "backends/cuda/gemm/linear.h"
#endif

namespace chimera {
namespace {

using test::BackendTest;

Tensor rounded(const Tensor& f32, DType dtype) {
  return test::cast_to(f32, dtype).to_f32();
}

// y = x @ W^T + b with double accumulation.
Tensor naive_linear(const Tensor& x, const Tensor& w_any, const Tensor& b_any) {
  const Tensor w = w_any.to_f32();
  const Tensor b = b_any ? b_any.to_f32() : Tensor();
  const int64_t T = x.dim(0), in = x.dim(1), out = w.dim(0);
  Tensor y = Tensor::empty(DType::kF32, {T, out});
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t o = 0; o < out; ++o) {
      double acc = b ? double(b.f32()[o]) : 0.0;
      for (int64_t i = 0; i < in; ++i) acc += double(x.f32()[t * in + i]) * w.f32()[o * in + i];
      y.f32()[t * out + o] = float(acc);
    }
  }
  return y;
}

// add_rms_norm's residual update on host values: one fp32 add per element, rounded once to the activation dtype.
Tensor residual_sum(const Tensor& res0, const Tensor& y, DType act) {
  Tensor s = Tensor::empty(DType::kF32, res0.shape());
  for (int64_t i = 0; i < s.numel(); ++i) s.f32()[i] = res0.f32()[i] + y.f32()[i];
  return rounded(s, act);
}

// out[t] = w * r[t] / sqrt(mean(r[t]^2) + eps) in double.
Tensor naive_rms_norm(const Tensor& r, const Tensor& w_any, float eps) {
  const Tensor w = w_any.to_f32();
  const int64_t T = r.dim(0), D = r.dim(1);
  Tensor out = Tensor::empty(DType::kF32, {T, D});
  for (int64_t t = 0; t < T; ++t) {
    double ss = 0;
    for (int64_t c = 0; c < D; ++c) ss += double(r.f32()[t * D + c]) * r.f32()[t * D + c];
    const double inv = 1.0 / std::sqrt(ss / double(D) + eps);
    for (int64_t c = 0; c < D; ++c) out.f32()[t * D + c] = float(w.f32()[c] * (r.f32()[t * D + c] * inv));
  }
  return out;
}

constexpr float kEps = 1e-5f;

// Host inputs of one case (rounded to the activation dtype where they are activations).
struct Inputs {
  Tensor x, w, b, res0, norm_w;  // x [T, K]; w [N, K]; b [N] or undefined; res0 [T, N]; norm_w [N]
};

// Host copies (F32) of the op's three results.
struct Results {
  Tensor y, residual, out;
};

class OpsLinearAddRmsNorm : public BackendTest {
 protected:
  Inputs make(test::Rng& rng, int64_t T, int64_t K, int64_t N, bool bias, DType act, DType norm_dtype) const {
    Inputs in;
    in.x = rounded(rng.uniform_tensor({T, K}, -1.0f, 1.0f), act);
    in.w = test::cast_to(rng.uniform_tensor({N, K}, -0.05f, 0.05f), act);
    in.b = bias ? test::cast_to(rng.uniform_tensor({N}, -1.0f, 1.0f), act) : Tensor();
    in.res0 = rounded(rng.normal_tensor({T, N}, 2.0f), act);
    in.norm_w = test::cast_to(rng.uniform_tensor({N}, 0.5f, 1.5f), norm_dtype);
    return in;
  }

  // `op(y, residual, out)` on device copies: residual from res0, y and out poisoned.
  template <typename Op>
  Results run(const Inputs& in, DType act, Op&& op) const {
    const int64_t T = in.x.dim(0), N = in.w.dim(0);
    Tensor y = output(act, {T, N}), residual = on_backend(in.res0, act), out = output(act, {T, N});
    op(y, residual, out);
    return {host_f32(y), host_f32(residual), host_f32(out)};
  }

  // The device inputs of `in` (x in the activation dtype, the rest as stored).
  struct DeviceInputs {
    Tensor x, w, b, norm_w;
  };
  DeviceInputs upload(const Inputs& in, DType act) const {
    return {on_backend(in.x, act), on_backend(in.w), in.b ? on_backend(in.b) : Tensor(), on_backend(in.norm_w)};
  }

  static ::testing::AssertionResult same(const Results& got, const Results& want) {
    for (const auto& [g, w, name] :
         {std::tuple{&got.y, &want.y, "y"}, std::tuple{&got.residual, &want.residual, "residual"},
          std::tuple{&got.out, &want.out, "out"}}) {
      const ::testing::AssertionResult r = test::bit_equal(*g, *w);
      if (!r) return ::testing::AssertionFailure() << name << ": " << r.message();
    }
    return ::testing::AssertionSuccess();
  }

  // Against the naive loops: y by normalised MSE, the residual exactly from the op's own y, out from that residual.
  static void check_reference(const Results& got, const Inputs& in, DType act) {
    const bool f32 = act == DType::kF32;
    EXPECT_TRUE(test::nmse_close(got.y, naive_linear(in.x, in.w, in.b),
                                 f32 ? test::kF32ReductionNmse : test::kBF16ReductionNmse,
                                 f32 ? test::kF32Reduction : test::kBF16Elementwise))
        << "y";
    const Tensor r = residual_sum(in.res0, got.y, act);
    EXPECT_TRUE(test::bit_equal(got.residual, r)) << "residual";
    EXPECT_ALL_CLOSE(got.out, naive_rms_norm(r, in.norm_w, kEps), f32 ? test::kF32Elementwise : test::kBF16Elementwise);
  }
};

// The op equals ops::linear then ops::add_rms_norm bit for bit on every backend (CUDA: the same cached path for the
// linear, the fold where it applies), and matches the naive loops. CUDA adds the model's shapes, 16-bit activations,
// token counts 1..8 (the GEMV's range, T > 2 taking cuBLASLt under the automatic choice) and a norm weight in another
// dtype (never folded).
TEST_P(OpsLinearAddRmsNorm, EqualsLinearThenAddRmsNorm) {
  auto rng = test::Rng::for_test();
  struct Case {
    int64_t K, N;
  };
  std::vector<Case> cases = {{40, 33}, {40, 48}, {64, 200}};
  if (on_cuda()) cases.insert(cases.end(), {{4096, 2688}, {2688, 2688}, {4096, 4480}, {8, 96}});
  const std::vector<DType> acts =
      on_cuda() ? std::vector<DType>{DType::kBF16, DType::kF16, DType::kF32} : std::vector<DType>{DType::kF32};
  for (DType act : acts) {
    for (const Case& k : cases) {
      for (int64_t T : {1, 2, 3, 5, 8}) {
        const bool bias = (T + k.N) % 2 == 1;
        const DType norm_dtype = on_cuda() && T == 3 ? DType::kF32 : act;
        SCOPED_TRACE(::testing::Message() << dtype_name(act) << " T=" << T << " K=" << k.K << " N=" << k.N
                                          << " bias=" << bias << " norm_w=" << dtype_name(norm_dtype));
        const Inputs in = make(rng, T, k.K, k.N, bias, act, norm_dtype);
        const DeviceInputs d = upload(in, act);
        const Results want = run(in, act, [&](const Tensor& y, const Tensor& res, const Tensor& out) {
          ops::linear(ctx(), y, d.x, d.w, d.b);
          ops::add_rms_norm(ctx(), res, out, y, d.norm_w, kEps);
        });
        const Results got = run(in, act, [&](const Tensor& y, const Tensor& res, const Tensor& out) {
          ops::linear_add_rms_norm(ctx(), y, d.x, d.w, d.b, res, out, d.norm_w, kEps);
        });
        EXPECT_TRUE(same(got, want));
        check_reference(got, in, act);
      }
    }
  }
}

// The dense MLP layer: relu2_mlp then add_rms_norm, bit for bit; the MLP input may be the norm's output (the model
// passes x for both).
TEST_P(OpsLinearAddRmsNorm, Relu2MlpEqualsRelu2MlpThenAddRmsNorm) {
  auto rng = test::Rng::for_test();
  struct Case {
    int64_t T, D, I;
  };
  std::vector<Case> cases = {{1, 33, 70}, {3, 48, 70}};
  if (on_cuda()) cases.insert(cases.end(), {{1, 4096, 1024}, {2, 2688, 1856}, {5, 512, 256}});
  for (DType act : on_cuda() ? std::vector<DType>{DType::kBF16, DType::kF32} : std::vector<DType>{DType::kF32}) {
    for (const Case& k : cases) {
      SCOPED_TRACE(::testing::Message() << dtype_name(act) << " T=" << k.T << " D=" << k.D << " I=" << k.I);
      const Tensor x = rounded(rng.normal_tensor({k.T, k.D}), act);
      const Tensor up = test::cast_to(rng.normal_tensor({k.I, k.D}, 1.0f / std::sqrt(float(k.D))), act);
      const Tensor down = test::cast_to(rng.normal_tensor({k.D, k.I}, 1.0f / std::sqrt(float(k.I))), act);
      const Tensor res0 = rounded(rng.normal_tensor({k.T, k.D}, 2.0f), act);
      const Tensor norm_w = test::cast_to(rng.uniform_tensor({k.D}, 0.5f, 1.5f), act);
      const Tensor dup = on_backend(up), ddown = on_backend(down), dnw = on_backend(norm_w);
      std::vector<Results> results;
      for (bool fused : {false, true}) {
        Tensor out = output(act, {k.T, k.D}), residual = on_backend(res0, act), xn = on_backend(x, act);
        if (fused) {
          ops::relu2_mlp_add_rms_norm(ctx(), out, xn, dup, ddown, residual, xn, dnw, kEps);  // norm_out = the input
        } else {
          ops::relu2_mlp(ctx(), out, xn, dup, ddown);
          ops::add_rms_norm(ctx(), residual, xn, out, dnw, kEps);
        }
        results.push_back({host_f32(out), host_f32(residual), host_f32(xn)});
      }
      EXPECT_TRUE(same(results[1], results[0]));
      const Tensor r = residual_sum(res0, results[1].y, act);
      EXPECT_TRUE(test::bit_equal(results[1].residual, r));
      EXPECT_ALL_CLOSE(results[1].out, naive_rms_norm(r, norm_w, kEps),
                       act == DType::kF32 ? test::kF32Elementwise : test::kBF16Elementwise);
    }
  }
}

TEST_P(OpsLinearAddRmsNorm, BadShapesThrowNamingTheOp) {
  const Tensor x = on_backend(Tensor::zeros(DType::kF32, {2, 32}));
  const Tensor w = on_backend(Tensor::zeros(DType::kF32, {16, 32}));
  const Tensor nw = on_backend(Tensor::zeros(DType::kF32, {16}));
  Tensor y = output(DType::kF32, {2, 16}), res = output(DType::kF32, {2, 16}), out = output(DType::kF32, {2, 16});
  Tensor res_bad = output(DType::kF32, {2, 15});
  EXPECT_TRUE(test::throws_error([&] { ops::linear_add_rms_norm(ctx(), y, x, w, Tensor(), res_bad, out, nw, kEps); },
                                 ErrorKind::kRuntime,
                                 "ops::linear_add_rms_norm: residual F32[2, 15] does not match y"));
  EXPECT_TRUE(test::throws_error([&] { ops::linear_add_rms_norm(ctx(), y, x, w, Tensor(), y, out, nw, kEps); },
                                 ErrorKind::kRuntime, "ops::linear_add_rms_norm: y must not overlap residual"));
  EXPECT_TRUE(test::throws_error(
      [&] {
        ops::linear_add_rms_norm(ctx(), y, x, w, Tensor(), res, out, on_backend(Tensor::zeros(DType::kF32, {8})), kEps);
      },
      ErrorKind::kRuntime, "ops::linear_add_rms_norm: norm_weight F32[8] does not match y"));
}

#ifdef CHIMERA_HAVE_CUDA
// The fold itself: the forced GEMV at 1, 2, 4 and 8 warps per row (and its own rule), fold on vs off bit for bit, at
// every decode token count the GEMV takes; rows the epilogue takes (Nano 2688, the 8B's 4096, a small 48 whose norm
// threads share a warp, 96 rows of N < one wave) and rows it does not (4480 > 4096, 33 not a multiple of 8, 40008)
// fall back to the norm kernel with the same bits. Against the naive loops too.
TEST_P(OpsLinearAddRmsNorm, FoldEqualsGemvThenNormKernel) {
  if (!on_cuda()) GTEST_SKIP() << "the GEMV epilogue is CUDA's";
  auto rng = test::Rng::for_test();
  struct Case {
    int64_t K, N;
    bool folds;
  };
  const Case cases[] = {{2688, 2688, true},  {4096, 2688, true}, {4096, 4096, true},
                        {40, 48, true},      {2688, 96, true},   {8192, 4096, true},
                        {4096, 4480, false}, {40, 33, false},    {256, 40008, false}};
  for (DType act : {DType::kBF16, DType::kF16}) {
    for (const Case& k : cases) {
      for (int64_t T : {1, 2, 3, 5, 8}) {
        const int64_t mt = T <= 1 ? 1 : T <= 2 ? 2 : T <= 4 ? 4 : 8;
        if (k.K * mt * 2 > 100 * 1024) continue;  // x past the GEMV's shared-memory budget
        const bool bias = (T + k.K / 8) % 2 == 0;
        const Inputs in = make(rng, T, k.K, k.N, bias, act, act);
        const DeviceInputs d = upload(in, act);
        for (int wpr : {0, 1, 2, 4, 8}) {
          SCOPED_TRACE(::testing::Message() << dtype_name(act) << " T=" << T << " K=" << k.K << " N=" << k.N
                                            << " bias=" << bias << " warps_per_row=" << wpr);
          std::vector<Results> r;
          for (bool fold : {false, true}) {
            r.push_back(run(in, act, [&](const Tensor& y, const Tensor& res, const Tensor& out) {
              if (fold) {
                ASSERT_EQ(cuda::linear_add_rms_norm_foldable(y, res, out, d.norm_w), k.folds);
              }
              cuda::linear_add_rms_norm_on_path(ctx(), y, d.x, d.w, d.b, res, out, d.norm_w, kEps,
                                                cuda::LinearPath::kGemv, wpr, fold);
            }));
          }
          EXPECT_TRUE(same(r[1], r[0]));
          if (wpr == 0) check_reference(r[1], in, act);
        }
      }
    }
  }
}

// Folded launches captured in one CUDA graph (two shapes of different grid sizes sharing the thread's ticket word,
// the residual carried from launch to launch) and replayed several times: every replay gives the bits of the same
// sequence run eagerly without the fold, and an eager folded call afterwards still does (the word is back at zero).
TEST_P(OpsLinearAddRmsNorm, FoldReplaysInACudaGraph) {
  if (!on_cuda()) GTEST_SKIP() << "the GEMV epilogue is CUDA's";
  auto rng = test::Rng::for_test();
  const DType act = DType::kBF16;
  const Inputs big = make(rng, 1, 4096, 2688, false, act, act);
  const Inputs small = make(rng, 2, 40, 48, true, act, act);
  const DeviceInputs db = upload(big, act), ds = upload(small, act);
  const device::Stream stream = device::Stream::create();
  const ops::Context c{Device::kCuda, stream.get()};
  Tensor yb = output(act, {1, 2688}), rb = on_backend(big.res0, act), ob = output(act, {1, 2688});
  Tensor ys = output(act, {2, 48}), rs = on_backend(small.res0, act), os = output(act, {2, 48});
  const auto sequence = [&](bool fold) {
    for (int i = 0; i < 3; ++i) {
      cuda::linear_add_rms_norm_on_path(c, yb, db.x, db.w, db.b, rb, ob, db.norm_w, kEps, cuda::LinearPath::kGemv, 0,
                                        fold);
      cuda::linear_add_rms_norm_on_path(c, ys, ds.x, ds.w, ds.b, rs, os, ds.norm_w, kEps, cuda::LinearPath::kGemv, 2,
                                        fold);
    }
  };
  const auto reset = [&] {
    device::copy(rb, test::cast_to(big.res0, act));
    device::copy(rs, test::cast_to(small.res0, act));
  };
  const auto results = [&] {
    stream.synchronize();
    return std::vector<Tensor>{host_f32(yb), host_f32(rb), host_f32(ob), host_f32(ys), host_f32(rs), host_f32(os)};
  };
  sequence(false);
  const std::vector<Tensor> want = results();
  reset();
  device::AllocPool pool;
  device::Graph graph;
  {
    const device::ScopedAllocPool scope(pool);
    graph = device::Graph::capture(c.stream, [&] { sequence(true); });
  }
  ASSERT_TRUE(static_cast<bool>(graph));
  for (int rep = 0; rep < 4; ++rep) {
    SCOPED_TRACE(::testing::Message() << "replay " << rep);
    reset();
    graph.launch(c.stream);
    const std::vector<Tensor> got = results();
    for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(test::bit_equal(got[i], want[i])) << i;
  }
  reset();
  sequence(true);
  const std::vector<Tensor> eager = results();
  for (size_t i = 0; i < eager.size(); ++i) EXPECT_TRUE(test::bit_equal(eager[i], want[i])) << "eager " << i;
}
#endif

CHIMERA_INSTANTIATE_BACKENDS(OpsLinearAddRmsNorm);

}  // namespace
}  // namespace chimera
