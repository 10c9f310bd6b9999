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

// Benchmarks, tests and engine A/B runs: whether ops::linear_add_rms_norm runs the residual norm inside the GEMV's
// launch where it can (gemm/gemv.h, GemvNormEpilogue: one launch fewer per decode Mamba, attention and dense MLP
// layer); off: the GEMV and then the norm kernel. The same bits either way. On by default; CHIMERA_GEMV_NORM_FOLD=0
// turns it off. Process-wide. Returns the previous setting.
bool set_gemv_norm_fold(bool on);

// Whether the GEMV's epilogue takes the norm of y's rows (gemm::gemv_norm_supported: 16-bit y, residual, norm_out and
// norm_weight of one dtype, 16-byte aligned, a row of at most 4096 elements, a multiple of 8): where the linear also
// takes the GEMV, ops::linear_add_rms_norm is then one launch (unless set_gemv_norm_fold(false)).
bool linear_add_rms_norm_foldable(const Tensor& y, const Tensor& residual, const Tensor& norm_out,
                                  const Tensor& norm_weight);

// ops::linear_add_rms_norm on a path chosen by the caller: linear_on_path's paths, warps_per_row for kGemv (0: the
// GEMV's own rule, else 1, 2, 4 or 8; ignored by the other paths), and the fold on or off (on: the epilogue where the
// path is the GEMV and gemm::gemv_norm_supported, else the norm kernel after the linear). Same contract as the op.
void linear_add_rms_norm_on_path(const ops::Context& ctx, const Tensor& y, const Tensor& x, const Tensor& weight,
                                 const Tensor& bias, const Tensor& residual, const Tensor& norm_out,
                                 const Tensor& norm_weight, float eps, LinearPath path, int warps_per_row, bool fold);

}  // namespace chimera::cuda
