// Quantized linear layers of ModelOpt checkpoints (docs/quantization.md 4): the weights as stored, the math as
// the CPU reference computes it. Conventions as ops/ops.h: y = x @ W^T (+ b), x and out F32 [T, *] on the CPU.
//
//   FP8 (quant_algo FP8)      weight F8_E4M3 [N, K]; weight_scale F32 scalar; input_scale F32 scalar
//                             W = e4m3(weight) * weight_scale
//   NVFP4 (quant_algo NVFP4)  weight U8 [N, K / 2] (E2M1 pairs, element 2i in the low nibble);
//                             weight_scale F8_E4M3 [N, K / 16]; weight_scale_2 F32 scalar; input_scale F32 scalar
//                             W[n, k] = e2m1(weight[n, k / 2]) * (e4m3(weight_scale[n, k / 16]) * weight_scale_2)
//
// Activations: ActQuant::kNone uses x as it is (weight-only dequantization); ActQuant::kStatic (FP8 only) first
// fake-quantizes x with the checkpoint's static input_scale, x' = e4m3(x / input_scale) * input_scale (saturated
// at +-448), which is ModelOpt's W8A8 in exact arithmetic. A scalar is a tensor of one element (shape [] or [1]).
#pragma once

#include <span>
#include <string>
#include <string_view>

#include "core/tensor.h"
#include "ops/ops.h"
#include "ops/quant_weights.h"

namespace chimera::ops {

struct Fp8Linear {
  std::string name;  // the module's checkpoint prefix, for errors ("backbone.layers.0.mixer.in_proj")
  Tensor weight;        // F8_E4M3 [N, K]
  Tensor weight_scale;  // F32 scalar
  Tensor input_scale;   // F32 scalar; may be undefined for ActQuant::kNone
};

struct Nvfp4Linear {
  std::string name;
  Tensor weight;          // U8 [N, K / 2]
  Tensor weight_scale;    // F8_E4M3 [N, K / 16]
  Tensor weight_scale_2;  // F32 scalar
  Tensor input_scale;     // F32 scalar or undefined (unused by the weight-only path)
};

// Checks a module's tensors against its input size in_features (K): dtypes, shapes, K a multiple of 16 for NVFP4,
// scales finite and positive. A bad checkpoint -> kInvalidInput naming the module's tensor, e.g.
// "backbone.layers.1.mixer.experts.0.up_proj.weight_scale: shape [8, 3], expected [8, 4] (F8_E4M3 [N, K / 16])".
void validate(const Fp8Linear& w, int64_t in_features, ActQuant act);
void validate(const Nvfp4Linear& w, int64_t in_features);

// out [T, N] F32 = x' @ W^T (+ bias [N]); x [T, K] F32. Validates as above first.
void fp8_linear(const Context& ctx, const Tensor& out, const Tensor& x, const Fp8Linear& w, ActQuant act,
                const Tensor& bias = Tensor());
void nvfp4_linear(const Context& ctx, const Tensor& out, const Tensor& x, const Nvfp4Linear& w,
                  const Tensor& bias = Tensor());

// ---- the model's linear layers and experts in their stored form (ops/quant_weights.h) ---------------------
// Each op dispatches on the format: kDense goes to the dense op of ops/ops.h (bit-identical to calling it);
// kFp8 / kNvfp4 run the exact fp32 reference on the CPU (weights dequantized as core/fp8.h and core/nvfp4.h define
// them; ActQuant::kStatic fake-quantizes the activation with input_scale first) and the quantized kernels on CUDA.

// Checks a weight's tensors against its format: dtypes, shapes, K a multiple of 16 for NVFP4, scales finite and
// > 0, kStatic only with FP8 and an input_scale. A bad one -> kInvalidInput naming w.name's tensor.
void validate(const LinearWeight& w);
void validate(const ExpertWeights& w);

// out [T, N] = x' @ W^T (+ bias [N]); x [T, K].
void linear(const Context& ctx, const Tensor& out, const Tensor& x, const LinearWeight& w,
            const Tensor& bias = Tensor());
// The same x through 1..3 weights: linear_multi of ops/ops.h when every weight is dense, else one linear each.
void linear_multi(const Context& ctx, std::span<const Tensor> outs, const Tensor& x,
                  std::span<const LinearWeight* const> weights);
// residual_norm_linear of ops/ops.h (the fused residual step) when every weight is dense; otherwise unfused:
// residual_out = residual, then add_rms_norm / add2_rms_norm into (residual_out, x), then one linear each.
void residual_norm_linear(const Context& ctx, const ResidualNorm& rn, std::span<const Tensor> outs,
                          std::span<const LinearWeight* const> weights, const Tensor& bias = Tensor());
// out = down(relu(up(x))^2): relu2_mlp of ops/ops.h when both are dense; otherwise linear, relu2, linear with the
// intermediate [T, I] in x's dtype.
void relu2_mlp(const Context& ctx, const Tensor& out, const Tensor& x, const LinearWeight& up_proj,
               const LinearWeight& down_proj);

// Routed experts as moe_experts of ops/ops.h (same shapes, same per-token accumulation order: experts in increasing
// index, each one's weighted output added as it finishes) with each expert's projections in the stored format.
// FP8 kStatic: expert e's up_proj input quantized with up.host_input_scale[e], its relu^2 output with
// down.host_input_scale[e]. Dense experts go to the dense op through per-expert views.
void moe_experts(const Context& ctx, const Tensor& out, const Tensor& x, const Tensor& topk_ids,
                 const Tensor& topk_weights, const ExpertWeights& up_proj, const ExpertWeights& down_proj);

}  // namespace chimera::ops
