// FP8 activation quantization and the fused norm + FP8 quant ops (ops/quant_norm_ops.h) on every backend:
//   * quantize_fp8 bit for bit against core/fp8.h's f32_to_e4m3 (itself bit-exact against torch), special values
//     included (ties, subnormals, the saturation range, infinities, signed zeros), aligned and misaligned views;
//   * add_rms_norm_fp8 / gated_rms_norm_fp8 against a double-precision reference, where a code may differ only where
//     the reference value is ambiguous (tolerances.h, kFp8BoundaryRel), and (CUDA) bit for bit against the unfused
//     ops followed by quantize_fp8, in F32 and BF16, at the model's hidden sizes and awkward token counts, on the
//     register-cached and the long-row paths;
//   * (CUDA) the fused ops captured in a CUDA graph give the eager bits.
#include <cmath>
#include <cstring>
#include <vector>

#include "common/backend_param.h"
#include "common/compare.h"
#include "core/fp8.h"
#include "ops/quant_norm_ops.h"

namespace chimera {
namespace {

using test::BackendTest;

float round_to(float v, DType act) {
  if (act == DType::kBF16) return bf16_to_f32(f32_to_bf16(v));
  if (act == DType::kF16) return f16_to_f32(f32_to_f16(v));
  return v;
}

// The op's code for a normalised value v: e4m3(round_act(v) / s).
uint8_t code_of(double v, DType act, float s) {
  return f32_to_e4m3(round_to(static_cast<float>(v), act) / s);
}

std::vector<uint8_t> bytes(const Tensor& t) {
  const Tensor h = device::to_host(t);
  const auto* p = static_cast<const uint8_t*>(h.data());
  return {p, p + h.nbytes()};
}

// got codes vs the reference values v (double) of the normalised row: equal, or, where v is ambiguous (its codes at
// v (1 -+ kFp8BoundaryRel) differ), one of those two codes. Reports the flips (accepted differences).
void expect_codes(const std::vector<uint8_t>& got, const std::vector<double>& v, DType act, float s) {
  ASSERT_EQ(got.size(), v.size());
  int64_t flips = 0, bad = 0, first_bad = -1;
  for (size_t i = 0; i < v.size(); ++i) {
    const uint8_t want = code_of(v[i], act, s);
    if (got[i] == want) continue;
    const uint8_t lo = code_of(v[i] * (1.0 - test::kFp8BoundaryRel), act, s);
    const uint8_t hi = code_of(v[i] * (1.0 + test::kFp8BoundaryRel), act, s);
    if (lo != hi && (got[i] == lo || got[i] == hi)) {
      ++flips;
    } else if (bad++ == 0) {
      first_bad = static_cast<int64_t>(i);
    }
  }
  EXPECT_EQ(bad, 0) << "first at " << first_bad << ": got 0x" << std::hex << int(got[size_t(first_bad)]) << " want 0x"
                    << int(code_of(v[size_t(first_bad)], act, s)) << std::dec << " (value " << v[size_t(first_bad)]
                    << ", scale " << s << ")";
  // Ambiguous values are rare (a band of 2^-16 relative around each boundary, boundaries 2^-3 apart).
  EXPECT_LE(flips, 2 + static_cast<int64_t>(v.size() / 1000)) << flips << " flips among " << v.size();
}

class QuantNorm : public BackendTest {
 protected:
  std::vector<DType> act_dtypes() const {
    return on_cuda() ? std::vector<DType>{DType::kF32, DType::kBF16} : std::vector<DType>{DType::kF32};
  }
  // A host F32 tensor rounded to `act` (the values the kernel sees).
  static Tensor rounded(const Tensor& f32, DType act) { return test::cast_to(f32, act).to_f32(); }
};

TEST_P(QuantNorm, QuantizeMatchesCoreBitForBit) {
  auto rng = test::Rng::for_test();
  const float s = 2.5f / kE4m3Max;
  // Special magnitudes in units of s: zero, subnormal steps and their ties, normal ties, the top of the range,
  // the saturation band (448 .. 464 rounds to 448, above saturates), huge values and infinities.
  const float units[] = {0.0f,   1.0f / 1024, 1.0f / 512, 3.0f / 1024, 5.0f / 1024, 0.015625f, 1.0625f, 1.1875f, 240.0f,
                         248.0f, 447.0f,      448.0f,     455.0f,      464.0f,      465.0f,    1e6f,    INFINITY};
  for (DType act :
       on_cuda() ? std::vector<DType>{DType::kF32, DType::kBF16, DType::kF16} : std::vector<DType>{DType::kF32}) {
    for (const auto& [T, K] : {std::pair<int64_t, int64_t>{1, 7}, {3, 11}, {1, 4099}, {37, 64}, {9, 2688}}) {
      SCOPED_TRACE(::testing::Message() << "T=" << T << " K=" << K << " act=" << dtype_name(act));
      Tensor x = rng.normal_tensor({T + 1, K}, 1.5f);
      for (size_t i = 0; i < std::size(units) && static_cast<int64_t>(2 * i + 1) < x.numel(); ++i) {
        x.f32()[2 * i] = units[i] * s;
        x.f32()[2 * i + 1] = -units[i] * s;
      }
      const Tensor xr = rounded(x, act);
      // The whole tensor (aligned) and rows [1, T + 1) (misaligned unless K is a multiple of the vector).
      for (const bool view : {false, true}) {
        const Tensor dev = on_backend(xr, act);
        const Tensor in = view ? dev.rows(1, T + 1) : dev;
        const Tensor host_in = view ? xr.rows(1, T + 1) : xr;
        Tensor q = output(DType::kF8E4M3, in.shape());
        ops::quantize_fp8(ctx(), q, in, s);
        const std::vector<uint8_t> got = bytes(q);
        int64_t bad = 0;
        for (int64_t i = 0; i < host_in.numel(); ++i) {
          const uint8_t want = f32_to_e4m3(host_in.f32()[i] / s);
          if (got[size_t(i)] != want && bad++ < 3) {
            ADD_FAILURE() << "element " << i << " (" << host_in.f32()[i] << "): got 0x" << std::hex
                          << int(got[size_t(i)]) << " want 0x" << int(want) << std::dec << (view ? " (view)" : "");
          }
        }
        EXPECT_EQ(bad, 0);
      }
    }
  }
}

// Double-precision normalised values of add + RMSNorm given the residual as the op stored it.
std::vector<double> add_norm_ref(const Tensor& res, const Tensor& w, float eps) {
  const int64_t T = res.dim(0), D = res.dim(1);
  std::vector<double> v(size_t(T * D));
  for (int64_t t = 0; t < T; ++t) {
    double ss = 0;
    for (int64_t c = 0; c < D; ++c) ss += double(res.f32()[t * D + c]) * res.f32()[t * D + c];
    const double inv = 1.0 / std::sqrt(ss / double(D) + eps);
    for (int64_t c = 0; c < D; ++c) v[size_t(t * D + c)] = w.f32()[c] * (res.f32()[t * D + c] * inv);
  }
  return v;
}

TEST_P(QuantNorm, AddRmsNormFp8MatchesReference) {
  auto rng = test::Rng::for_test();
  const float eps = 1e-5f, s = 3.0f / kE4m3Max;  // |normed| > 3 saturates: a few per row
  const std::pair<int64_t, int64_t> shapes[] = {{1, 2688}, {3, 4096},  {7, 33},   {8, 500},
                                                {9, 40},   {33, 2688}, {300, 64}, {2, 40000}};
  for (DType act : act_dtypes()) {
    for (const auto& [T, D] : shapes) {
      if (!on_cuda() && D > 4096) continue;  // the long-row kernel path exists on CUDA only
      SCOPED_TRACE(::testing::Message() << "T=" << T << " D=" << D << " act=" << dtype_name(act));
      const Tensor x = rounded(rng.normal_tensor({T, D}), act);
      const Tensor r0 = rounded(rng.normal_tensor({T, D}, 2.0f), act);
      const Tensor w = rounded(rng.uniform_tensor({D}, 0.5f, 1.5f), act);
      Tensor res = on_backend(r0, act);
      Tensor q = output(DType::kF8E4M3, {T, D});
      ops::add_rms_norm_fp8(ctx(), res, q, on_backend(x, act), on_backend(w, act), eps, s);
      // residual: the sum rounded to the activation dtype, as add_rms_norm stores it
      Tensor want_res = Tensor::empty(DType::kF32, {T, D});
      for (int64_t i = 0; i < x.numel(); ++i) want_res.f32()[i] = round_to(r0.f32()[i] + x.f32()[i], act);
      const Tensor got_res = host_f32(res);
      EXPECT_TRUE(test::bit_equal(got_res, want_res));
      expect_codes(bytes(q), add_norm_ref(got_res, w, eps), act, s);
      if (on_cuda()) {
        // bit for bit the unfused ops: add_rms_norm, then quantize_fp8 of its output
        Tensor res2 = on_backend(r0, act);
        Tensor normed = output(act, {T, D});
        ops::add_rms_norm(ctx(), res2, normed, on_backend(x, act), on_backend(w, act), eps);
        Tensor q2 = output(DType::kF8E4M3, {T, D});
        ops::quantize_fp8(ctx(), q2, normed, s);
        EXPECT_EQ(bytes(q), bytes(q2)) << "fused and unfused codes differ";
        EXPECT_EQ(bytes(res), bytes(res2)) << "fused and unfused residuals differ";
      }
    }
  }
}

TEST_P(QuantNorm, GatedRmsNormFp8MatchesReference) {
  auto rng = test::Rng::for_test();
  const float eps = 1e-5f, s = 2.0f / kE4m3Max;
  struct Case {
    int64_t T, D, G;
  };
  // Nano (Di 4096, 8 groups), Super (8192, 8), odd group sizes, one group longer than the register cache.
  const Case cases[] = {{1, 4096, 8},  {3, 8192, 8},  {7, 96, 3},   {9, 33, 1},
                        {33, 4096, 8}, {300, 120, 4}, {2, 40000, 1}};
  for (DType act : act_dtypes()) {
    for (const Case& c : cases) {
      if (!on_cuda() && c.D > 8192) continue;
      SCOPED_TRACE(::testing::Message() << "T=" << c.T << " D=" << c.D << " G=" << c.G << " act=" << dtype_name(act));
      const Tensor y = rounded(rng.normal_tensor({c.T, c.D}), act);
      const Tensor z = rounded(rng.normal_tensor({c.T, c.D}, 2.0f), act);
      const Tensor w = rounded(rng.uniform_tensor({c.D}, 0.5f, 1.5f), act);
      Tensor q = output(DType::kF8E4M3, {c.T, c.D});
      ops::gated_rms_norm_fp8(ctx(), q, on_backend(y, act), on_backend(z, act), on_backend(w, act), c.G, eps, s);
      // reference: u = y * silu(z) in double (not rounded), per-group RMSNorm
      const int64_t gs = c.D / c.G;
      std::vector<double> v(size_t(c.T * c.D));
      for (int64_t t = 0; t < c.T; ++t) {
        for (int64_t g = 0; g < c.G; ++g) {
          std::vector<double> u(static_cast<size_t>(gs));
          double ss = 0;
          for (int64_t k = 0; k < gs; ++k) {
            const int64_t i = t * c.D + g * gs + k;
            const double zz = z.f32()[i];
            u[size_t(k)] = y.f32()[i] * (zz / (1.0 + std::exp(-zz)));
            ss += u[size_t(k)] * u[size_t(k)];
          }
          const double inv = 1.0 / std::sqrt(ss / double(gs) + eps);
          for (int64_t k = 0; k < gs; ++k) v[size_t(t * c.D + g * gs + k)] = w.f32()[g * gs + k] * (u[size_t(k)] * inv);
        }
      }
      expect_codes(bytes(q), v, act, s);
      if (on_cuda()) {
        Tensor normed = output(act, {c.T, c.D});
        ops::gated_rms_norm(ctx(), normed, on_backend(y, act), on_backend(z, act), on_backend(w, act), c.G, eps);
        Tensor q2 = output(DType::kF8E4M3, {c.T, c.D});
        ops::quantize_fp8(ctx(), q2, normed, s);
        EXPECT_EQ(bytes(q), bytes(q2)) << "fused and unfused codes differ";
      }
    }
  }
}

// The decode chain's fused ops captured in a CUDA graph (the engine's decode step) and replayed: the eager bits.
TEST_P(QuantNorm, CapturedInAGraphGivesTheEagerBits) {
  if (!on_cuda()) GTEST_SKIP() << "CUDA graphs: CUDA only";
  auto rng = test::Rng::for_test();
  const int64_t T = 2, D = 2688, Di = 4096, G = 8;
  const float s = 3.0f / kE4m3Max;
  const Tensor x = on_backend(rng.normal_tensor({T, D}), DType::kBF16);
  const Tensor r0 = on_backend(rng.normal_tensor({T, D}), DType::kBF16);
  const Tensor w = on_backend(rng.uniform_tensor({D}, 0.5f, 1.5f), DType::kBF16);
  const Tensor y = on_backend(rng.normal_tensor({T, Di}), DType::kBF16);
  const Tensor z = on_backend(rng.normal_tensor({T, Di}), DType::kBF16);
  const Tensor gw = on_backend(rng.uniform_tensor({Di}, 0.5f, 1.5f), DType::kBF16);
  const device::Stream stream = device::Stream::create();
  const ops::Context c{Device::kCuda, stream.get()};
  const Tensor res = device::empty(Device::kCuda, DType::kBF16, {T, D});
  const Tensor q = device::empty(Device::kCuda, DType::kF8E4M3, {T, D});
  const Tensor qg = device::empty(Device::kCuda, DType::kF8E4M3, {T, Di});
  const Tensor qx = device::empty(Device::kCuda, DType::kF8E4M3, {T, D});
  auto body = [&] {
    ops::add_rms_norm_fp8(c, res, q, x, w, 1e-5f, s);
    ops::gated_rms_norm_fp8(c, qg, y, z, gw, G, 1e-5f, s);
    ops::quantize_fp8(c, qx, res, s);
  };
  device::copy(res, r0);
  body();
  stream.synchronize();
  const std::vector<uint8_t> e_res = bytes(res), e_q = bytes(q), e_qg = bytes(qg), e_qx = bytes(qx);
  device::AllocPool pool;
  device::Graph g;
  {
    const device::ScopedAllocPool scope(pool);
    g = device::Graph::capture(c.stream, body);
  }
  device::zero(q);
  device::zero(qg);
  device::zero(qx);
  device::copy(res, r0);
  g.launch(c.stream);
  stream.synchronize();
  EXPECT_EQ(bytes(res), e_res);
  EXPECT_EQ(bytes(q), e_q);
  EXPECT_EQ(bytes(qg), e_qg);
  EXPECT_EQ(bytes(qx), e_qx);
}

TEST_P(QuantNorm, BadArgumentsAreClearErrors) {
  const Tensor x = on_backend(Tensor::zeros(DType::kF32, {2, 8}));
  const Tensor w = on_backend(Tensor::zeros(DType::kF32, {8}));
  Tensor q = output(DType::kF8E4M3, {2, 8});
  Tensor bad_q = output(DType::kU8, {2, 8});
  EXPECT_TRUE(test::throws_error([&] { ops::quantize_fp8(ctx(), bad_q, x, 1.0f); }, ErrorKind::kRuntime, "out_q"));
  EXPECT_TRUE(test::throws_error([&] { ops::quantize_fp8(ctx(), q, x, 0.0f); }, ErrorKind::kRuntime, "input_scale"));
  Tensor res = on_backend(Tensor::zeros(DType::kF32, {2, 8}));
  const Tensor w7 = on_backend(Tensor::zeros(DType::kF32, {7}));
  EXPECT_TRUE(test::throws_error([&] { ops::add_rms_norm_fp8(ctx(), res, q, x, w7, 1e-5f, 1.0f); }, ErrorKind::kRuntime,
                                 "weight"));
  EXPECT_TRUE(test::throws_error([&] { ops::gated_rms_norm_fp8(ctx(), q, x, x, w, 3, 1e-5f, 1.0f); },
                                 ErrorKind::kRuntime, "n_groups"));
}

CHIMERA_INSTANTIATE_BACKENDS(QuantNorm);

}  // namespace
}  // namespace chimera
