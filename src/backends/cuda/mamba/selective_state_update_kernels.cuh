// Kernels of the selective state update (see selective_state_update.cuh for the math), templated on the
// state element type S; included by the per-dtype instantiation files only.
//
// Fast kernel (FlashInfer's "simple" SSU kernel design, with its dim-tiled grid for small batches):
//   grid (ceil(P / rows_per_block), H, batch), 4 warps (heads of one slot are adjacent in memory, so blocks
//   dispatched together stream through contiguous state). A state row S[p, :] is N contiguous elements; a group
//   of kLanesPerRow lanes covers one row with 16-byte vectors (fp32 N=128: 32 lanes x 4 floats; bf16 N=128:
//   16 lanes x 8 bf16, two rows per warp pass). Each warp owns kRowsPerWarp consecutive rows and issues all
//   their state loads before the first use (kRowsPerWarp / kRowsPerPass independent 16-byte loads in flight
//   per lane), then updates, writes back (streaming stores: the state is touched once per step) and reduces
//   y over the row's lanes with xor shuffles. dt, dA and D are per-head scalars; B, C come from L1/L2.
//   Rows per warp: about 2 KB of state per warp (fp32 N=128: 4 rows, bf16: 8: enough loads in flight per warp at
//   batch 64 and 256 without spilling), halved while the grid would leave SMs idle (FlashInfer's
//   dim-tiling rule: tile when there are fewer than 2 blocks per SM).
// Persistent kernel (SsuKernel::kPersistent): the same lane mapping and math (identical bits), but a resident
//   grid (occupancy x SMs, 4 warps a block) in which warp w walks the contiguous run of units
//   [w * U / W, (w + 1) * U / W) of the U = batch * H * ceil(P / kUnitRows) units (sequence, head, row tile),
//   tile fastest. A unit is kUnitRows = 4096 / (N * sizeof(S)) rows: 4 KB of state (bf16 N = 128: 16
//   rows, 128 bytes a lane). Two register buffers: the next unit's state loads (and its x, dt_raw) are issued
//   before the current unit's update, stores and reduction, so every warp keeps a unit of loads in flight
//   (16 warps / SM x 4 KB = 64 KB+ per SM) across the whole step: no per-block launch, slot look-up or
//   prologue between the loads, and one tail for the grid instead of one per block. Consecutive units of a
//   warp share the sequence (slot looked up once per sequence), mostly the head (dt, dA recomputed when it
//   changes) and the group (B, C reloaded when it changes: every H / G * P / kUnitRows units).
// Portable kernel: any P, N, alignment: a warp per row, lanes stride over N.
// Out of place (SsuParams::dst_slots): every kernel reads slot slots[b] and stores to slot dst_slots[b] instead, with
// the same math (same bits); the fast kernels are instantiated per mode (kOop), the portable one picks at run time.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <type_traits>

#include "backends/cuda/launch.cuh"
#include "backends/cuda/mamba/mamba_common.cuh"
#include "backends/cuda/mamba/selective_state_update.cuh"

