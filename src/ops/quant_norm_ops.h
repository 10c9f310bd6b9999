// FP8 activation quantization and the fused norm + FP8 quant ops (docs/fp8_cuda.md): the input side of an FP8 W8A8
// linear layer whose static input_scale comes from the checkpoint. Conventions as ops/ops.h (activations F32 on the
// CPU reference; F32, BF16 or F16 on CUDA, one dtype per call); out_q is F8_E4M3 of the activation's shape, on the
// same device.
//
//   quantize_fp8:        out_q = e4m3(x / input_scale), round to nearest even, saturated at +-448
//   add_rms_norm_fp8:    residual += x (in place), out_q = e4m3(rms_norm(residual) * weight / input_scale)
//   gated_rms_norm_fp8:  out_q = e4m3(gated_rms_norm(y, z) * weight / input_scale) (norm_before_gate = false,
//                        n_groups groups of D / n_groups channels)
//
// Each fused op gives the codes of the unfused op followed by quantize_fp8 of its output, on either backend: the
// normalised row is rounded to the activation dtype before the division (on the CPU, F32: no rounding).
#pragma once

#include <cstdint>

#include "core/tensor.h"
#include "ops/ops.h"

namespace chimera::ops {

void quantize_fp8(const Context& ctx, const Tensor& out_q, const Tensor& x, float input_scale);
void add_rms_norm_fp8(const Context& ctx, const Tensor& residual, const Tensor& out_q, const Tensor& x,
                      const Tensor& weight, float eps, float input_scale);
void gated_rms_norm_fp8(const Context& ctx, const Tensor& out_q, const Tensor& y, const Tensor& z, const Tensor& weight,
                        int64_t n_groups, float eps, float input_scale);

}  // namespace chimera::ops
