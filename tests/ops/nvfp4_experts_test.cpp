// NVFP4 routed experts: the CPU reference (cpu::moe_experts_nvfp4) and the CUDA op (cuda::moe_experts_nvfp4: the
// grouped SIMT GEMV, the grouped tensor-core GEMV and the grouped dequantizing GEMM, each forced, and the automatic
// choice) against the same math in double precision: E = 5 experts, top-2, expert 3 never routed, T = 1 .. 300, F32,
// BF16 and F16 activations, D / I on and off the multiples of 64 (GEMM) and 32 (tensor-core GEMV). Every expert has
// its own weight_scale_2 (one quantizer per expert, as ModelOpt exports them).
//
// Tolerance per output element, derived along the computation (g_K = (2 (K + 1) + 4) 2^-24, the dense layer's fp32
// bound of nvfp4_linear_test.cpp, A_u[n] = sum_k |x W_up[n, k]|, u the exact up product):
//   du[n] = g_D A_u[n];  h = relu(u)^2, dh[n] = (2 relu(u[n]) + du[n]) du[n]  (+ 2^-8 (h + dh) with 16-bit
//   activations: h is rounded to bf16 / f16 before the down projection, as the bf16 grouped GEMM does)
//   dy[c] = sum_n |W_down[c, n]| dh[n] + g_I sum_n (h + dh)[n] |W_down[c, n]|
//   dout[c] = sum_j w_j (dy_j[c] + (k + 1) 2^-24 |y_j[c]|)  (+ 2^-8 |out| with 16-bit activations: the rounding of
//   the output; F16 rounds at 2^-11, within these bounds at the magnitudes here).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include <gtest/gtest.h>

#include "backends/cpu/nvfp4_experts.h"
#include "common/backend_param.h"
#include "common/compare.h"
#include "core/nvfp4.h"
#include "ops/quant_weights.h"

#ifdef CHIMERA_HAVE_CUDA
#include "backends/cuda/moe/nvfp4_experts.h"
#endif