namespace chimera::cuda {
namespace ssu {

using mamba::discretize_dt;
using cuda::load_elem;
using mamba::load_param;
using mamba::Pack;
using mamba::store_elem;

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;

// How a row of N state elements maps onto lanes.
template <typename S, int N>
struct Layout {
  static constexpr int kVecElems = 16 / static_cast<int>(sizeof(S));  // elements per 16-byte vector
  static constexpr int kLanesPerRow = N / kVecElems < 32 ? N / kVecElems : 32;
  static constexpr int kVecsPerLane = N / (kVecElems * kLanesPerRow);
  static constexpr int kRowsPerPass = 32 / kLanesPerRow;
  static constexpr int kElemsPerLane = kVecsPerLane * kVecElems;
  static_assert(kVecsPerLane * kVecElems * kLanesPerRow == N, "N must be a multiple of 32 vectors or fit a warp");
};

// Per-head scalars shared by both kernels: the weights' part (dt_bias, A = -exp(A_log), D), read before
// pdl_wait() since nothing writes them during a step, then dt and dA from this step's dt_raw.
struct HeadWeights {
  float dt_bias, A, d_skip;
};

struct HeadScalars {
  float dt, dA, d_skip;
};

__device__ __forceinline__ HeadWeights head_weights(const SsuParams& p, int h) {
  return {load_param(p.dt_bias, p.dt_bias_dtype, h), -expf(load_param(p.A_log, p.a_log_dtype, h)),
          load_param(p.D, p.d_dtype, h)};
}

__device__ __forceinline__ HeadScalars head_scalars(const SsuParams& p, const HeadWeights& w, int b, int h) {
  HeadScalars s;
  const float raw = load_elem(p.dt_raw, p.act, static_cast<int64_t>(b) * p.H + h);
  s.dt = discretize_dt(raw + w.dt_bias, p.dt_min, p.dt_max);
  s.dA = expf(s.dt * w.A);
  s.d_skip = w.d_skip;
  return s;
}

// The slot sequence b's updated state is written to (SsuParams::dst_slots): dst_slots[b] out of place (kOop), else its
// source slot. The fast kernels take kOop as a template parameter (the launchers pick on dst_slots), so the in-place
// kernels are the code they were (same registers) and the out-of-place ones carry no branch on the pointer. The
// persistent kernels read it per unit just before the stores (a cached line: consecutive units share the sequence);
// reading it at issue time into the unit's registers spilled more (ptxas -v).
template <bool kOop>
__device__ __forceinline__ int dst_slot(const SsuParams& p, int b, int slot) {
  if constexpr (kOop) {
    return p.dst_slots[b];
  } else {
    return slot;
  }
}

// One 16-byte vector of a state row updated in place (s = s * dA + dt * x * B at the lane's columns, vector v of the
// row) and its part of y (s * C) added to acc: the inner step of the grid kernel, both persistent kernels and the
// fused decode kernel. The callers write st back themselves (a shared store changed the PTX's compares).
// An F16 state is rounded stochastically (mamba::round_state's bits): sr_key is the sequence's key, sr_e0 the slot
// element index of the lane's first column in the row ((h * P + row) * N + seg * kVecElems); both unused otherwise.
// One 32-bit hash covers the two elements of a pair (ssm_rounding_bits), so the loop takes them two at a time.
template <typename L, typename S, int kE>
__device__ __forceinline__ void update_state_vec(Pack<S, L::kVecElems>& st, int v, float dA, float dtx,
                                                 const float (&Bv)[kE], const float (&Cv)[kE], float& acc,
                                                 uint64_t sr_key = 0, uint32_t sr_e0 = 0) {
  if constexpr (std::is_same_v<S, __half>) {
    static_assert(L::kVecElems % 2 == 0, "pairs of f16 elements");
    const uint32_t e_base = sr_e0 + static_cast<uint32_t>(v * L::kLanesPerRow * L::kVecElems);  // even
#pragma unroll
    for (int e = 0; e < L::kVecElems; e += 2) {
      const float s0 = fmaf(st.get(e), dA, dtx * Bv[v * L::kVecElems + e]);
      const float s1 = fmaf(st.get(e + 1), dA, dtx * Bv[v * L::kVecElems + e + 1]);
      const uint32_t r = counter_bits32(sr_key, (e_base + static_cast<uint32_t>(e)) >> 1);
      st.set_bits(e, f32_to_f16_stochastic(s0, r & 0xffffu));
      st.set_bits(e + 1, f32_to_f16_stochastic(s1, r >> 16));
      acc = fmaf(s0, Cv[v * L::kVecElems + e], acc);
      acc = fmaf(s1, Cv[v * L::kVecElems + e + 1], acc);
    }
  } else {
    (void)sr_key, (void)sr_e0;
#pragma unroll
    for (int e = 0; e < L::kVecElems; ++e) {
      const float s = fmaf(st.get(e), dA, dtx * Bv[v * L::kVecElems + e]);
      st.set(e, s);
      acc = fmaf(s, Cv[v * L::kVecElems + e], acc);
    }
  }
}

// The rounding key of sequence b (F16 states only; 0 otherwise, never read).
template <typename S>
__device__ __forceinline__ uint64_t ssu_key(const SsuParams& p, int b) {
  if constexpr (std::is_same_v<S, __half>) {
    return mamba::state_key(p.state_seed, p.positions, b);
  } else {
    return 0;
  }
}

// y of a state row: the sum of its kLanesPerRow lanes' partial dot products (xor shuffles, every lane gets it).
template <typename L>
__device__ __forceinline__ float reduce_row(float acc) {
#pragma unroll
  for (int off = L::kLanesPerRow / 2; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  return acc;
}

// state: [num_slots, H, P, N] S; see the file comment for the mapping.
// The state loads and stores carry cache-streaming hints (each state byte is touched once per step).
// kOop: the new state goes to slot dst_slots[b] (dst_slot above).
template <typename S, int N, int kRowsPerWarp, bool kOop>
__device__ __forceinline__ void selective_state_update_body(const SsuParams& p) {
  using L = Layout<S, N>;
  static_assert(kRowsPerWarp % L::kRowsPerPass == 0, "rows per warp must be whole passes");
  constexpr int kPasses = kRowsPerWarp / L::kRowsPerPass;
  constexpr int kE = L::kElemsPerLane;
  const int h = blockIdx.y, b = blockIdx.z;
  const HeadWeights hw = head_weights(p, h);
  pdl_wait();  // PDL: slots, dt_raw, x, B, C and the state are step data (earlier kernels' outputs)
  pdl_trigger();
  const int slot = p.slots[b];
  if (slot < 0) return;  // pad: y and state untouched
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int seg = lane % L::kLanesPerRow, sub = lane / L::kLanesPerRow;
  const int g = h / (p.H / p.G);
  const int row0 = blockIdx.x * (kWarps * kRowsPerWarp) + warp * kRowsPerWarp + sub;

  S* state = static_cast<S*>(p.state) + (static_cast<int64_t>(slot) * p.H + h) * p.P * N;
  // 1. All of this lane's state vectors first: kPasses * kVecsPerLane 16-byte loads in flight.
  Pack<S, L::kVecElems> st[kPasses][L::kVecsPerLane];
#pragma unroll
  for (int i = 0; i < kPasses; ++i) {
    const int row = row0 + i * L::kRowsPerPass;
#pragma unroll
    for (int v = 0; v < L::kVecsPerLane; ++v) {
      if (row < p.P) {
        st[i][v].template load<true>(state + static_cast<int64_t>(row) * N + (v * L::kLanesPerRow + seg) * L::kVecElems);
      } else {
        st[i][v].zero();
      }
    }
  }
  // 2. Where the new state goes (in place: the source slot, the code as before kOop), per-head scalars, x of this
  // lane's rows, B and C at this lane's columns (tiny, cached).
  S* dst = state;
  if constexpr (kOop) dst = static_cast<S*>(p.state) + (static_cast<int64_t>(p.dst_slots[b]) * p.H + h) * p.P * N;
  const HeadScalars hs = head_scalars(p, hw, b, h);
  const int64_t xrow = (static_cast<int64_t>(b) * p.H + h) * p.P;
  float xv[kPasses];
#pragma unroll
  for (int i = 0; i < kPasses; ++i) {
    const int row = row0 + i * L::kRowsPerPass;
    xv[i] = row < p.P ? load_elem(p.x, p.act, xrow + row) : 0.0f;
  }
  const int64_t bc = (static_cast<int64_t>(b) * p.G + g) * N;
  float Bv[kE], Cv[kE];
#pragma unroll
  for (int v = 0; v < L::kVecsPerLane; ++v) {
#pragma unroll
    for (int e = 0; e < L::kVecElems; ++e) {
      const int col = (v * L::kLanesPerRow + seg) * L::kVecElems + e;
      Bv[v * L::kVecElems + e] = load_elem(p.B, p.act, bc + col);
      Cv[v * L::kVecElems + e] = load_elem(p.C, p.act, bc + col);
    }
  }
  // 3. Update, write back, reduce y over the row's lanes.
  const uint64_t sr_key = ssu_key<S>(p, b);
#pragma unroll
  for (int i = 0; i < kPasses; ++i) {
    const int row = row0 + i * L::kRowsPerPass;
    const float dtx = hs.dt * xv[i];
    const uint32_t sr_e0 = static_cast<uint32_t>((h * p.P + row) * N + seg * L::kVecElems);
    float acc = 0.0f;
#pragma unroll
    for (int v = 0; v < L::kVecsPerLane; ++v) {
      update_state_vec<L>(st[i][v], v, hs.dA, dtx, Bv, Cv, acc, sr_key, sr_e0);
      if (row < p.P) {
        st[i][v].template store<true>(dst + static_cast<int64_t>(row) * N + (v * L::kLanesPerRow + seg) * L::kVecElems);
      }
    }
    acc = reduce_row<L>(acc);
    if (seg == 0 && row < p.P) store_elem(p.y, p.act, xrow + row, acc + hs.d_skip * xv[i]);
  }
}

template <typename S, int N, int kRowsPerWarp, bool kOop>
__global__ void __launch_bounds__(kThreads) selective_state_update_kernel(const SsuParams p) {
  selective_state_update_body<S, N, kRowsPerWarp, kOop>(p);
}

// ---- persistent kernel ----------------------------------------------------------------------------
// Resident blocks per SM the persistent kernel is compiled for (registers: two buffers of 128 bytes of state
// a lane, plus B, C at the lane's columns and the unit bookkeeping): 16 warps / SM (128 registers).
inline constexpr int kPersistUnitBytes = 4096;
inline constexpr int kPersistMinBlocks = 4;

// One unit in flight: where it is and what was loaded for it (state, this lane's x, the head's dt_raw).
template <typename S, int N, int kUnitRows>
struct PersistUnit {
  using L = Layout<S, N>;
  static constexpr int kPasses = kUnitRows / L::kRowsPerPass;
  int b, h, row0, slot;  // slot < 0: a pad sequence, nothing loaded or stored
  float x;               // x[b, h, row0 + lane % kUnitRows] (lanes past P: 0)
  float dt_raw;
  Pack<S, L::kVecElems> st[kPasses][L::kVecsPerLane];
};

// Unit u of a persistent walk: sequence b, head h, first row row0 and the state slot; the slot id is read once per
// sequence (slot_b / slot_id carry the last lookup).
template <int kUnitRows, typename U>
__device__ __forceinline__ void locate_unit(const SsuParams& p, int u, int tiles, int& slot_b, int& slot_id, U& un) {
  const int bh = u / tiles;
  un.row0 = (u - bh * tiles) * kUnitRows;
  un.h = bh % p.H;
  un.b = bh / p.H;
  if (un.b != slot_b) {
    slot_b = un.b;
    slot_id = p.slots[un.b];
  }
  un.slot = slot_id;
}

// The rest of a unit's loads, issued after its state's: this lane's x (row row0 + lane % kUnitRows, 0 past P) and
// the head's dt_raw.
template <int kUnitRows, typename U>
__device__ __forceinline__ void load_unit_x_dt(const SsuParams& p, int lane, U& un) {
  const int64_t bh_i = static_cast<int64_t>(un.b) * p.H + un.h;
  const int xr = un.row0 + lane % kUnitRows;
  un.x = xr < p.P ? load_elem(p.x, p.act, bh_i * p.P + xr) : 0.0f;
  un.dt_raw = load_elem(p.dt_raw, p.act, bh_i);
}

// The unit's head scalars and its group's B / C slice for both persistent kernels, reloaded only when the head
// (hs_key = b * H + h) or the group (bc_key = b * G + g) changes: consecutive units of one warp mostly share them.
// head_scalars() with the prefetched dt_raw: the same expressions, so the same bits as the grid kernel.
template <typename L, int N, int kE>
__device__ __forceinline__ void refresh_unit_inputs(const SsuParams& p, int b, int h, float dt_raw, int heads_per_group,
                                                    int seg, int& hs_key, HeadScalars& hs, int& bc_key,
                                                    float (&Bv)[kE], float (&Cv)[kE]) {
  const int bh_i = b * p.H + h;
  if (bh_i != hs_key) {
    hs_key = bh_i;
    const HeadWeights hw = head_weights(p, h);
    hs.dt = discretize_dt(dt_raw + hw.dt_bias, p.dt_min, p.dt_max);
    hs.dA = expf(hs.dt * hw.A);
    hs.d_skip = hw.d_skip;
  }
  const int bg = b * p.G + h / heads_per_group;
  if (bg != bc_key) {
    bc_key = bg;
#pragma unroll
    for (int v = 0; v < L::kVecsPerLane; ++v) {
#pragma unroll
      for (int e = 0; e < L::kVecElems; ++e) {
        const int col = (v * L::kLanesPerRow + seg) * L::kVecElems + e;
        Bv[v * L::kVecElems + e] = load_elem(p.B, p.act, static_cast<int64_t>(bg) * N + col);
        Cv[v * L::kVecElems + e] = load_elem(p.C, p.act, static_cast<int64_t>(bg) * N + col);
      }
    }
  }
}

// SsuSplit::kDynamic's counters, per device and per state dtype (one module per instantiation file), one pair per
// host thread slot (SsuParams::dynamic_slot, as the MoE router's tickets): [0] the next chunk, [1] warps done. The
// grid's last warp resets both, so every call (and every graph replay) starts from zero.
inline constexpr int kSsuDynamicSlots = 64;
static __device__ unsigned int g_ssu_dynamic[kSsuDynamicSlots][2];

// grid (resident blocks), kThreads; see the file comment. kUnitRows <= 32 (x is one value a lane).
// kDynamic: SsuSplit::kDynamic (chunks of units from a device counter) instead of a static run per warp.
// kOop: the new state goes to slot dst_slots[b] (dst_slot above).
template <typename S, int N, int kUnitRows, int kMinBlocks, bool kDynamic, bool kOop>
__global__ void __launch_bounds__(kThreads, kMinBlocks) selective_state_update_persistent_kernel(const SsuParams p) {
  using L = Layout<S, N>;
  using Unit = PersistUnit<S, N, kUnitRows>;
  constexpr int kPasses = Unit::kPasses;
  constexpr int kE = L::kElemsPerLane;
  static_assert(kUnitRows % L::kRowsPerPass == 0 && kUnitRows <= 32, "a unit is whole passes, <= 32 rows");
  pdl_wait();  // PDL: slots, dt_raw, x, B, C and the state are step data; nothing constant is worth preloading
  pdl_trigger();
  const int lane = threadIdx.x % 32;
  const int seg = lane % L::kLanesPerRow, sub = lane / L::kLanesPerRow;
  // 32-bit unit indices (the launcher checks units < 2^31): fewer registers and cheaper divisions.
  const int tiles = (p.P + kUnitRows - 1) / kUnitRows;
  const int64_t units = static_cast<int64_t>(p.batch) * p.H * tiles;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  const int64_t w = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  // Static split: this warp's run [u_begin, u_end). kDynamic: u_end is the end of the chunk being walked.
  int u_begin = 0, u_end = 0;
  if constexpr (!kDynamic) {
    u_begin = static_cast<int>(w * units / warps);
    u_end = static_cast<int>((w + 1) * units / warps);
  }
  const int heads_per_group = p.H / p.G;

  int slot_b = -1, slot_id = -1;  // the slot of sequence slot_b (looked up once per sequence)
  // Issue unit u's loads into `un` (warp-uniform control flow).
  auto issue = [&](Unit& un, int u) {
    locate_unit<kUnitRows>(p, u, tiles, slot_b, slot_id, un);
    if (un.slot < 0) return;
    const S* state = static_cast<const S*>(p.state) + (static_cast<int64_t>(un.slot) * p.H + un.h) * p.P * N;
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const int row = un.row0 + i * L::kRowsPerPass + sub;
#pragma unroll
      for (int v = 0; v < L::kVecsPerLane; ++v) {
        if (row < p.P) {
          un.st[i][v].template load<true>(state + static_cast<int64_t>(row) * N +
                                          (v * L::kLanesPerRow + seg) * L::kVecElems);
        } else {
          un.st[i][v].zero();
        }
      }
    }
    load_unit_x_dt<kUnitRows>(p, lane, un);
  };

  int hs_key = -1, bc_key = -1;  // b * H + h of hs, b * G + g of Bv / Cv
  HeadScalars hs{0.0f, 0.0f, 0.0f};
  float Bv[kE], Cv[kE];
#pragma unroll
  for (int e = 0; e < kE; ++e) Bv[e] = Cv[e] = 0.0f;
  // Update, write back and reduce unit `un` (its loads were issued one unit earlier).
  auto process = [&](const Unit& un) {
    if (un.slot < 0) return;  // pad: y and state untouched
    const int bh_i = un.b * p.H + un.h;
    refresh_unit_inputs<L, N>(p, un.b, un.h, un.dt_raw, heads_per_group, seg, hs_key, hs, bc_key, Bv, Cv);
    const int dst_id = dst_slot<kOop>(p, un.b, un.slot);
    S* state = static_cast<S*>(p.state) + (static_cast<int64_t>(dst_id) * p.H + un.h) * p.P * N;
    const uint64_t sr_key = ssu_key<S>(p, un.b);
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const int row = un.row0 + i * L::kRowsPerPass + sub;
      const float xv = __shfl_sync(0xffffffffu, un.x, i * L::kRowsPerPass + sub);
      const float dtx = hs.dt * xv;
      const uint32_t sr_e0 = static_cast<uint32_t>((un.h * p.P + row) * N + seg * L::kVecElems);
      float acc = 0.0f;
      Pack<S, L::kVecElems> st[L::kVecsPerLane];
#pragma unroll
      for (int v = 0; v < L::kVecsPerLane; ++v) {
        st[v] = un.st[i][v];
        update_state_vec<L>(st[v], v, hs.dA, dtx, Bv, Cv, acc, sr_key, sr_e0);
        if (row < p.P) {
          st[v].template store<true>(state + static_cast<int64_t>(row) * N +
                                     (v * L::kLanesPerRow + seg) * L::kVecElems);
        }
      }
      acc = reduce_row<L>(acc);
      if (seg == 0 && row < p.P) store_elem(p.y, p.act, static_cast<int64_t>(bh_i) * p.P + row, acc + hs.d_skip * xv);
    }
  };
  // One step of the walk: unit `cur` (loaded one step earlier) is finished and, if `more`, unit `next` is
  // issued into the other buffer first (its loads in flight during cur's math).
  auto step = [&](Unit& cur, Unit& nxt, bool more, int next) {
    if (more) issue(nxt, next);
    process(cur);
  };

