// ops::moe_experts on CUDA with the expert-GEMM path chosen by the caller: the benchmarks compare the paths on
// one routing (the ops:: entry point and cuda::moe_experts always take kAuto). Same contract as ops::moe_experts.
#pragma once

#include <span>

#include "ops/ops.h"

namespace chimera::cuda::moe {

// kAuto: GEMV for T <= kGemvMaxTokens, tensor cores above (16-bit activations and weights of one dtype, K and N
// multiples of 8, aligned rows), fp32 SIMT otherwise. A forced path outside its domain throws.
enum class ExpertsPath { kAuto, kGemv, kMma, kSimt };

void moe_experts_on_path(const ops::Context& ctx, const Tensor& out, const Tensor& x, const Tensor& topk_ids,
                         const Tensor& topk_weights, std::span<const Tensor> up_proj, std::span<const Tensor> down_proj,
                         ExpertsPath path);

}  // namespace chimera::cuda::moe
