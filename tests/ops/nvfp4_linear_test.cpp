// NVFP4 dense layers: the CPU reference (cpu::nvfp4_linear) and the CUDA kernels (cuda::nvfp4_linear: the SIMT GEMV,
// the tensor-core GEMV and the dequantizing mma.sync GEMM, each forced, and the automatic choice) against a
// dequantize-then-matmul in double precision, on awkward sizes (odd N, K = 16 / 48 / 192 / 2688, T = 1 .. 300) with
// F32, BF16 and F16 activations.
//
// Tolerance per output element, A = sum_k |x[k] W[n, k]| (+ |bias|), exact products in double:
//   fp32 accumulation: (2 (K + 1) + 4) 2^-24 A. The 2 (K + 1) 2^-24 A term is the fp32 summation bound (gamma_K of
//   any summation order: lanes, blocks, warps, MMA k-steps); the 4 more units cover the weights: the CPU multiplies
//   e2m1 by the fp32-rounded e4m3 x weight_scale_2 (two roundings, 2^-23 relative), CUDA sums x * (e2m1 x e4m3)
//   (exact products) and multiplies by weight_scale_2 once (2^-24).
//   16-bit output: + 2^-8 |want| (one rounding to bf16, 2^-9 relative, with a factor two for the fp32 error around
//   it; F16's rounding, 2^-11, is within it: the values here are far from its range limits).
// x (and the bias) are rounded to the activation dtype on the host first, so the reference sees the same inputs.
#include <cmath>
#include <cstring>
#include <vector>

#include <gtest/gtest.h>

#include "backends/cpu/quant_ops.h"
#include "common/backend_param.h"
#include "common/compare.h"
#include "core/nvfp4.h"
#include "ops/quant_weights.h"

#ifdef CHIMERA_HAVE_CUDA
#include "backends/cuda/gemm/nvfp4_linear.h"
#endif

