// Small scalar helpers shared by the CPU reference kernels (fp32 everywhere, matching PyTorch's fp32 ops).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"

namespace chimera::cpu {

inline float silu(float v) { return v / (1.0f + std::exp(-v)); }
inline float sigmoid(float v) { return 1.0f / (1.0f + std::exp(-v)); }
// torch.nn.functional.softplus with threshold 20 (what mamba_ssm and HF use for dt).
inline float softplus(float v) { return v > 20.0f ? v : std::log1p(std::exp(v)); }

// A whole (small) float tensor of any float dtype as fp32 values: norm weights, A_log, D, biases.
inline std::vector<float> to_f32_vector(const Tensor& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  convert_to_f32(t.data(), t.dtype(), v.data(), v.size());
  return v;
}

// Rows [row, row + n_rows) of a 2-D weight of any float dtype, converted into dst (n_rows * cols floats).
inline void load_rows_f32(const Tensor& w, int64_t row, int64_t n_rows, int64_t cols, float* dst) {
  const auto* base = static_cast<const char*>(w.data()) + static_cast<size_t>(row * cols) * dtype_size(w.dtype());
  convert_to_f32(base, w.dtype(), dst, static_cast<size_t>(n_rows * cols));
}

// Fixed-order fp32 dot product with 8 independent partial sums (vectorisable without -ffast-math, and the
// same result for the same inputs whatever thread runs it).
inline float dot_f32(const float* a, const float* b, int64_t n) {
  constexpr int kLanes = 8;
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) acc[l] += a[i + l] * b[i + l];
  }
  for (int l = 0; i < n; ++i, ++l) acc[l] += a[i] * b[i];
  float s = 0.0f;
  for (int l = 0; l < kLanes; ++l) s += acc[l];
  return s;
}

// y = x @ W^T (+ bias) for row-major fp32 x [T, in] and a weight [out, in] of any float dtype; y [T, out].
// Defined in linear.cpp; shared by linear, relu2_mlp and moe_experts.
void linear_f32(const float* x, int64_t T, int64_t in_features, const Tensor& weight, const float* bias, float* y);

}  // namespace chimera::cpu
