// The kernel choices of the CUDA backend as one immutable value, carried in ops::Context (ctx.kernels).
//
// The backend never reads the environment or process state to decide which kernel runs: each choice that is not a
// pure function of the step's shapes is a field here. The defaults are the fastest configuration measured on the
// H200 (docs/perf.md); a non-default value is an A/B switch for benchmarks and tests, and every value of every field
// gives the same results bit for bit unless its comment says otherwise. The CPU backend ignores the struct.
// Filled in one place: the CLI flags (apps/chimera) and, for benchmarking, the CHIMERA_* environment registry
// (runtime/kernel_env.h), which validates every value once.
// Which kernel a shape gets where both are defaults somewhere (GEMV or cuBLASLt, SSU tiling, ...) is not a field:
// that is the backend's plan, a fixed rule or the offline-tuned table of docs/kernel_plan.md.
// A field stays only if its other value runs a path that is the plan's default for some shape, model or build, or
// only takes an optimisation out of the same kernel (an A/B switch); docs/kernel_plan.md has the table, field by
// field.
#pragma once

#include <cstdint>

namespace chimera::ops {

struct KernelConfig {
  // Programmatic dependent launch (sm_90+) for the kernels launched through backends/cuda/launch.cuh: the next
  // kernel's prologue overlaps the previous kernel's tail. Off: every kernel starts after its predecessor drained.
  // A captured CUDA graph keeps the setting it was captured with.
  bool pdl = true;

  // ops::mamba_decode_update on CUDA: the one fused kernel (conv update + state update + gated norm) up to this many
  // decode rows, the three kernels above it (the fused kernel runs one cluster per sequence and group, which stops
  // paying once the separate kernels fill the GPU). 0: never fused. Output within an ulp of the three kernels
  // (the norm's sum is added in another order); the states are bit-identical.
  int64_t mamba_decode_fused_max_rows = 2;
  // The fused Mamba decode kernel loads the slots' conv and SSM states before its PDL wait when the caller says
  // the previous kernel writes neither (the model: in_proj). Same results either way.
  bool mamba_prefetch_states = true;

  // ops::selective_state_update, persistent kernel (batch >= 64) at N = 128 with an f32 or bf16 state: warps take
  // chunks of four units from a device counter (dynamic split) instead of an equal static run each. Same bits.
  bool ssu_dynamic_split = true;

  // ops::attention decode rows: the split-KV decode kernel appends the step's k / v rows to the paged cache itself
  // instead of a separate append launch before it. Same output and cache bits.
  bool attention_decode_append = true;

  // ops::residual_norm_linear at decode sizes: the residual add and RMSNorm computed inside the GEMV blocks (one
  // launch) where the plan takes it (docs/kernel_plan.md); off: always the norm kernel, then the dense op(s).
  // The same x and residual bits either way.
  bool residual_norm_fold = true;

  // ops::router_gate_topk at decode sizes (T <= 4) with an fp32 gate slice that fits one CTA (Nano, not Super): the
  // single-cluster kernel instead of the split-K kernel. Same bits.
  bool router_cluster = true;

  // MoE experts, GEMV path (decode): the token permutation computed inside the up-projection launch instead of its
  // own launch. Same bits.
  bool moe_gemv_fold = true;
  // MoE experts, GEMV path: the shared expert's up units run before the up launch's PDL wait, overlapping the
  // router. Same bits.
  bool moe_early_shared = true;
  // MoE experts, GEMV path with the permutation folded: the down launch's blocks whose first unit is routed rebuild
  // the work list and start that unit's weight loads before their PDL wait. Same bits.
  bool moe_down_early = true;
  // MoE experts, bf16 prefill from cuda::moe::kCutlassMinTokens tokens: CUTLASS's sm90 grouped GEMM (when the build
  // has it) instead of the mma kernels.
  bool moe_cutlass = true;
  // The CUTLASS path's tokens per tile: 0 picks (128 when the pairs per possibly active expert exceed 96, else 64);
  // 64 or 128 forces one.
  int moe_cutlass_tile_n = 0;
};

}  // namespace chimera::ops