namespace chimera {
namespace {

Tensor bytes_tensor(DType t, Shape shape, const std::vector<uint8_t>& bytes) {
  Tensor r = Tensor::empty(t, std::move(shape));
  EXPECT_EQ(r.nbytes(), bytes.size());
  std::memcpy(r.data(), bytes.data(), bytes.size());
  return r;
}

// The host F32 tensor rounded to `dtype` and back.
Tensor rounded(const Tensor& f32, DType dtype) {
  return test::cast_to(f32, dtype).to_f32();
}

struct Case {
  int64_t T, K, N;
  bool bias;
};

void check_close(const Tensor& got, const std::vector<double>& want, const std::vector<double>& bound,
                 const char* what) {
  EXPECT_TRUE(test::within_bounds(got, want, bound)) << what;
}

class Nvfp4Linear : public test::BackendTest {};

TEST_P(Nvfp4Linear, AwkwardSizesAgainstDoubleReference) {
  const Case cases[] = {{1, 16, 37, false},    {2, 48, 37, true},     {7, 16, 129, false}, {8, 48, 129, true},
                        {9, 192, 37, true},    {64, 192, 129, false}, {300, 48, 37, true}, {1, 2688, 129, true},
                        {2, 2688, 37, false},  {7, 2688, 129, false}, {8, 2688, 37, true}, {9, 2688, 129, true},
                        {64, 2688, 37, false}, {300, 2688, 129, true}};
  test::Rng rng = test::Rng::for_test();
  for (const Case& c : cases) {
    const auto [T, K, N, with_bias] = c;
    const Tensor wf = rng.normal_tensor({N, K}, 0.3f);
    const Tensor x32 = rng.normal_tensor({T, K}, 2.0f);
    const Tensor b32 = rng.normal_tensor({N}, 1.0f);
    const Nvfp4Weight q = quantize_nvfp4({wf.f32(), static_cast<size_t>(wf.numel())}, N, K);
    const std::vector<float> w = dequantize_nvfp4(q);
    const Tensor packed = bytes_tensor(DType::kU8, {N, K / 2}, q.packed);
    const Tensor scales = bytes_tensor(DType::kF8E4M3, {N, K / 16}, q.block_scale);
    for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
      SCOPED_TRACE(fmt::format("T {} K {} N {} bias {} {}", T, K, N, with_bias, dtype_name(dt)));
      const Tensor x = rounded(x32, dt);
      const Tensor b = rounded(b32, dt);
      std::vector<double> want(static_cast<size_t>(T * N)), bound(want.size()), bound16(want.size());
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t n = 0; n < N; ++n) {
          double s = with_bias ? b.f32()[n] : 0.0, a = with_bias ? std::fabs(b.f32()[n]) : 0.0;
          for (int64_t k = 0; k < K; ++k) {
            const double p = static_cast<double>(x.f32()[t * K + k]) * w[static_cast<size_t>(n * K + k)];
            s += p;
            a += std::fabs(p);
          }
          const size_t i = static_cast<size_t>(t * N + n);
          want[i] = s;
          bound[i] = (2.0 * (K + 1) + 4.0) * std::ldexp(1.0, -24) * a + 1e-30;
          bound16[i] = bound[i] + std::ldexp(1.0, -8) * std::fabs(s);
        }
      }
      if (!on_cuda()) {
        if (dt != DType::kF32) continue;  // the CPU reference computes in fp32 (the rounded inputs: same case)
        Tensor out = output(DType::kF32, {T, N});
        cpu::nvfp4_linear(out, x, packed, scales, q.weight_scale_2, with_bias ? b : Tensor());
        check_close(out, want, bound, "cpu");
        continue;
      }
#ifdef CHIMERA_HAVE_CUDA
      ops::LinearWeight lw;
      lw.format = ops::WeightFormat::kNvfp4;
      lw.name = "test.linear";
      lw.weight = on_backend(packed);
      lw.weight_scale = on_backend(scales);
      lw.scale = q.weight_scale_2;
      const Tensor xd = on_backend(x, dt);
      const Tensor bd = with_bias ? on_backend(b, dt) : Tensor();
      using P = cuda::Nvfp4Path;
      for (P path : {P::kAuto, P::kGemv, P::kGemvTc, P::kGemm}) {
        if (path == P::kGemm && !cuda::nvfp4_gemm_supported(dt, K)) continue;
        if (path == P::kGemvTc && !cuda::nvfp4_gemv_tc_supported(dt, K)) continue;
        Tensor out = output(dt, {T, N});
        cuda::nvfp4_linear_on_path(ctx(), out, xd, lw, bd, path);
        check_close(out, want, dt == DType::kF32 ? bound : bound16,
                    path == P::kAuto     ? "auto"
                    : path == P::kGemv   ? "gemv"
                    : path == P::kGemvTc ? "gemv-tc"
                                         : "gemm");
      }
#endif
    }
  }
}

TEST_P(Nvfp4Linear, BadArgumentsNameTheTensor) {
  if (!on_cuda()) GTEST_SKIP() << "the CUDA entry point's checks";
#ifdef CHIMERA_HAVE_CUDA
  ops::LinearWeight lw;
  lw.format = ops::WeightFormat::kNvfp4;
  lw.name = "backbone.layers.0.mixer.in_proj";
  lw.weight = device::empty(Device::kCuda, DType::kU8, {8, 16});
  lw.weight_scale = device::empty(Device::kCuda, DType::kF8E4M3, {8, 3});
  lw.scale = 1.0f;
  const Tensor x = device::empty(Device::kCuda, DType::kBF16, {2, 32});
  const Tensor out = device::empty(Device::kCuda, DType::kBF16, {2, 8});
  EXPECT_TRUE(test::throws_error([&] { cuda::nvfp4_linear(ctx(), out, x, lw, Tensor()); }, ErrorKind::kRuntime,
                                 "backbone.layers.0.mixer.in_proj.weight_scale"));
  lw.weight_scale = device::empty(Device::kCuda, DType::kF8E4M3, {8, 2});
  EXPECT_TRUE(
      test::throws_error([&] { cuda::nvfp4_linear_on_path(ctx(), out, x, lw, Tensor(), cuda::Nvfp4Path::kGemm); },
                         ErrorKind::kRuntime, "GEMM path"));
  lw.format = ops::WeightFormat::kFp8;
  EXPECT_TRUE(
      test::throws_error([&] { cuda::nvfp4_linear(ctx(), out, x, lw, Tensor()); }, ErrorKind::kRuntime, "not nvfp4"));
#endif
}

CHIMERA_INSTANTIATE_BACKENDS(Nvfp4Linear);

}  // namespace
}  // namespace chimera
