// The CUDA FP8 dense layer (backends/cuda/gemm/fp8_linear.h) against a double-precision reference built from
// core/fp8.h (the dequantized weight and, for W8A8, the fake-quantized activation with the static or the dynamic
// per-tensor scale: bit-exact against torch / ModelOpt in tests/core), on every path (the decode GEMV, cuBLASLt's FP8 GEMM, the dequantized fallback) and on
// awkward sizes: T = 1, 3, 7, 8, 9, 33, 300; K a multiple of 16 and not (40); N odd, a multiple of 8 only (24: the
// GEMM's N % 16 rule sends it to the fallback) and of 16; BF16, F16 and
// F32 activations; with and without bias; x quantized inside (fp8_linear) and prequantized (fp8_linear_prequant).
// The quantized activation has no flips to allow for: the kernel and the reference divide the same values
// correctly rounded and round to e4m3 the same way (quantize_fp8 is checked bit for bit in tests/ops/quant_norm_test).
//
// Bounds per output (derived, not tuned): with S = sum_k |x'_k w_k| (+ |b|),
//   GEMV / dequantized:  2 (K + 4) 2^-24 S          fp32 accumulation (gamma_K) and the scale products
//   FP8 GEMM, tensor-core GEMV:  kFp8GemmAccumRel S the tensor cores' accumulator, promoted to fp32 (tolerances.h)
// plus the output's rounding: 2^-8 |want| for BF16, 2^-11 for F16, 0 for F32.
// Also: CUDA-graph capture of the decode GEMV and of the GEMM gives the eager bits, and bad arguments are errors.
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "backends/device_api.h"
#include "common/backend_param.h"
#include "common/compare.h"
#include "core/fp8.h"
#ifdef CHIMERA_HAVE_CUDA
#include "backends/cuda/gemm/fp8_linear.h"
#endif

namespace chimera {
namespace {

#ifndef CHIMERA_HAVE_CUDA
TEST(CudaFp8Linear, NeedsTheCudaBackend) {
  GTEST_SKIP() << "this build of chimera has no CUDA backend";
}
#else

using cuda::Fp8LinearPath;

// A quantized layer: the device weight and the host copies the reference needs.
struct Layer {
  ops::LinearWeight w;
  std::vector<float> deq;  // [N, K] e4m3(weight) * scale
};

Layer make_layer(test::Rng& rng, int64_t N, int64_t K, ops::ActQuant act, float input_scale) {
  const Tensor wf = rng.normal_tensor({N, K}, 0.05f);
  const Fp8Weight q = quantize_fp8_per_tensor({wf.f32(), static_cast<size_t>(wf.numel())});
  Tensor host = Tensor::empty(DType::kF8E4M3, {N, K});
  std::memcpy(host.data(), q.data.data(), q.data.size());
  Layer l;
  l.w.format = ops::WeightFormat::kFp8;
  l.w.act = act;
  l.w.name = "test.fp8_proj";
  l.w.weight = device::to_device(host, Device::kCuda);
  l.w.scale = q.weight_scale;
  l.w.input_scale = act == ops::ActQuant::kStatic ? input_scale : 0.0f;
  l.deq.resize(q.data.size());
  dequantize_fp8(q.data, q.weight_scale, l.deq);
  return l;
}

// Fills a device output with 0xff bytes (NaN in every float dtype) so unwritten elements show.
void poison(const Tensor& t) {
  Tensor h = Tensor::empty(t.dtype(), t.shape());
  std::memset(h.data(), 0xff, h.nbytes());
  device::copy(t, h);
}

float round_to(float v, DType act) {
  if (act == DType::kBF16) return bf16_to_f32(f32_to_bf16(v));
  if (act == DType::kF16) return f16_to_f32(f32_to_f16(v));
  return v;
}

// x' as the layer defines it, from the activation x as stored (already rounded to its dtype).
std::vector<float> act_ref(const Tensor& x, const ops::LinearWeight& w) {
  std::vector<float> v(x.f32(), x.f32() + x.numel());
  if (w.act == ops::ActQuant::kStatic) fake_quantize_fp8(v, w.input_scale);
  if (w.act == ops::ActQuant::kDynamic) fake_quantize_fp8_dynamic(v);
  return v;
}

struct Want {
  std::vector<double> y, abs_sum;
};

Want reference(const std::vector<float>& xq, const Layer& l, const Tensor& bias, int64_t T, int64_t K, int64_t N) {
  Want r;
  r.y.assign(size_t(T * N), 0.0);
  r.abs_sum.assign(size_t(T * N), 0.0);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t n = 0; n < N; ++n) {
      double s = bias ? bias.f32()[n] : 0.0, a = bias ? std::fabs(bias.f32()[n]) : 0.0;
      for (int64_t k = 0; k < K; ++k) {
        const double p = double(xq[size_t(t * K + k)]) * l.deq[size_t(n * K + k)];
        s += p;
        a += std::fabs(p);
      }
      r.y[size_t(t * N + n)] = s;
      r.abs_sum[size_t(t * N + n)] = a;
    }
  }
  return r;
}