  Unit a, c;  // two register buffers, used alternately (static indexing keeps them in registers)
  if constexpr (!kDynamic) {
    if (u_begin >= u_end) return;
    int u = u_begin;
    issue(a, u);
    while (true) {
      step(a, c, u + 1 < u_end, u + 1);
      if (++u >= u_end) break;
      step(c, a, u + 1 < u_end, u + 1);
      if (++u >= u_end) break;
    }
  } else {
    // Chunks of `chunk` units in index order from this slot's g_ssu_dynamic[.][0]; a warp grabs its next chunk
    // when it issues the unit after its current chunk's last (one unit ahead, like the loads).
    const int chunk = p.dynamic_chunk > 0 ? p.dynamic_chunk : 2;
    const int units32 = static_cast<int>(units);  // < 2^31 (the launcher checks): one register fewer
    const unsigned int chunks = static_cast<unsigned int>((units + chunk - 1) / chunk);
    auto grab = [&]() -> int {  // first unit of a new chunk (u_end its end), or -1 when none is left
      unsigned int k = 0;
      if (lane == 0) k = atomicAdd(&g_ssu_dynamic[p.dynamic_slot][0], 1u);
      k = __shfl_sync(0xffffffffu, k, 0);
      if (k >= chunks) return -1;
      const int first = static_cast<int>(k) * chunk;
      u_end = min(first + chunk, units32);
      return first;
    };
    auto next_of = [&](int u) { return u + 1 < u_end ? u + 1 : grab(); };
    int u = grab();
    if (u >= 0) {
      issue(a, u);
      while (true) {
        int n = next_of(u);
        step(a, c, n >= 0, n);
        if (n < 0) break;
        u = n;
        n = next_of(u);
        step(c, a, n >= 0, n);
        if (n < 0) break;
        u = n;
      }
    }
    // Every warp arrives once, after its last grab; the last one resets the counters for the next call (which
    // reads them only after its pdl_wait(), i.e. after this grid completed).
    if (lane == 0) {
      __threadfence();
      if (atomicAdd(&g_ssu_dynamic[p.dynamic_slot][1], 1u) == static_cast<unsigned int>(warps) - 1) {
        __threadfence();
        atomicExch(&g_ssu_dynamic[p.dynamic_slot][0], 0u);
        atomicExch(&g_ssu_dynamic[p.dynamic_slot][1], 0u);
      }
    }
  }
}

// SsuSplit::kEqualWarps: the fewest rounds, then as few warps as fill them, so every warp walks the same number
// of units (the last ones maybe one fewer). kDynamic: every resident slot (the kernel hands out chunks).
template <typename Kernel>
void launch_persistent_grid(Kernel* kernel, int per_sm, int64_t units, size_t smem, const SsuParams& p,
                            cudaStream_t stream) {
  if (units >= (int64_t{1} << 31)) {
    throw_runtime(
        str_cat("ops::selective_state_update: ", units, " persistent units exceed 2^31 (use the grid kernel)"));
  }
  int64_t resident_warps = static_cast<int64_t>(per_sm) * kWarps * sm_count();
  if (p.persist_warps > 0) resident_warps = std::min<int64_t>(resident_warps, p.persist_warps);
  int64_t blocks = 0;
  if (p.split == SsuSplit::kEqualWarps) {
    const int64_t rounds = ceil_div(units, resident_warps);
    blocks = ceil_div(ceil_div(units, rounds), int64_t{kWarps});
  } else {  // kDynamic: every resident slot, no more warps than units
    blocks = ceil_div(std::min(resident_warps, units), int64_t{kWarps});
  }
  launch(kernel, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), smem, stream, p);
}

