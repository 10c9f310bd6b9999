// The dense-layer plan of the CUDA backend (gemm/linear.cu): which kernel runs a decode-size dense op, and the entry
// points that run one given choice (the tests and the offline tuning tool, chimera_bench linear_tune, compare them on
// the same inputs; ops::linear and friends always take the plan's choice). Same contracts as ops::linear,
// ops::linear_multi and ops::residual_norm_linear.
#pragma once

#include <span>

#include "ops/ops.h"

namespace chimera::cuda {

// Above this many rows cuBLASLt's tensor-core kernels always win; at or below it the GEMV (gemm/gemv.h) competes.
constexpr int64_t kLinearGemvAutoMaxTokens = 2;

// The dense ops whose kernel the plan chooses at decode sizes.
//   kLinear:   ops::linear (one weight, optional bias): cuBLASLt or the GEMV.
//   kMulti:    ops::linear_multi's one GEMV launch over 2..3 weights (out = the weights' rows summed): warps per row.
//   kNormAdd:  ops::residual_norm_linear, add_rms_norm form: the norm kernel then the dense op(s), or the one GEMV
//              launch that computes the norm per block (out = the weights' rows summed).
//   kNormAdd2: the same, add2_rms_norm form (a MoE layer's shared + routed outputs).
enum class LinearKind : int8_t { kLinear = 0, kMulti = 1, kNormAdd = 2, kNormAdd2 = 3 };

// A plan choice: kSeparate (-1) = cuBLASLt (kLinear) or the norm kernel then the dense op(s) (kNormAdd*; not valid
// for kMulti); 0 = the GEMV with its own warps-per-row rule (gemm/gemv.cu); 1, 2, 4 = the GEMV at that many warps
// per row. kLinear's GEMV choices apply only where the GEMV takes the shape (linear_gemv_supported).
inline constexpr int kSeparate = -1;

// One row of the tuned table (gemm/sm90_linear_table.inc): the choice for a 16-bit activation of `tokens` rows,
// `in` features and `out` output rows summed over the parts.
struct LinearPlanEntry {
  LinearKind kind;
  int tokens;
  int in;
  int out;
  int choice;
};
std::span<const LinearPlanEntry> linear_plan_table();

// The plan's choice for a decode-size shape (tokens <= kLinearGemvAutoMaxTokens): the table's entry, or the rule for
// shapes the table does not list: kLinear and kMulti the GEMV with its own rule; kNormAdd* the one launch at one row
// and the two ops at two rows (at two rows the norm's extra pass over x and cuBLASLt's tensor cores win on the
// large projections). A deterministic function of its arguments: the same shape gets the same kernel on every run.
int linear_plan_choice(LinearKind kind, int64_t tokens, int64_t in, int64_t out);

// Whether the GEMV path takes out = x @ weight^T (dtype, alignment, size limits of gemm/gemv.h).
bool linear_gemv_supported(const Tensor& out, const Tensor& x, const Tensor& weight);

// Whether residual_norm_linear's one-launch path applies to these arguments (16-bit, T <= 2, the norm's layout fits a
// GEMV block, every weight a GEMV shape, ...) and ctx.kernels.residual_norm_fold allows it.
bool residual_norm_linear_fused(const ops::Context& ctx, const ops::ResidualNorm& rn, std::span<const Tensor> outs,
                                std::span<const Tensor> weights, const Tensor& bias);

// The ops with the choice given instead of the plan's. A GEMV choice outside the GEMV's domain (or, for
// residual_norm_linear, outside residual_norm_linear_fused) throws.
void linear_with_choice(const ops::Context& ctx, const Tensor& out, const Tensor& x, const Tensor& weight,
                        const Tensor& bias, int choice);
void linear_multi_with_choice(const ops::Context& ctx, std::span<const Tensor> outs, const Tensor& x,
                              std::span<const Tensor> weights, int choice);
void residual_norm_linear_with_choice(const ops::Context& ctx, const ops::ResidualNorm& rn,
                                      std::span<const Tensor> outs, std::span<const Tensor> weights,
                                      const Tensor& bias, int choice);

}  // namespace chimera::cuda
