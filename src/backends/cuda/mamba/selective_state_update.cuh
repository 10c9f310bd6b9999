// Mamba-2 decode step, the selective state update (model-spec 3.5; seed section 6), for a batch of state
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
//   kGrid: a block per (row tile, head, sequence), the seed's simple kernel with its dim-tiled grid.
//   kPersistent: a resident grid; each warp walks a contiguous run of (sequence, head, row tile) units and
//     issues the next unit's state loads before the current unit's math and stores (double-buffered in
//     registers), so a warp always has a unit of state in flight and no block launches, slot look-ups or
//     per-block prologues sit between the loads.
//   kPersistentAsync: the same walk with the state staged global -> shared by cp.async, three stages a warp
//     (two units in flight during the math, no registers held by data in flight).
enum class SsuKernel : int8_t { kAuto, kGrid, kPersistent, kPersistentAsync };

// kPersistent only, benchmarks (issue 3, the batch-64 gap): how the state is read and written. Every choice
// computes the same bits; only the memory hints change. Non-default values need N = 128 (the models' N).
//   kStream: ld.global.cs / st.global.cs (the default).
//   kNoAllocate: ld / st .L1::no_allocate, L2 normal priority (the write-back lines age out as any other).
//   kEvictFirst: L1::no_allocate and an L2 policy createpolicy.fractional.L2::evict_first 1.0 on the loads and
//     the stores (sm_90's only route to L2 evict_first on a 16-byte access), so the state stream is the first
//     victim and the small inputs (x, dt, B, C, slots, weights) stay in L2.
//   kLoad256B: the kEvictFirst loads with .L2::256B (the L2 fetches whole 256-byte DRAM bursts), .cs stores.
//   kPlainStore: .cs loads, plain write-back stores (L2 as a write-combining buffer at normal priority).
//   kL2Prefetch: the default access plus cp.async.bulk.prefetch.L2 of unit u + 1 + l2_prefetch_units while
//     unit u + 1 is issued (more bytes in flight without registers; same sequence only).
enum class SsuStateHint : int8_t { kStream, kNoAllocate, kEvictFirst, kLoad256B, kPlainStore, kL2Prefetch };

// kPersistent only, benchmarks: where a unit's stores sit in a warp's instruction stream (same bits).
//   kInterleaved: next unit's loads, then per row: update, store, reduce (the default).
//   kBunchedStores: next unit's loads, the whole unit's update and y, then its stores back to back.
//   kLoadsAfterMath: the unit's update and y, then the next unit's loads, then its stores (the read requests
//     reach DRAM ahead of the write-backs).
enum class SsuStoreOrder : int8_t { kInterleaved, kBunchedStores, kLoadsAfterMath };

// kPersistent only, benchmarks: how the units are split over the warps (same bits: each unit is computed alike).
//   kEqualWarps: the fewest rounds, then as few warps as fill them (the default: every warp the same unit
//     count, but some SMs a block short when the count is not a multiple of the resident blocks).
//   kFullGrid: every resident slot (blocks_per_sm x SMs blocks), units spread +-1 over the warps (equal bytes
//     per SM, last round partial).
//   kDynamic: the full grid; warps take chunks of dynamic_chunk units from a device counter (finish within one
//     chunk of each other whatever their speed). The counter is reset by the last warp; one counter pair per host
//     thread (dynamic_slot), so the calls of one host thread must be stream-ordered (as ops on one stream are).
//     kAuto takes it (chunks of 4) from batch 64 at N = 128 with an f32 or bf16 state: measured +4 to +7 points.
enum class SsuSplit : int8_t { kEqualWarps, kFullGrid, kDynamic };

struct SsuParams {
  const void* x;       // [batch, H, P]   act dtype
  const void* dt_raw;  // [batch, H]      act dtype
  const void* B;       // [batch, G, N]   act dtype
  const void* C;       // [batch, G, N]   act dtype
  void* y;             // [batch, H, P]   act dtype
  void* state;         // [num_slots, H, P, N] state dtype, updated in place
  const int32_t* slots;  // [batch] device; slot < 0: skipped (y rows and state untouched)
  const void* A_log;     // [H] a_log_dtype
  const void* D;         // [H] d_dtype
  const void* dt_bias;   // [H] dt_bias_dtype
  DType act = DType::kF32, state_dtype = DType::kF32;
  DType a_log_dtype = DType::kF32, d_dtype = DType::kF32, dt_bias_dtype = DType::kF32;
  float dt_min = 0.0f, dt_max = 0.0f;
  int batch = 0, H = 0, P = 0, N = 0, G = 0;
  // Rows of P per warp in the fast kernel: 0 picks by occupancy (the seed's dim tiling for small batches);
  // 4, 8 or 16 force one (benchmarks).
  int rows_per_warp = 0;
  // Plain loads / stores of the state instead of the cache-streaming ones (benchmarks; grid kernel only).
  bool plain_state_access = false;
  // kAuto: the persistent kernel from batch 64, the grid kernel below (measured: bench/mamba_notes.md).
  SsuKernel kernel = SsuKernel::kAuto;
  // Persistent kernels: bytes of state per warp unit (rows = unit_bytes / (N * sizeof(state))): 0 = 4096,
  // or 2048 (more resident warps, half the registers / shared memory each).
  int unit_bytes = 0;
  // Persistent kernels: 0 = the resident warps; > 0 caps the warps (tests: long runs at small sizes).
  int persist_warps = 0;
  // kPersistent only (benchmarks; see the enums above): state access hints, store order, work split.
  SsuStateHint state_hint = SsuStateHint::kStream;
  SsuStoreOrder store_order = SsuStoreOrder::kInterleaved;
  SsuSplit split = SsuSplit::kEqualWarps;
  int dynamic_chunk = 0;          // kDynamic: units per grab, 0 = 2
  int l2_prefetch_units = 0;      // kL2Prefetch: distance beyond the register prefetch, 0 = 1
  int persist_blocks_per_sm = 0;  // 0 = occupancy; 1..occupancy caps the resident blocks (4 warps each) per SM
  // kPersistent, default hint and order (N = 128, f32 / bf16 state): the kernel compiled for 3 or 4 resident
  // blocks (register cap 168 / 128) instead of 4 (4 KB units) / 5 (2 KB, cap 102) (0). The bf16-state defaults
  // spill at their cap (ptxas -v: 4 KB 40 B, 2 KB 16 B; no spill at 3 / 4 blocks: 155 / 119 registers), the fp32
  // ones do not.
  int persist_min_blocks = 0;
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
