// Quantized linear layers on the CPU (backends/cpu/quant_ops.h): each block of weight rows is dequantized to fp32
// exactly as core/fp8.h and core/nvfp4.h define it, then multiplied like linear.cpp (fp32, fixed lane order).
#include <algorithm>
#include <vector>

#include "backends/cpu/cpu_common.h"
#include "backends/cpu/quant_ops.h"
#include "core/fp8.h"
#include "core/nvfp4.h"
#include "core/parallel.h"

namespace chimera::cpu {
namespace {

constexpr int64_t kRowBlock = 4;

// y [T, N] = x [T, K] @ W^T (+ bias), with W's rows r0 .. r0 + n produced by dequant(r0, n, dst [n, K]).
template <typename Dequant>
void linear_dequant(const float* x, int64_t T, int64_t K, int64_t N, const float* bias, float* y, Dequant&& dequant) {
  if (T == 0 || N == 0) return;
  const int64_t n_blocks = (N + kRowBlock - 1) / kRowBlock;
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, kRowBlock * T * K));
  parallel_for(n_blocks, grain, [&](int64_t b0, int64_t b1) {
    std::vector<float> w(static_cast<size_t>(kRowBlock * K));
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t o0 = b * kRowBlock;
      const int64_t nr = std::min(kRowBlock, N - o0);
      dequant(o0, nr, w.data());
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t j = 0; j < nr; ++j) {
          const float r = dot_f32(x + t * K, w.data() + j * K, K);
          y[t * N + o0 + j] = bias ? r + bias[o0 + j] : r;
        }
      }
    }
  });
}

}  // namespace

void fp8_linear(const Tensor& out, const Tensor& x, const Tensor& weight, float weight_scale, const Tensor& bias) {
  const int64_t K = x.dim(1), N = weight.dim(0);
  std::vector<float> b;
  if (bias) b = to_f32_vector(bias);
  const auto* q = static_cast<const uint8_t*>(weight.data());
  linear_dequant(x.f32(), x.dim(0), K, N, bias ? b.data() : nullptr, out.f32(), [&](int64_t r0, int64_t n, float* dst) {
    for (int64_t i = 0; i < n * K; ++i) dst[i] = e4m3_to_f32(q[r0 * K + i]) * weight_scale;
  });
}

void nvfp4_linear(const Tensor& out, const Tensor& x, const Tensor& weight, const Tensor& weight_scale,
                  float weight_scale_2, const Tensor& bias) {
  const int64_t K = x.dim(1), N = weight.dim(0);
  std::vector<float> b;
  if (bias) b = to_f32_vector(bias);
  const auto* packed = static_cast<const uint8_t*>(weight.data());
  const auto* scales = static_cast<const uint8_t*>(weight_scale.data());
  linear_dequant(x.f32(), x.dim(0), K, N, bias ? b.data() : nullptr, out.f32(), [&](int64_t r0, int64_t n, float* dst) {
    dequantize_nvfp4_rows(packed, scales, weight_scale_2, K, r0, n, dst);
  });
}

}  // namespace chimera::cpu
