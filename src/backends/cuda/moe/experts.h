// ops::moe_experts on CUDA with the expert-GEMM path chosen by the caller: the benchmarks compare the paths on
// one routing (the ops:: entry point and cuda::moe_experts always take kAuto). Same contract as ops::moe_experts.
#pragma once

#include <span>

#include "ops/ops.h"

namespace chimera::cuda::moe {

// kAuto: GEMV for T <= kGemvMaxTokens, tensor cores above (16-bit activations and weights of one dtype, K and N
// multiples of 8, aligned rows): CUTLASS from kCutlassMinTokens bf16 tokens when built, else the mma kernels; fp32
// SIMT otherwise. A forced path outside its domain throws.
// kCutlass: CUTLASS 3.x's sm90 grouped GEMM (moe_kernels.h, CutlassExpertsParams), bf16 activations and weights, K
// and N multiples of 8, aligned rows. Throws when the build has no CUTLASS (cmake -DCHIMERA_CUTLASS=ON;
// cutlass_built() says). The mma kernels win at a few dozen tokens, CUTLASS's larger tiles from about a thousand
// (Nano and Super, chimera_bench moe_experts_prefill); kCutlassMinTokens sits between the two.
enum class ExpertsPath { kAuto, kGemv, kMma, kSimt, kCutlass };
inline constexpr int64_t kCutlassMinTokens = 256;
bool cutlass_built();
// shared (optional): the layer's shared expert (ops::moe_experts_shared). On the GEMV path, when its sizes and
// dtypes fit (moe_kernels.h, GemvShared), it runs as extra units of the up and down launches; otherwise (any other
// path, or a shared expert outside the GEMV domain) it runs as cuda::relu2_mlp after the routed experts.
// The GEMV path's folds and early starts and the CUTLASS switch and tile come from ctx.kernels (ops/kernel_config.h).
void moe_experts_on_path(const ops::Context& ctx, const Tensor& out, const Tensor& x, const Tensor& topk_ids,
                         const Tensor& topk_weights, std::span<const Tensor> up_proj, std::span<const Tensor> down_proj,
                         ExpertsPath path, const ops::SharedExpert* shared = nullptr);

// Tests: the cluster size of the calling host thread's last ops::router_gate_topk on CUDA, 0 when another kernel ran.
int router_gate_last_cluster();

}  // namespace chimera::cuda::moe
