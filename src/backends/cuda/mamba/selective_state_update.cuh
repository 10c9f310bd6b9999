// Mamba-2 decode step, the selective state update (docs/model.md 3.5), for a batch of state
// slots. Per sequence b and head h (group g = h / (H / G)):
//   dt = clamp(softplus(dt_raw[b, h] + dt_bias[h]), dt_min, dt_max);  dA = exp(dt * -exp(A_log[h]))
//   S[p, n] = S[p, n] * dA + dt * x[b, h, p] * B[b, g, n]            (state read once, written once)
//   y[b, h, p] = sum_n S[p, n] * C[b, g, n] + D[h] * x[b, h, p]
// Memory-bound: the state read + write is nearly all the traffic. Math in fp32 whatever the storage dtypes.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.h"

namespace chimera::cuda {

// Which fast kernel runs (benchmarks and tests pick; the ops:: adapter leaves kAuto).
//   kGrid: a block per (row tile, head, sequence), FlashInfer's simple kernel design with its dim-tiled grid.
//   kPersistent: a resident grid; each warp walks a contiguous run of (sequence, head, row tile) units and
//     issues the next unit's state loads before the current unit's math and stores (double-buffered in
//     registers), so a warp always has a unit of state in flight and no block launches, slot look-ups or
//     per-block prologues sit between the loads.
enum class SsuKernel : int8_t { kAuto, kGrid, kPersistent };

// kPersistent only: how the units are split over the warps (same bits: each unit is computed alike).
//   kEqualWarps: the fewest rounds, then as few warps as fill them (every warp the same unit count, but some SMs
//     a block short when the count is not a multiple of the resident blocks).
//   kDynamic: every resident slot; warps take chunks of dynamic_chunk units from a device counter (finish within
//     one chunk of each other whatever their speed). The counter is reset by the last warp; one counter pair per
//     host thread (dynamic_slot), so the calls of one host thread must be stream-ordered (as ops on one stream
//     are). kAuto takes it (chunks of 4) from batch 64 at N = 128 with an f32 or bf16 state, where warps of one
//     SM run at different speeds and a static split leaves the slowest warp's run on the critical path.
enum class SsuSplit : int8_t { kEqualWarps, kDynamic };

struct SsuParams {
  const void* x;       // [batch, H, P]   act dtype
  const void* dt_raw;  // [batch, H]      act dtype
  const void* B;       // [batch, G, N]   act dtype
  const void* C;       // [batch, G, N]   act dtype
  void* y;             // [batch, H, P]   act dtype
  void* state;         // [num_slots, H, P, N] state dtype, updated in place (or out of place: dst_slots)
  const int32_t* slots;  // [batch] device; slot < 0: skipped (y rows and state untouched)
  // [batch] device, or nullptr (the default): in place. When set, sequence b reads its state from slot slots[b] and
  // writes the updated state to slot dst_slots[b] of the same pool, leaving slots[b] as it was (speculative decoding
  // keeps the old state for rollback; benchmarks: an out-of-place write moves the same bytes). The skip rule stays
  // keyed on slots[b]: slots[b] < 0 skips the row whatever dst_slots[b] holds; otherwise dst_slots[b] must be a valid
  // slot that no other sequence reads or writes (dst_slots[b] == slots[b] is that row in place). Same bits for y and
  // the new state as the in-place update, in every kernel.
  const int32_t* dst_slots = nullptr;
  // F16 state: stochastic rounding (core/stochastic_rounding.h) keyed by state_seed and each sequence's position
  // positions[b] (device, [batch]; nullptr: 0 for every row). Unused for F32 / BF16 states (round to nearest even).
  uint64_t state_seed = 0;
  const int32_t* positions = nullptr;
  const void* A_log;     // [H] a_log_dtype
  const void* D;         // [H] d_dtype
  const void* dt_bias;   // [H] dt_bias_dtype
  DType act = DType::kF32, state_dtype = DType::kF32;
  DType a_log_dtype = DType::kF32, d_dtype = DType::kF32, dt_bias_dtype = DType::kF32;
  float dt_min = 0.0f, dt_max = 0.0f;
  int batch = 0, H = 0, P = 0, N = 0, G = 0;
  // Rows of P per warp in the fast kernel: 0 picks by occupancy (FlashInfer's dim tiling for small batches);
  // 4, 8 or 16 force one (benchmarks).
  int rows_per_warp = 0;
  // kAuto: the persistent kernel from batch 64, the grid kernel below.
  SsuKernel kernel = SsuKernel::kAuto;
  // kAuto at N = 128 with an f32 or bf16 state: the persistent kernel's dynamic split in chunks of 4 units
  // (ops::KernelConfig::ssu_dynamic_split); false keeps the equal static split. Same bits.
  bool auto_dynamic = true;
  // Persistent kernels: 0 = the resident warps; > 0 caps the warps (tests: long runs at small sizes).
  int persist_warps = 0;
  // kPersistent only: the work split (SsuSplit above).
  SsuSplit split = SsuSplit::kEqualWarps;
  int dynamic_chunk = 0;  // kDynamic: units per grab, 0 = 2
  // kDynamic: which of the device's counter pairs the call uses; set by the launcher (one per host thread).
  int dynamic_slot = 0;
};

// Launches the update on `stream`. Fast path: N in {64, 128, 256} with a 16-byte aligned state (16-byte
// vector state access, one row segment per lane group, shuffle reduction; p.kernel picks the grid or a
// persistent kernel, which compute identical bits); otherwise a portable warp-per-row kernel. Throws (naming
// ops::selective_state_update) on unsupported dtypes or launch errors.
void launch_selective_state_update(const SsuParams& p, cudaStream_t stream);

// Per state dtype (explicit instantiations in selective_state_update_{f32,bf16,f16}.cu).
template <typename S>
void launch_selective_state_update_typed(const SsuParams& p, cudaStream_t stream);

}  // namespace chimera::cuda
