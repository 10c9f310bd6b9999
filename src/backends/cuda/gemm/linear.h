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

// ops::residual_norm_linear's one-launch GEMV path (the residual step computed by every GEMV block): kOff, the two
// ops (the norm kernel, then linear); kAuto (the default), the faster of the two and the one launch, timed once per
// shape; kAlways, the one launch wherever it applies. The same x and residual bits on every path.
// CHIMERA_RESIDUAL_NORM_FOLD=0|1|2 sets the default. Process-wide; returns the previous setting.
enum class NormFold { kOff = 0, kAuto = 1, kAlways = 2 };
NormFold set_residual_norm_fold(NormFold fold);
// Whether the one-launch path applies to these arguments (16-bit, T <= 2, the norm's layout fits a GEMV block, ...)
// and is not turned off.
bool residual_norm_linear_fused(const ops::ResidualNorm& rn, std::span<const Tensor> outs,
                                std::span<const Tensor> weights, const Tensor& bias);

void linear_on_path(const ops::Context& ctx, const Tensor& out, const Tensor& x, const Tensor& weight,
                    const Tensor& bias, LinearPath path);

}  // namespace chimera::cuda