void expect_within(const Tensor& got_dev, const Want& want, DType act, Fp8LinearPath path, int64_t K) {
  const Tensor got = device::to_host_f32(got_dev);
  const bool tensor_cores = path == Fp8LinearPath::kGemm || path == Fp8LinearPath::kGemvMma;
  const double accum = tensor_cores ? test::kFp8GemmAccumRel : 2.0 * double(K + 4) * std::ldexp(1.0, -24);
  const double out_rel = act == DType::kBF16 ? std::ldexp(1.0, -8) : act == DType::kF16 ? std::ldexp(1.0, -11) : 0.0;
  int64_t worst = -1;
  double worst_ratio = 0.0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double bound =
        accum * want.abs_sum[size_t(i)] * (1.0 + out_rel) + out_rel * std::fabs(want.y[size_t(i)]) + 1e-30;
    const double err = std::fabs(double(got.f32()[i]) - want.y[size_t(i)]);
    const double ratio = std::isnan(got.f32()[i]) ? INFINITY : err / bound;
    if (worst < 0 || ratio > worst_ratio) worst_ratio = ratio, worst = i;
  }
  EXPECT_LE(worst_ratio, 1.0) << "path " << cuda::fp8_linear_path_name(path) << ", worst element " << worst << ": got "
                              << got.f32()[worst] << ", want " << want.y[size_t(worst)];
}

struct Size {
  int64_t T, K, N;
};

class CudaFp8Linear : public ::testing::TestWithParam<Size> {
 protected:
  void SetUp() override {
    if (!device::cuda_available()) GTEST_SKIP() << device::describe_cuda();
  }
};

std::vector<Fp8LinearPath> paths_for(const Size& s, ops::ActQuant act, DType dtype) {
  std::vector<Fp8LinearPath> p{Fp8LinearPath::kAuto, Fp8LinearPath::kDequant};
  if (s.T <= cuda::kFp8GemvMaxTokens && s.K % 16 == 0) {
    p.push_back(Fp8LinearPath::kGemv);
    if (act != ops::ActQuant::kNone) p.push_back(Fp8LinearPath::kGemvMma);
  }
  if (act != ops::ActQuant::kNone && dtype != DType::kF32 && s.K % 16 == 0 && s.N % 16 == 0) {
    p.push_back(Fp8LinearPath::kGemm);
  }
  return p;
}

TEST_P(CudaFp8Linear, EveryPathMatchesTheReference) {
  const Size sz = GetParam();
  const auto [T, K, N] = sz;
  test::Rng rng = test::Rng::for_test();
  const ops::Context ctx{Device::kCuda, nullptr};
  const float input_scale = 2.5f / kE4m3Max;  // x ~ N(0, 1): |x| > 2.5 saturates, about 1 %
  for (const ops::ActQuant act : {ops::ActQuant::kNone, ops::ActQuant::kStatic, ops::ActQuant::kDynamic}) {
    const Layer l = make_layer(rng, N, K, act, input_scale);
    for (const DType dtype : {DType::kBF16, DType::kF16, DType::kF32}) {
      for (const bool with_bias : {false, true}) {
        if (dtype == DType::kF16 && with_bias) continue;  // F16 is covered once; bias with the others
        SCOPED_TRACE(::testing::Message() << ops::act_quant_name(act) << " " << dtype_name(dtype)
                                          << (with_bias ? " +bias" : ""));
        Tensor x32 = rng.normal_tensor({T, K});
        for (int64_t i = 0; i < x32.numel(); ++i) x32.f32()[i] = round_to(x32.f32()[i], dtype);
        Tensor b32;
        if (with_bias) {
          b32 = rng.normal_tensor({N}, 0.5f);
          for (int64_t i = 0; i < N; ++i) b32.f32()[i] = round_to(b32.f32()[i], dtype);
        }
        const Want want = reference(act_ref(x32, l.w), l, b32, T, K, N);
        const Tensor x = device::to_device(x32, Device::kCuda, dtype);
        const Tensor bias = with_bias ? device::to_device(b32, Device::kCuda, dtype) : Tensor();
        const Tensor out = device::empty(Device::kCuda, dtype, {T, N});
        for (const Fp8LinearPath path : paths_for(sz, act, dtype)) {
          SCOPED_TRACE(cuda::fp8_linear_path_name(path));
          poison(out);
          cuda::fp8_linear_with_path(ctx, out, x, l.w, bias, path);
          const Fp8LinearPath ran = path == Fp8LinearPath::kAuto ? cuda::fp8_linear_path(out, x, l.w, bias) : path;
          expect_within(out, want, dtype, ran, K);
        }
        if (act != ops::ActQuant::kStatic) continue;
        // prequantized: quantize_fp8 then fp8_linear_prequant (the fused norm kernels' consumer)
        const Tensor xq = device::empty(Device::kCuda, DType::kF8E4M3, {T, K});
        cuda::quantize_fp8(ctx, xq, x, input_scale);
        for (const Fp8LinearPath path : paths_for(sz, act, dtype)) {
          SCOPED_TRACE(std::string("prequant ") + cuda::fp8_linear_path_name(path));
          poison(out);
          cuda::fp8_linear_prequant_with_path(ctx, out, xq, l.w, bias, path);
          const Fp8LinearPath ran = path == Fp8LinearPath::kAuto ? cuda::fp8_linear_path(out, xq, l.w, bias) : path;
          expect_within(out, want, dtype, ran, K);
        }
      }
    }
  }
}

