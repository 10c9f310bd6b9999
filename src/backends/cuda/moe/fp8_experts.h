// Routed MoE experts with FP8 expert weights on CUDA (ops::ExpertWeights, WeightFormat::kFp8), the semantics of
// cpu::moe_experts_fp8 (backends/cpu/fp8_experts.h) with 16-bit activations rounding r = relu(h)^2 once to the
// activation dtype (the dense experts' rounding point). docs/moe_cuda.md ("FP8 experts") describes the kernels.
#pragma once

#include "ops/ops.h"
#include "ops/quant_weights.h"

namespace chimera::cuda {

// out [T, D] (the dtype of x: F32, BF16 or F16), x [T, D], topk_ids I32 [T, k], topk_weights F32 [T, k];
// up [E, I, D] and down [E, D, I] F8_E4M3 on the device with F32 [E] scale (and input_scale for ActQuant::kStatic).
// Decode and anything outside the CUTLASS domain: the grouped FP8 GEMV (fp8_grouped_gemv.cu); prefill (T >=
// moe::kFp8CutlassMinTokens, W8A8 on both projections, BF16 activations, D and I multiples of 16, CUTLASS built and
// ctx.kernels.moe_cutlass): the FP8 grouped GEMM (cutlass/fp8_grouped_gemm_sm90.cu).
void moe_experts_fp8(const ops::Context& ctx, const Tensor& out, const Tensor& x, const Tensor& topk_ids,
                     const Tensor& topk_weights, const ops::ExpertWeights& up, const ops::ExpertWeights& down);

namespace moe {

// Which kernels run (tests and benchmarks force one; kAuto is moe_experts_fp8's choice). A forced path outside its
// domain throws.
enum class Fp8ExpertsPath { kAuto, kGemv, kCutlass };
inline constexpr int64_t kFp8CutlassMinTokens = 64;
void moe_experts_fp8_on_path(const ops::Context& ctx, const Tensor& out, const Tensor& x, const Tensor& topk_ids,
                             const Tensor& topk_weights, const ops::ExpertWeights& up, const ops::ExpertWeights& down,
                             Fp8ExpertsPath path);

}  // namespace moe
}  // namespace chimera::cuda
