// The Mamba-2 decode step of one layer in ONE kernel: from the in_proj output row of each sequence
//   [ z : Di | xBC : Cd | dt_raw : H ]                                        (docs/model.md 3.2)
// to the gated-norm output, exactly the three ops of the unfused path with the same roundings:
//   1. causal_conv1d_update(xBC) + SiLU   (conv1d_update.cu: same FMA order, fast SiLU, rounded to the act dtype)
//   2. selective_state_update(x, dt, B, C) (selective_state_update_kernels.cuh: same lane layout, y rounded)
//   3. gated_rms_norm(y, z)                (row_norm.cuh kGated: silu(z) with expf, fp32 sum of squares)
// so conv state and SSM state are bit-identical to the unfused kernels, y too for N 64, 128, 256 (the SSU's fast
// kernel layout; N 16 and 32 sum y in another order than the SSU's portable kernel), and the output differs only
// by summation order (the group's sum of squares; an ulp of the activation dtype at most).
//
// Why one kernel: at decode each of the three is a few microseconds of launch and ramp for a few hundred KB,
// and the conv output and y went through global memory between them (plus, for batch > 1, the column splits
// of the model's split_columns). Layout: a thread-block cluster per (sequence, Mamba group); its CTAs own the
// group's heads (heads_per_group / cluster heads each). Every CTA computes the conv of its heads' x channels
// and, redundantly (cheap, L2-resident), the group's B and C channels; after a cluster barrier (every CTA has
// read the old B/C conv state) the B/C state is written once, split over the ranks. The gated norm's group is
// exactly the heads of one Mamba group (docs/model.md 3.1), so its sum of squares is reduced across the cluster
// through distributed shared memory, summed in rank order (every CTA gets the same bits).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.h"

namespace chimera::cuda {

struct MambaDecodeParams {
  const void* zxbcdt;       // [batch, Di + Cd + H] act: z | xBC | dt_raw, one row per sequence
  void* out;                // [batch, Di] act; rows of pad sequences are left untouched
  const void* conv_weight;  // [Cd, K] conv_weight_dtype (the checkpoint's [Cd, 1, K] is the same memory)
  const void* conv_bias;    // [Cd] conv_bias_dtype, or nullptr
  void* conv_state;         // [num_slots, Cd, K-1] conv_state_dtype, shifted by one in place
  void* ssm_state;          // [num_slots, H, P, N] ssm_state_dtype, updated in place (16-byte aligned)
  const int32_t* slots;     // [batch] device; slot < 0: pad, skipped (out row and both states untouched)
  // F16 SSM state: stochastic rounding keyed by state_seed and positions[b] (device [batch]; nullptr: 0), exactly as
  // SsuParams (selective_state_update.cuh), so the states stay bit-identical to the three kernels.
  uint64_t state_seed = 0;
  const int32_t* positions = nullptr;
  const void* A_log;        // [H]
  const void* D;            // [H]
  const void* dt_bias;      // [H]
  const void* norm_weight;  // [Di]
  DType act = DType::kF32, conv_weight_dtype = DType::kF32, conv_bias_dtype = DType::kF32;
  DType conv_state_dtype = DType::kF32, ssm_state_dtype = DType::kF32;
  DType a_log_dtype = DType::kF32, d_dtype = DType::kF32, dt_bias_dtype = DType::kF32;
  DType norm_weight_dtype = DType::kF32;
  float dt_min = 0.0f, dt_max = 0.0f, eps = 1e-5f;
  int batch = 0, H = 0, P = 0, N = 0, G = 0, K = 0;
  // CTAs per cluster (a divisor of H / G); 0: the launcher picks (mamba_decode_fused_cluster).
  int cluster = 0;
  // Load the slot's conv and SSM state before pdl_wait() (ops::mamba_decode_update's prefetch_states): only when the
  // previous kernel on the stream writes neither state.
  bool states_before_wait = false;
};

// The cluster size the fused kernel would run these sizes with, or 0 when it cannot (N not in {16, 32, 64, 128, 256},
// K not in {2, 3, 4}, a misaligned SSM state, a head slice too wide for one CTA, or no cluster of any divisor
// of H / G fits on the device): the caller then runs the three separate ops. Prefers one CTA per head (a
// cluster of H / G, non-portable above 8 when the device can schedule it), else the largest divisor <= 8.
// p.cluster, when set, is tried alone (benchmarks). Cached per kernel instance and size.
int mamba_decode_fused_cluster(const MambaDecodeParams& p);

// Launches on `stream` (cudaLaunchKernelEx: cluster dims, plus programmatic dependent launch when
// device::pdl_enabled()). Throws (naming ops::mamba_decode_update) when the sizes do not fit (see above).
void launch_mamba_decode_fused(const MambaDecodeParams& p, cudaStream_t stream);

// Per SSM state dtype (explicit instantiations in mamba_decode_fused_{f32,bf16,f16}.cu): with launch = false only
// the cluster size is returned.
template <typename S>
int mamba_decode_fused_typed(const MambaDecodeParams& p, cudaStream_t stream, bool launch);

}  // namespace chimera::cuda
