// cuda::linear with the path chosen by the caller: the benchmarks and tests compare the GEMV and cuBLASLt paths
// on the same inputs (ops::linear and cuda::linear always take kAuto). Same contract as ops::linear.
#pragma once

#include "ops/ops.h"

namespace chimera::cuda {

// kAuto: the GEMV (gemm/gemv.h) for T <= kLinearGemvAutoMaxTokens when it supports the shape, cuBLASLt otherwise.
// A forced kGemv outside the GEMV's domain throws.
enum class LinearPath { kAuto, kGemv, kCublas };
constexpr int64_t kLinearGemvAutoMaxTokens = 2;  // above it cuBLASLt's tensor-core kernels win (bench linear_decode)

// Whether the GEMV path takes out = x @ weight^T (dtype, alignment, size limits of gemm/gemv.h).
bool linear_gemv_supported(const Tensor& out, const Tensor& x, const Tensor& weight);

void linear_on_path(const ops::Context& ctx, const Tensor& out, const Tensor& x, const Tensor& weight,
                    const Tensor& bias, LinearPath path);

}  // namespace chimera::cuda