template <typename S, int N, int kUnitBytes, bool kDynamic, bool kOop>
void launch_persistent_bytes(const SsuParams& p, cudaStream_t stream) {
  constexpr int kRows = kUnitBytes / (N * static_cast<int>(sizeof(S)));
  constexpr int kMinBlocks = kPersistMinBlocks;
  auto* kernel = selective_state_update_persistent_kernel<S, N, kRows, kMinBlocks, kDynamic, kOop>;
  static const int per_sm =
      mamba::resident_blocks_per_sm(kernel, kThreads, 0, "ops::selective_state_update (occupancy)");
  launch_persistent_grid(kernel, per_sm, static_cast<int64_t>(p.batch) * p.H * ceil_div(p.P, kRows), 0, p, stream);
}

template <typename S, int N, int kUnitBytes, bool kOop>
void launch_persistent_oop(const SsuParams& p, cudaStream_t stream) {
  if (p.split == SsuSplit::kDynamic) return launch_persistent_bytes<S, N, kUnitBytes, true, kOop>(p, stream);
  launch_persistent_bytes<S, N, kUnitBytes, false, kOop>(p, stream);
}

template <typename S, int N, int kUnitBytes>
void launch_persistent_unit(const SsuParams& p, cudaStream_t stream) {
  if (p.dst_slots != nullptr) return launch_persistent_oop<S, N, kUnitBytes, true>(p, stream);
  launch_persistent_oop<S, N, kUnitBytes, false>(p, stream);
}

