// ops::moe_experts on CUDA with the expert-GEMM path chosen by the caller: the benchmarks compare the paths on
// one routing (the ops:: entry point and cuda::moe_experts always take kAuto). Same contract as ops::moe_experts.
#pragma once

#include <span>

#include "ops/ops.h"

namespace chimera::cuda::moe {

// kAuto: GEMV for T <= kGemvMaxTokens, tensor cores above (16-bit activations and weights of one dtype, K and N
// multiples of 8, aligned rows), fp32 SIMT otherwise. A forced path outside its domain throws.
enum class ExpertsPath { kAuto, kGemv, kMma, kSimt };

// shared (optional): the layer's shared expert (ops::moe_experts_shared). On the GEMV path, when its sizes and
// dtypes fit (moe_kernels.h, GemvShared), it runs as extra units of the up and down launches; otherwise (any other
// path, or a shared expert outside the GEMV domain) it runs as cuda::relu2_mlp after the routed experts.
// Benchmarks and tests: false runs the permutation and the combine as their own launches on the GEMV path too
// (default true: folded into the two GEMV launches, bit-identical results; CHIMERA_MOE_GEMV_FOLD=0 sets the
// default false). Process-wide.
void set_gemv_fold(bool fold);

void moe_experts_on_path(const ops::Context& ctx, const Tensor& out, const Tensor& x, const Tensor& topk_ids,
                         const Tensor& topk_weights, std::span<const Tensor> up_proj, std::span<const Tensor> down_proj,
                         ExpertsPath path, const ops::SharedExpert* shared = nullptr);

}  // namespace chimera::cuda::moe
