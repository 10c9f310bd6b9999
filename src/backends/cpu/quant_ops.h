// CPU reference of the quantized linear layers (ops/quant_ops.h): arguments already validated there.
#pragma once

#include "ops/quant_ops.h"

namespace chimera::cpu {

// x [T, K] F32 (already fake-quantized by the caller when the layer quantizes activations).
void fp8_linear(const Tensor& out, const Tensor& x, const Tensor& weight, float weight_scale, const Tensor& bias);
void nvfp4_linear(const Tensor& out, const Tensor& x, const Tensor& weight, const Tensor& weight_scale,
                  float weight_scale_2, const Tensor& bias);

}  // namespace chimera::cpu
