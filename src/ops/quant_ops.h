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

}  // namespace chimera::ops