template <typename S, int N>
void launch_persistent(const SsuParams& p, cudaStream_t stream) {
  launch_persistent_unit<S, N, kPersistUnitBytes>(p, stream);
}

// Portable: grid (ceil(P / kWarps), H, batch); warp w of block x handles row x * kWarps + w.
template <typename S>
__global__ void __launch_bounds__(kThreads) selective_state_update_portable_kernel(const SsuParams p) {
  const int h = blockIdx.y, b = blockIdx.z;
  const HeadWeights hw = head_weights(p, h);
  pdl_wait();  // PDL: as in the fast kernel
  pdl_trigger();
  const int slot = p.slots[b];
  const int row = blockIdx.x * kWarps + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (slot < 0 || row >= p.P) return;  // warp-uniform
  const int g = h / (p.H / p.G);
  const HeadScalars hs = head_scalars(p, hw, b, h);
  const int64_t xi = (static_cast<int64_t>(b) * p.H + h) * p.P + row;
  const float dtx = hs.dt * load_elem(p.x, p.act, xi);
  const S* st = static_cast<const S*>(p.state) + ((static_cast<int64_t>(slot) * p.H + h) * p.P + row) * p.N;
  const int dst_id = p.dst_slots != nullptr ? p.dst_slots[b] : slot;  // not a hot kernel: a runtime choice
  S* dst = static_cast<S*>(p.state) + ((static_cast<int64_t>(dst_id) * p.H + h) * p.P + row) * p.N;
  const int64_t bc = (static_cast<int64_t>(b) * p.G + g) * p.N;
  const uint64_t sr_key = ssu_key<S>(p, b);
  const uint32_t e0 = static_cast<uint32_t>((h * p.P + row) * p.N);
  float acc = 0.0f;
  for (int n = lane; n < p.N; n += 32) {
    const float s = fmaf(to_float(st[n]), hs.dA, dtx * load_elem(p.B, p.act, bc + n));
    dst[n] = mamba::round_state<S>(s, sr_key, e0 + static_cast<uint32_t>(n));
    acc = fmaf(s, load_elem(p.C, p.act, bc + n), acc);
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (lane == 0) store_elem(p.y, p.act, xi, acc + hs.d_skip * load_elem(p.x, p.act, xi));
}

template <typename S, int N, int kRowsPerWarp>
void launch_fast(const SsuParams& p, cudaStream_t stream) {
  const dim3 grid(ceil_div(p.P, kWarps * kRowsPerWarp), p.H, p.batch);
  if (p.dst_slots != nullptr) {
    launch(selective_state_update_kernel<S, N, kRowsPerWarp, true>, grid, dim3(kThreads), 0, stream, p);
  } else {
    launch(selective_state_update_kernel<S, N, kRowsPerWarp, false>, grid, dim3(kThreads), 0, stream, p);
  }
}

template <typename S, int N>
void launch_fast_rows(const SsuParams& p, cudaStream_t stream) {
  int rows = p.rows_per_warp;
  if (rows == 0) {
    // ~2 KB of state per warp (a power of two in [4, 16]), halved while there are < 2 blocks per SM.
    rows = 4;
    while (rows < 16 && 2 * rows * N * static_cast<int>(sizeof(S)) <= 2048) rows *= 2;
    const int64_t sms = sm_count();
    while (rows > 4 && static_cast<int64_t>(p.batch) * p.H * ceil_div(p.P, kWarps * rows) < 2 * sms) rows /= 2;
  }
  switch (rows) {
    case 16:
      return launch_fast<S, N, 16>(p, stream);
    case 8:
      return launch_fast<S, N, 8>(p, stream);
    case 4:
      return launch_fast<S, N, 4>(p, stream);
    default:
      throw_runtime(str_cat("ops::selective_state_update: rows_per_warp ", rows, " is not supported (0, 4, 8, 16)"));
  }
}

}  // namespace ssu

