// CPU reference of the routed MoE experts with FP8 expert weights (ops::ExpertWeights, WeightFormat::kFp8), the
// exact fp32 dequantization the CUDA kernels (backends/cuda/moe/fp8_experts.h) are tested against.
#pragma once

#include "core/tensor.h"
#include "ops/quant_weights.h"

namespace chimera::cpu {

// out [T, D] F32 = sum over the token's choices j of topk_weights[t, j] * y_{e_j}(x[t]), experts in increasing index
// order (the per-token fp32 accumulation order of cpu::moe_experts), where for expert e
//   a = x[t]                                  (up.act == kNone)
//   a = e4m3(x[t] / in_up[e]) * in_up[e]      (up.act == kStatic, saturated; fake_quantize_fp8)
//   a = e4m3(x[t] / s_x) * s_x                (up.act == kDynamic: s_x = max |x| / 448 over all of x [T, D])
//   h = a @ (e4m3(W_up[e]) * s_up[e])^T       fp32
//   r = relu(h)^2, rounded to `act_dtype` (F32: not rounded; BF16 / F16: the rounding point of the CUDA kernels
//       with 16-bit activations, which store r in the activation dtype), then fake-quantized with in_down[e] when
//       down.act == kStatic, or with s_r = max |r| / 448 over every routed row of every expert when kDynamic
//   y = r @ (e4m3(W_down[e]) * s_down[e])^T   fp32
// x F32 [T, D], topk_ids I32 [T, k] (ids in [0, E)), topk_weights F32 [T, k]; up [E, I, D] and down [E, D, I] FP8
// with host_scale (and host_input_scale for kStatic). Bad shapes / formats throw naming the tensor.
void moe_experts_fp8(const Tensor& out, const Tensor& x, const Tensor& topk_ids, const Tensor& topk_weights,
                     const ops::ExpertWeights& up, const ops::ExpertWeights& down, DType act_dtype = DType::kF32);

// The checks both backends share (shapes, formats, dtypes of the weights, scale counts). `where` prefixes messages.
void check_fp8_experts(const char* where, const Tensor& x, const Tensor& topk_ids, const Tensor& topk_weights,
                       const ops::ExpertWeights& up, const ops::ExpertWeights& down);

}  // namespace chimera::cpu
