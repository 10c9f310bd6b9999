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
// cutlass_built() says). Measured on the H200 (chimera_bench moe_experts_prefill, graph; docs/perf.md): the mma path
// is 5 % faster at T = 64, CUTLASS 1.21x / 1.47x faster at Nano T = 1024 / 4096 and 1.31x / 1.57x at Super
// (512 experts, top-22); the threshold lies between the measured 64 and 1024 (256 is not measured).
enum class ExpertsPath { kAuto, kGemv, kMma, kSimt, kCutlass };
inline constexpr int64_t kCutlassMinTokens = 256;
bool cutlass_built();
// Benchmarks and engine A/B runs: whether kAuto takes the CUTLASS path (when built). On by default;
// CHIMERA_MOE_CUTLASS=0 turns it off. Process-wide. Returns the previous setting.
bool set_cutlass_auto(bool on);
// Benchmarks and tests: the CUTLASS path's tokens per tile, 64 or 128; 0 (the default) picks 128 when the pairs per
// possibly active expert, P / min(E, P), exceed 96 (prefill at T ~ 4k), else 64. CHIMERA_MOE_CUTLASS_TILE_N sets the
// default. Process-wide. Returns the previous setting.
int set_cutlass_tile_n(int tile_n);

// shared (optional): the layer's shared expert (ops::moe_experts_shared). On the GEMV path, when its sizes and
// dtypes fit (moe_kernels.h, GemvShared), it runs as extra units of the up and down launches; otherwise (any other
// path, or a shared expert outside the GEMV domain) it runs as cuda::relu2_mlp after the routed experts.
// Benchmarks and tests: what of the GEMV path's permutation and combine is folded into its two launches
// (moe_kernels.h, GemvFold; results bit-identical either way): 0 none (their own launches), 1 the permutation
// (the default), 2 the permutation and the combine (measured slower: the count's fence in the down kernel waits for
// the next unit's prefetched weight loads). CHIMERA_MOE_GEMV_FOLD=0|1|2 sets the default. Process-wide.
void set_gemv_fold(int fold);

// Benchmarks and tests: whether the up launch runs the shared expert's units before its pdl_wait(), overlapping the
// previous kernel (the router; moe_kernels.h, GemvShared::before_wait; results bit-identical either way). On by
// default; CHIMERA_MOE_EARLY_SHARED=0 turns it off. Process-wide. Returns the previous setting.
bool set_gemv_early_shared(bool on);

// Benchmarks and tests: whether the down launch, with the permutation folded into the up launch, lets its blocks whose
// first unit is routed rebuild the work list and issue that unit's first weight loads before its pdl_wait()
// (moe_kernels.h, GemvFold::early_routed; results bit-identical either way). On by default; CHIMERA_MOE_DOWN_EARLY=0
// turns it off. Process-wide. Returns the previous setting.
bool set_gemv_down_early(bool on);

// Benchmarks and tests: whether ops::router_gate_topk takes the single-cluster kernel where it applies (moe_kernels.h,
// launch_router_gate_cluster: T <= 4 and an fp32 gate slice that fits a CTA, e.g. Nano; not Super) instead of the
// split-K kernel. On by default; CHIMERA_ROUTER_CLUSTER=0 turns it off. Process-wide. Returns the previous setting.
bool set_router_cluster(bool on);
// Tests: the cluster size of the calling host thread's last ops::router_gate_topk on CUDA, 0 when another kernel ran.
int router_gate_last_cluster();

void moe_experts_on_path(const ops::Context& ctx, const Tensor& out, const Tensor& x, const Tensor& topk_ids,
                         const Tensor& topk_weights, std::span<const Tensor> up_proj, std::span<const Tensor> down_proj,
                         ExpertsPath path, const ops::SharedExpert* shared = nullptr);

}  // namespace chimera::cuda::moe