// Decode sizes take the GEMV, prefill sizes the FP8 GEMM (W8A8, 16-bit), the rest the fallback.
TEST_P(CudaFp8Linear, AutoPathIsTheExpectedOne) {
  const auto [T, K, N] = GetParam();
  test::Rng rng = test::Rng::for_test();
  const Layer l = make_layer(rng, N, K, ops::ActQuant::kStatic, 0.01f);
  const Tensor x = device::empty(Device::kCuda, DType::kBF16, {T, K});
  const Tensor out = device::empty(Device::kCuda, DType::kBF16, {T, N});
  const bool gemv = T <= cuda::kFp8GemvMaxTokens && K % 16 == 0;
  const Fp8LinearPath want = gemv && T >= cuda::kFp8GemvMmaMinTokens ? Fp8LinearPath::kGemvMma
                             : gemv                                  ? Fp8LinearPath::kGemv
                             : K % 16 == 0 && N % 16 == 0            ? Fp8LinearPath::kGemm
                                                                     : Fp8LinearPath::kDequant;
  EXPECT_EQ(cuda::fp8_linear_path(out, x, l.w, Tensor()), want);
  ops::LinearWeight dyn = l.w;  // dynamic scales take the same paths
  dyn.act = ops::ActQuant::kDynamic;
  dyn.input_scale = 0.0f;
  EXPECT_EQ(cuda::fp8_linear_path(out, x, dyn, Tensor()), want);
  // weight-only never takes the tensor-core GEMV (x is not e4m3)
  ops::LinearWeight wo = l.w;
  wo.act = ops::ActQuant::kNone;
  EXPECT_NE(cuda::fp8_linear_path(out, x, wo, Tensor()), Fp8LinearPath::kGemvMma);
}

INSTANTIATE_TEST_SUITE_P(, CudaFp8Linear,
                         ::testing::Values(Size{1, 64, 32}, Size{3, 48, 17}, Size{7, 2688, 80}, Size{8, 4096, 48},
                                           Size{9, 64, 32}, Size{33, 2688, 80}, Size{300, 48, 17}, Size{300, 4096, 48},
                                           Size{1, 40, 8}, Size{9, 40, 9}, Size{1, 8192, 16}, Size{33, 64, 24}),
                         [](const ::testing::TestParamInfo<Size>& p) {
                           return "T" + std::to_string(p.param.T) + "_K" + std::to_string(p.param.K) + "_N" +
                                  std::to_string(p.param.N);
                         });

std::vector<uint8_t> host_bytes(const Tensor& t) {
  const Tensor h = device::to_host(t);
  const auto* p = static_cast<const uint8_t*>(h.data());
  return {p, p + h.nbytes()};
}