// One counter slot per host thread (launches from one host thread are stream-ordered, as ops on one stream are).
inline int ssu_dynamic_slot() {
  static std::atomic<int> next{0};
  thread_local const int slot = next.fetch_add(1) % ssu::kSsuDynamicSlots;
  return slot;
}

template <typename S>
void launch_selective_state_update_typed(const SsuParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.H == 0 || p.P == 0) return;
  if (p.batch > 65535 || p.H > 65535) {
    throw_runtime(str_cat("ops::selective_state_update: batch ", p.batch, " or heads ", p.H, " exceeds 65535"));
  }
  const bool fast = mamba::aligned16(p.state) && (p.N == 64 || p.N == 128 || p.N == 256);
  // kAuto: the persistent kernel from batch 64, where it keeps more state bytes in flight than the grid kernel (a
  // larger share of the copy floor for both the Nano and Super head counts, bf16 and fp32 states), with the dynamic
  // split at N = 128 for f32 / bf16 states (SsuParams::auto_dynamic); the grid kernel below batch 64.
  const bool persistent = p.kernel == SsuKernel::kPersistent ||
                          (p.kernel == SsuKernel::kAuto && p.batch >= 64);
  if (fast && persistent) {
    SsuParams q = p;
    q.dynamic_slot = ssu_dynamic_slot();
    const bool dynamic_shape = p.N == 128 && (std::is_same_v<S, float> || std::is_same_v<S, __nv_bfloat16>);
    if (dynamic_shape && p.kernel == SsuKernel::kAuto && p.split == SsuSplit::kEqualWarps &&
        p.auto_dynamic) {
      q.kernel = SsuKernel::kPersistent;
      q.split = SsuSplit::kDynamic;
      q.dynamic_chunk = 4;
    }
    if (p.N == 64) {
      ssu::launch_persistent<S, 64>(q, stream);
    } else if (p.N == 128) {
      ssu::launch_persistent<S, 128>(q, stream);
    } else {
      ssu::launch_persistent<S, 256>(q, stream);
    }
  } else if (fast && p.N == 64) {
    ssu::launch_fast_rows<S, 64>(p, stream);
  } else if (fast && p.N == 128) {
    ssu::launch_fast_rows<S, 128>(p, stream);
  } else if (fast && p.N == 256) {
    ssu::launch_fast_rows<S, 256>(p, stream);
  } else {
    const dim3 grid(ceil_div(p.P, ssu::kWarps), p.H, p.batch);
    launch(ssu::selective_state_update_portable_kernel<S>, grid, dim3(ssu::kThreads), 0, stream, p);
  }
  CHIMERA_LAUNCH_CHECK("ops::selective_state_update");
}

}  // namespace chimera::cuda