namespace chimera {
namespace {

constexpr int64_t kExperts = 5, kTopK = 2, kUnrouted = 3;

// The E experts of one projection ([E, N, K] floats), each quantized on its own, in fused buffers on the host.
ops::ExpertWeights quantize_experts(const char* name, test::Rng& rng, int64_t N, int64_t K,
                                    std::vector<std::vector<float>>& dequantized) {
  ops::ExpertWeights w;
  w.format = ops::WeightFormat::kNvfp4;
  w.name = name;
  w.weight = Tensor::empty(DType::kU8, {kExperts, N, K / 2});
  w.weight_scale = Tensor::empty(DType::kF8E4M3, {kExperts, N, K / 16});
  w.scale = Tensor::empty(DType::kF32, {kExperts});
  dequantized.clear();
  for (int64_t e = 0; e < kExperts; ++e) {
    const Tensor wf = rng.normal_tensor({N, K}, 0.2f + 0.1f * static_cast<float>(e));
    const Nvfp4Weight q = quantize_nvfp4({wf.f32(), static_cast<size_t>(wf.numel())}, N, K);
    std::memcpy(static_cast<uint8_t*>(w.weight.data()) + e * N * (K / 2), q.packed.data(), q.packed.size());
    std::memcpy(static_cast<uint8_t*>(w.weight_scale.data()) + e * N * (K / 16), q.block_scale.data(),
                q.block_scale.size());
    w.scale.f32()[e] = q.weight_scale_2;
    w.host_scale.push_back(q.weight_scale_2);
    dequantized.push_back(dequantize_nvfp4(q));
  }
  return w;
}

struct Expected {
  std::vector<double> want, bound, bound16;
};

Expected reference(const Tensor& x, const std::vector<int32_t>& ids, const std::vector<float>& weights,
                   const std::vector<std::vector<float>>& wu, const std::vector<std::vector<float>>& wd, int64_t D,
                   int64_t I) {
  const int64_t T = x.dim(0);
  const double u24 = std::ldexp(1.0, -24), u8 = std::ldexp(1.0, -8);
  const double g_d = (2.0 * (D + 1) + 4.0) * u24, g_i = (2.0 * (I + 1) + 4.0) * u24;
  Expected r;
  r.want.assign(static_cast<size_t>(T * D), 0.0);
  r.bound.assign(r.want.size(), 1e-30);
  r.bound16.assign(r.want.size(), 1e-30);
  std::vector<double> h(static_cast<size_t>(I)), dh(static_cast<size_t>(I)), dh16(static_cast<size_t>(I));
  for (int64_t t = 0; t < T; ++t) {
    const float* xt = x.f32() + t * D;
    for (int64_t j = 0; j < kTopK; ++j) {
      const size_t e = static_cast<size_t>(ids[static_cast<size_t>(t * kTopK + j)]);
      const double wj = weights[static_cast<size_t>(t * kTopK + j)];
      for (int64_t n = 0; n < I; ++n) {
        double u = 0.0, a = 0.0;
        for (int64_t k = 0; k < D; ++k) {
          const double p = static_cast<double>(xt[k]) * wu[e][static_cast<size_t>(n * D + k)];
          u += p;
          a += std::fabs(p);
        }
        const double du = g_d * a, ru = std::max(u, 0.0);
        h[static_cast<size_t>(n)] = ru * ru;
        dh[static_cast<size_t>(n)] = (2.0 * ru + du) * du;
        dh16[static_cast<size_t>(n)] = dh[static_cast<size_t>(n)] + u8 * (ru * ru + dh[static_cast<size_t>(n)]);
      }
      for (int64_t c = 0; c < D; ++c) {
        double y = 0.0, dy = 0.0, dy16 = 0.0;
        for (int64_t n = 0; n < I; ++n) {
          const double wv = std::fabs(wd[e][static_cast<size_t>(c * I + n)]);
          const size_t ni = static_cast<size_t>(n);
          y += h[ni] * wd[e][static_cast<size_t>(c * I + n)];
          dy += wv * dh[ni] + g_i * (h[ni] + dh[ni]) * wv;
          dy16 += wv * dh16[ni] + g_i * (h[ni] + dh16[ni]) * wv;
        }
        const size_t i = static_cast<size_t>(t * D + c);
        r.want[i] += wj * y;
        r.bound[i] += std::fabs(wj) * (dy + (kTopK + 1) * u24 * std::fabs(y));
        r.bound16[i] += std::fabs(wj) * (dy16 + (kTopK + 1) * u24 * std::fabs(y));
      }
    }
  }
  for (size_t i = 0; i < r.want.size(); ++i) r.bound16[i] += u8 * (std::fabs(r.want[i]) + r.bound16[i]);
  return r;
}

void check_close(const Tensor& got, const std::vector<double>& want, const std::vector<double>& bound,
                 const char* what) {
  EXPECT_TRUE(test::within_bounds(got, want, bound)) << what;
}

class Nvfp4Experts : public test::BackendTest {};

TEST_P(Nvfp4Experts, AgainstDoubleReference) {
  struct Dims {
    int64_t D, I;
  };
  test::Rng rng = test::Rng::for_test();
  for (const Dims dims : {Dims{128, 192}, Dims{96, 160}, Dims{48, 80}}) {
    const auto [D, I] = dims;
    std::vector<std::vector<float>> wu, wd;
    const ops::ExpertWeights up = quantize_experts("test.experts.{e}.up_proj", rng, I, D, wu);
    const ops::ExpertWeights down = quantize_experts("test.experts.{e}.down_proj", rng, D, I, wd);
    for (int64_t T : {1, 2, 7, 8, 9, 64, 300}) {
      // Two distinct experts per token out of {0, 1, 2, 4}; routing weights in [0.1, 1).
      std::vector<int32_t> ids(static_cast<size_t>(T * kTopK));
      std::vector<float> weights(ids.size());
      const Tensor pick = rng.uniform_tensor({T, 2}, 0.0f, 4.0f);
      const Tensor wr = rng.uniform_tensor({T, kTopK}, 0.1f, 1.0f);
      for (int64_t t = 0; t < T; ++t) {
        int a = std::min(3, static_cast<int>(pick.f32()[2 * t]));
        int b = std::min(2, static_cast<int>(pick.f32()[2 * t + 1] * 0.75f));
        if (b >= a) ++b;  // distinct from a, in [0, 4)
        const auto expert = [](int v) { return v >= kUnrouted ? v + 1 : v; };
        ids[static_cast<size_t>(2 * t)] = expert(a);
        ids[static_cast<size_t>(2 * t + 1)] = expert(b);
        weights[static_cast<size_t>(2 * t)] = wr.f32()[2 * t];
        weights[static_cast<size_t>(2 * t + 1)] = wr.f32()[2 * t + 1];
      }
      const Tensor ids_t = Tensor::from_i32({T, kTopK}, ids);
      const Tensor w_t = Tensor::from_f32({T, kTopK}, weights);
      const Tensor x32 = rng.normal_tensor({T, D}, 1.0f);
      for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
        SCOPED_TRACE(fmt::format("D {} I {} T {} {}", D, I, T, dtype_name(dt)));
        const Tensor x = test::cast_to(x32, dt).to_f32();
        const Expected ex = reference(x, ids, weights, wu, wd, D, I);
        if (!on_cuda()) {
          if (dt != DType::kF32) continue;
          Tensor out = output(DType::kF32, {T, D});
          cpu::moe_experts_nvfp4(out, x, ids_t, w_t, up, down);
          check_close(out, ex.want, ex.bound, "cpu");
          continue;
        }
#ifdef CHIMERA_HAVE_CUDA
        ops::ExpertWeights upd = up, downd = down;
        for (ops::ExpertWeights* w : {&upd, &downd}) {
          w->weight = on_backend(w->weight);
          w->weight_scale = on_backend(w->weight_scale);
          w->scale = on_backend(w->scale);
        }
        const Tensor xd = on_backend(x, dt), idd = on_backend(ids_t), wdv = on_backend(w_t);
        using P = cuda::Nvfp4ExpertsPath;
        for (P path : {P::kAuto, P::kGemv, P::kGemvTc, P::kGemm}) {
          if (path == P::kGemm && !(dt != DType::kF32 && D % 64 == 0 && I % 64 == 0)) continue;
          if (path == P::kGemvTc && !(dt != DType::kF32 && D % 32 == 0 && I % 32 == 0)) continue;
          Tensor out = output(dt, {T, D});
          cuda::moe_experts_nvfp4_on_path(ctx(), out, xd, idd, wdv, upd, downd, path);
          check_close(out, ex.want, dt == DType::kF32 ? ex.bound : ex.bound16,
                      path == P::kAuto     ? "auto"
                      : path == P::kGemv   ? "gemv"
                      : path == P::kGemvTc ? "gemv-tc"
                                           : "gemm");
        }
#endif
      }
    }
  }
}

TEST_P(Nvfp4Experts, BadWeightsNameTheTensor) {
  if (on_cuda()) GTEST_SKIP() << "the CPU reference's checks";
  test::Rng rng = test::Rng::for_test();
  std::vector<std::vector<float>> wu, wd;
  const ops::ExpertWeights up = quantize_experts("backbone.layers.1.mixer.experts.{e}.up_proj", rng, 32, 16, wu);
  ops::ExpertWeights down = quantize_experts("backbone.layers.1.mixer.experts.{e}.down_proj", rng, 16, 32, wd);
  down.weight_scale = Tensor::zeros(DType::kF8E4M3, {kExperts, 16, 3});
  const Tensor x = Tensor::zeros(DType::kF32, {1, 16});
  Tensor out = Tensor::empty(DType::kF32, {1, 16});
  const Tensor ids = Tensor::from_i32({1, 2}, std::vector<int32_t>{0, 1});
  const Tensor w = Tensor::from_f32({1, 2}, std::vector<float>{0.5f, 0.5f});
  EXPECT_TRUE(test::throws_error([&] { cpu::moe_experts_nvfp4(out, x, ids, w, up, down); }, ErrorKind::kInvalidInput,
                                 "backbone.layers.1.mixer.experts.{e}.down_proj.weight_scale"));
}

CHIMERA_INSTANTIATE_BACKENDS(Nvfp4Experts);

}  // namespace
}  // namespace chimera
