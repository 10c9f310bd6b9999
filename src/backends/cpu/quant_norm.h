// CPU reference of the FP8 activation quantizer and the fused norm + FP8 quant ops (ops/quant_norm_ops.h):
// arguments already validated there. Activations F32; out_q F8_E4M3 bytes.
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace chimera::cpu {

// out_q = f32_to_e4m3(x / input_scale) (saturated), element by element.
void quantize_fp8(const Tensor& out_q, const Tensor& x, float input_scale);
// add_rms_norm (residual updated in place) then quantize_fp8 of its output.
void add_rms_norm_fp8(const Tensor& residual, const Tensor& out_q, const Tensor& x, const Tensor& weight, float eps,
                      float input_scale);
// gated_rms_norm then quantize_fp8 of its output.
void gated_rms_norm_fp8(const Tensor& out_q, const Tensor& y, const Tensor& z, const Tensor& weight, int64_t n_groups,
                        float eps, float input_scale);

}  // namespace chimera::cpu