// The decode GEMVs (T = 1: CUDA cores; T = 8: tensor cores) and the FP8 GEMM (T = 64), static and dynamic
// activation scales, captured in a CUDA graph: the eager bits (no allocation or upload is captured that a replay would miss; the GEMM's quantized x comes from the
// graph's pool).
TEST(CudaFp8LinearGraph, CapturedGivesTheEagerBits) {
  if (!device::cuda_available()) GTEST_SKIP() << device::describe_cuda();
  test::Rng rng = test::Rng::for_test();
  const int64_t K = 2688, N = 1040;
  const float input_scale = 2.5f / kE4m3Max;
  const Layer l = make_layer(rng, N, K, ops::ActQuant::kStatic, input_scale);
  const Layer ld = make_layer(rng, N, K, ops::ActQuant::kDynamic, 0.0f);
  for (const int64_t T : {int64_t{1}, int64_t{8}, int64_t{64}}) {
    SCOPED_TRACE(::testing::Message() << "T=" << T);
    const Tensor x = device::to_device(rng.normal_tensor({T, K}), Device::kCuda, DType::kBF16);
    const Tensor xq = device::empty(Device::kCuda, DType::kF8E4M3, {T, K});
    const Tensor y = device::empty(Device::kCuda, DType::kBF16, {T, N});
    const Tensor yp = device::empty(Device::kCuda, DType::kBF16, {T, N});
    const Tensor yd = device::empty(Device::kCuda, DType::kBF16, {T, N});  // the dynamic-scale layer
    const device::Stream stream = device::Stream::create();
    const ops::Context c{Device::kCuda, stream.get()};
    auto body = [&] {
      cuda::fp8_linear(c, y, x, l.w, Tensor());
      cuda::quantize_fp8(c, xq, x, input_scale);
      cuda::fp8_linear_prequant(c, yp, xq, l.w, Tensor());
      cuda::fp8_linear(c, yd, x, ld.w, Tensor());
    };
    body();
    stream.synchronize();
    const std::vector<uint8_t> ey = host_bytes(y), eyp = host_bytes(yp), eyd = host_bytes(yd);
    EXPECT_EQ(ey, eyp) << "fp8_linear and quantize + fp8_linear_prequant differ";
    device::AllocPool pool;
    device::Graph g;
    {
      const device::ScopedAllocPool scope(pool);
      g = device::Graph::capture(c.stream, body);
    }
    poison(y);
    poison(yp);
    poison(yd);
    g.launch(c.stream);
    stream.synchronize();
    EXPECT_EQ(host_bytes(y), ey);
    EXPECT_EQ(host_bytes(yp), eyp);
    EXPECT_EQ(host_bytes(yd), eyd);
  }
}

TEST(CudaFp8LinearErrors, BadArgumentsNameTheRule) {
  if (!device::cuda_available()) GTEST_SKIP() << device::describe_cuda();
  test::Rng rng = test::Rng::for_test();
  const ops::Context ctx{Device::kCuda, nullptr};
  Layer l = make_layer(rng, 16, 32, ops::ActQuant::kNone, 0.0f);
  const Tensor x = device::empty(Device::kCuda, DType::kBF16, {9, 32});
  const Tensor out = device::empty(Device::kCuda, DType::kBF16, {9, 16});
  EXPECT_TRUE(test::throws_error([&] { cuda::fp8_linear_with_path(ctx, out, x, l.w, Tensor(), Fp8LinearPath::kGemv); },
                                 ErrorKind::kRuntime, "GEMV"));
  EXPECT_TRUE(test::throws_error([&] { cuda::fp8_linear_with_path(ctx, out, x, l.w, Tensor(), Fp8LinearPath::kGemm); },
                                 ErrorKind::kRuntime, "kStatic"));
  const Tensor x1 = device::empty(Device::kCuda, DType::kBF16, {1, 32});
  const Tensor out1 = device::empty(Device::kCuda, DType::kBF16, {1, 16});
  EXPECT_TRUE(
      test::throws_error([&] { cuda::fp8_linear_with_path(ctx, out1, x1, l.w, Tensor(), Fp8LinearPath::kGemvMma); },
                         ErrorKind::kRuntime, "tensor-core"));
  const Tensor xq = device::empty(Device::kCuda, DType::kF8E4M3, {9, 32});
  EXPECT_TRUE(test::throws_error([&] { cuda::fp8_linear_prequant(ctx, out, xq, l.w, Tensor()); }, ErrorKind::kRuntime,
                                 "ActQuant::kStatic"));
  const Tensor x16 = device::empty(Device::kCuda, DType::kF16, {9, 32});
  EXPECT_TRUE(test::throws_error([&] { cuda::fp8_linear(ctx, out, x16, l.w, Tensor()); }, ErrorKind::kRuntime,
                                 "test.fp8_proj"));
  l.w.format = ops::WeightFormat::kDense;
  EXPECT_TRUE(
      test::throws_error([&] { cuda::fp8_linear(ctx, out, x, l.w, Tensor()); }, ErrorKind::kRuntime, "FP8 F8_E4M3"));
}

#endif  // CHIMERA_HAVE_CUDA

}  // namespace
}  // namespace chimera
