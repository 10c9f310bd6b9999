// The FP8 activation quantizer and the fused norm + FP8 quant ops on the CPU (backends/cpu/quant_norm.h): by
// construction the unfused ops (cpu::add_rms_norm, cpu::gated_rms_norm into an F32 row) followed by the quantizer of
// core/fp8.h, so that the fused CUDA kernels have one reference whose rounding points are those of the ops they
// replace.
#include "backends/cpu/quant_norm.h"

#include "backends/cpu/cpu_ops.h"
#include "core/fp8.h"
#include "core/parallel.h"

namespace chimera::cpu {

void quantize_fp8(const Tensor& out_q, const Tensor& x, float input_scale) {
  const float* src = x.f32();
  auto* dst = static_cast<uint8_t*>(out_q.data());
  parallel_for(x.numel(), 65536, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) dst[i] = f32_to_e4m3(src[i] / input_scale);
  });
}

void add_rms_norm_fp8(const Tensor& residual, const Tensor& out_q, const Tensor& x, const Tensor& weight, float eps,
                      float input_scale) {
  const Tensor normed = Tensor::empty(DType::kF32, x.shape());
  add_rms_norm(residual, normed, x, weight, eps);
  quantize_fp8(out_q, normed, input_scale);
}

void gated_rms_norm_fp8(const Tensor& out_q, const Tensor& y, const Tensor& z, const Tensor& weight, int64_t n_groups,
                        float eps, float input_scale) {
  const Tensor normed = Tensor::empty(DType::kF32, y.shape());
  gated_rms_norm(normed, y, z, weight, n_groups, eps);
  quantize_fp8(out_q, normed, input_scale);
}

}  // namespace chimera::cpu
