// Varlen causal conv1d prefill (conv1d.cuh for the math) and the ops:: adapters of both conv ops.
//
// Layout: x, out [T, C] channel-last, so a 16-byte vector holds E = 16 / sizeof(T) consecutive channels of one
// token. A block (4 warps) covers a tile of kConv1dTileRows = 32 tokens of one sequence times 4 * 8 * E
// channels; in a warp, lane = tc * 8 + cl: 8 channel lanes (8 x 16 B = one 128-byte line per token) times 4
// time lanes, each time lane owning kRows = 8 consecutive tokens in registers (8 independent vector loads in
// flight). The window slides along time in registers. The K-1 inputs left of a lane's first token are the
// last K-1 tokens of the time lane before it: a warp shuffle up by 8 lanes, four 32-bit words per 16-byte
// pack. Only time lane 0 reads its left inputs from memory: the previous tile's rows (L1/L2 hits)
// or, at the sequence start, the conv state, issued while the tile's own loads are in flight. Weights and
// bias go through the read-only cache, as 16-byte vectors when they are in the activation dtype;
// two outputs per step with independent FMA chains; SiLU with __expf and an approximate divide
// Grid: channel blocks fastest, so concurrently running blocks stream whole token rows.
//
// Final state: the tile at the sequence start, time lane 0, writes the last K-1 inputs of the sequence into
// the slot after reading the old state into registers itself, so no other block touches that slot (slots
// are distinct) and there is no read/write race inside the launch.
#include <algorithm>

#include "backends/cuda/cuda_ops.h"
#include "backends/cuda/launch.cuh"
#include "backends/cuda/mamba/conv1d.cuh"
#include "backends/cuda/mamba/mamba_common.cuh"

namespace chimera::cuda {
namespace conv {

using cuda::load_elem;
using mamba::Pack;
using mamba::silu_fast;
using mamba::store_elem;

constexpr int kRows = 8;       // tokens per lane
constexpr int kTimeLanes = 4;  // lanes along time in a warp
constexpr int kChanLanes = 8;  // lanes along channels in a warp
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
static_assert(kRows * kTimeLanes == kConv1dTileRows, "a tile is the time lanes' tokens");
static_assert(kTimeLanes * kChanLanes == 32, "a warp is time lanes x channel lanes");

// A sequence's final conv state, written by the lane that starts it (time lane 0 of its first tile / unit, whose
// halo holds the old state): the last K-1 inputs of old_state ++ x[0 .. len) for channels c0 .. c0 + E - 1.
// x points at the sequence's first row, channel c0.
template <typename T, int K, int E>
__device__ __forceinline__ void store_final_state(const Conv1dParams& p, const T* x, int64_t C, int64_t c0, int len,
                                                  int64_t slot, const float (&halo)[K - 1][E]) {
#pragma unroll
  for (int j = 0; j < K - 1; ++j) {
    const int idx = len + j;  // position in old_state ++ x
    float v[E];
    if (idx >= K - 1) {
      Pack<T, E> xv;
      xv.load(x + static_cast<int64_t>(idx - (K - 1)) * C);
#pragma unroll
      for (int e = 0; e < E; ++e) v[e] = xv.get(e);
    } else {
#pragma unroll
      for (int e = 0; e < E; ++e) {
        v[e] = 0.0f;
#pragma unroll
        for (int i = 0; i < K - 1; ++i) v[e] = i == idx ? halo[i][e] : v[e];  // no dynamic register index
      }
    }
#pragma unroll
    for (int e = 0; e < E; ++e) store_elem(p.conv_state, p.state_dtype, (slot * C + c0 + e) * (K - 1) + j, v[e]);
  }
}

// grid (ceil(C / (kWarps * kChanLanes * E)), n_tiles): channel blocks fastest, so the blocks in flight
// together read whole token rows (contiguous memory). See the file comment for the rest.
template <typename T, int K, bool kVec>
__global__ void __launch_bounds__(kThreads, 4) causal_conv1d_kernel(const Conv1dParams p) {
  constexpr int E = kVec ? 16 / static_cast<int>(sizeof(T)) : 1;
  using XPack = Pack<T, E>;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int tc = lane / kChanLanes, cl = lane % kChanLanes;
  const int64_t C = p.C;
  const int64_t c0 = (static_cast<int64_t>(blockIdx.x) * (kWarps * kChanLanes) + warp * kChanLanes + cl) * E;
  const bool chan_ok = c0 < C;  // the vector path has C % E == 0: a pack is all in or all out
  // Taps and bias (L1 / L2 hits): constant weights, so loaded before pdl_wait, while the predecessor drains.
  float w[E][K], bias[E];
  mamba::load_taps<T, E, K>(p.weight, p.weight_dtype, p.bias, p.bias_dtype, p.taps_vec, chan_ok ? c0 : 0, w, bias);
  // The tile: before pdl_wait when the list is step metadata no kernel writes (Conv1dParams::tiles_before_wait),
  // which takes its round trip off the path tile -> x address -> x loads.
  Conv1dTile tile;
  if (p.tiles_before_wait) tile = p.tiles[blockIdx.y];
  pdl_wait();  // PDL: x, slots and states are step data (the tile list too, unless tiles_before_wait)
  pdl_trigger();
  if (!p.tiles_before_wait) tile = p.tiles[blockIdx.y];
  const int t_first = tile.t0 + tc * kRows;
  const T* x = static_cast<const T*>(p.x) + static_cast<int64_t>(tile.row_begin) * C + c0;
  T* out = static_cast<T*>(p.out) + static_cast<int64_t>(tile.row_begin) * C + c0;

  // 1. This lane's tokens: kRows independent vector loads, all issued before any use.
  XPack xr[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if (chan_ok && t_first + r < tile.len) {
      xr[r].load(x + static_cast<int64_t>(t_first + r) * C);
    } else {
      xr[r].zero();
    }
  }
  // 2. Time lane 0's left inputs (the previous tile's rows, or the conv state at the sequence start), in
  //    flight while the tokens above still are.
  float halo[K - 1][E];
#pragma unroll
  for (int i = 0; i < K - 1; ++i) {
#pragma unroll
    for (int e = 0; e < E; ++e) halo[i][e] = 0.0f;
  }
  if (tc == 0 && chan_ok) {
#pragma unroll
    for (int i = 0; i < K - 1; ++i) {
      const int t = tile.t0 - (K - 1) + i;  // < 0: still in the conv state
      if (t >= 0) {
        XPack v;
        v.load(x + static_cast<int64_t>(t) * C);
#pragma unroll
        for (int e = 0; e < E; ++e) halo[i][e] = v.get(e);
      } else {
#pragma unroll
        for (int e = 0; e < E; ++e) {
          halo[i][e] = load_elem(p.conv_state, p.state_dtype, (tile.slot * C + c0 + e) * (K - 1) + (K - 1) + t);
        }
      }
    }
  }
  // 3. Other time lanes: the last K-1 tokens of the time lane before, by warp shuffle.
#pragma unroll
  for (int i = 0; i < K - 1; ++i) {
    const XPack v = xr[kRows - (K - 1) + i].shfl_up(kChanLanes);
    if (tc != 0) {
#pragma unroll
      for (int e = 0; e < E; ++e) halo[i][e] = v.get(e);
    }
  }
  // hist(i) = input at t_first - (K-1) + i.
  auto hist = [&](int i, int e) -> float { return i < K - 1 ? halo[i][e] : xr[i - (K - 1)].get(e); };

  // 4. Two tokens per step, independent FMA chains (same order as the update kernel: bit-identical results).
#pragma unroll
  for (int r = 0; r < kRows; r += 2) {
    XPack o0, o1;
    o0.zero();
    o1.zero();
#pragma unroll
    for (int e = 0; e < E; ++e) {
      float a0 = bias[e], a1 = bias[e];
#pragma unroll
      for (int j = 0; j < K; ++j) {
        a0 = __fmaf_rn(w[e][j], hist(r + j, e), a0);
        a1 = __fmaf_rn(w[e][j], hist(r + 1 + j, e), a1);
      }
      if (p.silu) {
        a0 = silu_fast(a0);
        a1 = silu_fast(a1);
      }
      o0.set(e, a0);
      o1.set(e, a1);
    }
    if (chan_ok && t_first + r < tile.len) o0.store(out + static_cast<int64_t>(t_first + r) * C);
    if (chan_ok && t_first + r + 1 < tile.len) o1.store(out + static_cast<int64_t>(t_first + r + 1) * C);
  }

  // 5. Final state (sequence-start tile, time lane 0; its halo is the old state): the last K-1 of
  //    old_state ++ x[0 .. len).
  if (tile.t0 == 0 && tc == 0 && chan_ok) store_final_state<T, K, E>(p, x, C, c0, tile.len, tile.slot, halo);
}

// ---- persistent kernel (Conv1dParams::prefill_kernel == 2) ------------------------------------------
// Why: at 1K tokens (Super, 42 MB, ~10 us of copy time) the tile kernel spends ~5-6 us outside its steady
// state (bench/mamba_notes.md: the 1K / 8K / 32K graph times fit 1.26 x floor + 5.8 us): per-block
// prologues (tile look-up, taps), blocks whose loads all complete before any math and whose math runs with no
// loads in flight, and a ragged last wave. Here the grid is sized to the resident warps, every warp does the
// same number of units, and each keeps two units of loads in flight while it computes a third.
// Mapping: warp w owns channel group cg = w % n_cg (the tile kernel's lane layout: lane = tc * 8 + cl, 8
// channel lanes x E channels, 4 time lanes x kRowsL tokens; a unit = 4 * kRowsL tokens) and chunk w / n_cg
// of the unit list (n_tiles * 32 / (4 * kRowsL) units in tile-list order), an equal consecutive run. Warps
// that run together are adjacent channel groups at similar positions, so concurrent loads cover whole rows.
// Pipeline: a unit's rows go global -> shared with cp.async (16 bytes a lane a row, zero-filled past the
// sequence; no registers held while in flight), kStages = 3 stages a warp: units u+1 and u+2 in flight while u
// computes. Each lane reads back only its own rows, except time lane 0, which takes its left inputs from time
// lane 3's rows of the previous unit (still in its stage) when that unit is the same sequence's, else from x /
// the conv state (the tile kernel's loads); __syncwarp() orders those reads before the stage is refilled.
// Taps live in shared memory (one float4 per channel, read as a broadcast by the four time lanes) so the
// registers hold one unit's rows and left inputs. Same FMA order as the tile kernel: identical bits.
// Requires the tile list in conv1d_tiles order (a sequence's tiles consecutive, t0 ascending).
constexpr int kPersistStages = 3;

using mamba::cp_async16;
using mamba::cp_async_commit;
using mamba::cp_async_wait;

template <int kRowsL>
constexpr size_t persist_smem_bytes() {  // the dynamic part: the stages' rows
  return size_t{kPersistStages} * kWarps * kRowsL * 32 * 16;
}

// Resident blocks per SM (registers): 8 rows a lane need ~140 registers at bf16 K = 4, so 3 blocks (12 warps,
// 24 units = 96 KB in flight); 4 rows: 4 blocks.
template <int kRowsL>
constexpr int kPersistMinBlocks = kRowsL >= 8 ? 3 : 4;

template <typename T, int K, int kRowsL>
__global__ void __launch_bounds__(kThreads, kPersistMinBlocks<kRowsL>)
    causal_conv1d_persistent_kernel(const Conv1dParams p) {
  constexpr int E = 16 / static_cast<int>(sizeof(T));
  constexpr int kUnit = kTimeLanes * kRowsL;      // tokens per unit
  constexpr int kSub = kConv1dTileRows / kUnit;  // units per tile
  static_assert(kSub * kUnit == kConv1dTileRows && kRowsL >= K - 1, "a tile is whole units; a lane holds K-1 rows");
  using XPack = Pack<T, E>;
  extern __shared__ uint4 s_rows[];  // [kPersistStages][kWarps][kRowsL][32 lanes]
  __shared__ float4 s_w[kWarps][kChanLanes][E];
  __shared__ float s_b[kWarps][kChanLanes][E];
  __shared__ int4 s_meta[kWarps][kPersistStages];  // row_begin, len, t_base, slot of the unit in each stage
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int tc = lane / kChanLanes, cl = lane % kChanLanes;
  const int64_t C = p.C;
  const int64_t n_cg = (C + kChanLanes * E - 1) / (kChanLanes * E);
  const int64_t wid = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  const int64_t cg = wid % n_cg, chunk = wid / n_cg;
  const int64_t c0 = (cg * kChanLanes + cl) * E;
  const bool chan_ok = c0 < C;
  {  // taps and bias: constant weights, loaded before pdl_wait (they arrive while the predecessor drains)
    float w[E][K], bias[E];
    mamba::load_taps<T, E, K>(p.weight, p.weight_dtype, p.bias, p.bias_dtype, p.taps_vec, chan_ok ? c0 : 0, w, bias);
    if (tc == 0) {
#pragma unroll
      for (int e = 0; e < E; ++e) {
        s_w[warp][cl][e] = make_float4(w[e][0], w[e][1 % K], K > 2 ? w[e][2 % K] : 0.0f, K > 3 ? w[e][3 % K] : 0.0f);
        s_b[warp][cl][e] = bias[e];
      }
    }
    __syncwarp();
  }
  pdl_wait();  // PDL: the tile list, x, slots and states are step data
  pdl_trigger();
  if (chunk >= p.persist_chunks) return;
  const int64_t n_units = static_cast<int64_t>(p.n_tiles) * kSub;
  const int64_t u_begin = chunk * n_units / p.persist_chunks, u_end = (chunk + 1) * n_units / p.persist_chunks;
  if (u_begin >= u_end) return;
  auto rows_at = [&](int stage, int r, int l) -> uint4* {
    return s_rows + ((stage * kWarps + warp) * kRowsL + r) * 32 + l;
  };

  int64_t meta_base = -(int64_t{1} << 40);  // lane i holds tile meta_base + i of the list
  int32_t m_row = 0, m_len = 0, m_t0 = 0, m_slot = 0;
  // Unit u's rows -> stage (cp.async), its metadata -> s_meta. Warp-uniform; the caller commits the group.
  auto issue = [&](int64_t u, int stage) {
    const int64_t ti = u / kSub;
    if (ti < meta_base || ti >= meta_base + 32) {  // every 32 tiles of the run
      meta_base = ti;
      if (ti + lane < p.n_tiles) {
        const Conv1dTile t = p.tiles[ti + lane];
        m_row = t.row_begin, m_len = t.len, m_t0 = t.t0, m_slot = t.slot;
      }
    }
    const int src = static_cast<int>(ti - meta_base);
    const int32_t row_begin = __shfl_sync(0xffffffffu, m_row, src);
    const int32_t len = __shfl_sync(0xffffffffu, m_len, src);
    const int32_t t_base = __shfl_sync(0xffffffffu, m_t0, src) + static_cast<int32_t>(u - ti * kSub) * kUnit;
    const int32_t slot = __shfl_sync(0xffffffffu, m_slot, src);
    if (lane == 0) s_meta[warp][stage] = make_int4(row_begin, len, t_base, slot);
    const T* x = static_cast<const T*>(p.x) + static_cast<int64_t>(row_begin) * C + c0;
    const int t_first = t_base + tc * kRowsL;
#pragma unroll
    for (int r = 0; r < kRowsL; ++r) {
      const bool valid = chan_ok && t_first + r < len;
      const void* src = valid ? static_cast<const void*>(x + static_cast<int64_t>(t_first + r) * C) : p.x;
      cp_async16(rows_at(stage, r, lane), src, valid);
    }
  };

  issue(u_begin, 0);
  cp_async_commit();
  if (u_begin + 1 < u_end) issue(u_begin + 1, 1);
  cp_async_commit();
  int stage = 0;
  for (int64_t u = u_begin; u < u_end; ++u) {
    cp_async_wait<1>();  // every group but the newest: unit u's rows are in
    __syncwarp();        // ... for every lane (time lane 0 reads time lane 3's rows, lane 0 wrote s_meta)
    const int4 m = s_meta[warp][stage];
    const int32_t row_begin = m.x, len = m.y, t_base = m.z, slot = m.w;
    const int prev = stage == 0 ? kPersistStages - 1 : stage - 1;
    XPack xr[kRowsL];
#pragma unroll
    for (int r = 0; r < kRowsL; ++r) {
      const uint4 v = *rows_at(stage, r, lane);
      xr[r].w[0] = v.x, xr[r].w[1] = v.y, xr[r].w[2] = v.z, xr[r].w[3] = v.w;
    }
    // Left inputs: time lanes 1-3 from the lane 8 below (shuffle); time lane 0 from the previous unit's time
    // lane 3 when it is this sequence's unit just before (always so inside a run unless t_base == 0).
    const bool from_prev = u > u_begin && t_base > 0;
    float halo[K - 1][E];
#pragma unroll
    for (int i = 0; i < K - 1; ++i) {
      const XPack up = xr[kRowsL - (K - 1) + i].shfl_up(kChanLanes);
      XPack pv;
      pv.zero();
      if (tc == 0 && from_prev) {
        const uint4 v = *rows_at(prev, kRowsL - (K - 1) + i, lane + 3 * kChanLanes);
        pv.w[0] = v.x, pv.w[1] = v.y, pv.w[2] = v.z, pv.w[3] = v.w;
      }
#pragma unroll
      for (int e = 0; e < E; ++e) halo[i][e] = tc != 0 ? up.get(e) : pv.get(e);
    }
    __syncwarp();  // stage `prev` fully read before it is refilled
    if (u + 2 < u_end) issue(u + 2, prev);
    cp_async_commit();
    stage = stage + 1 == kPersistStages ? 0 : stage + 1;
    if (t_base >= len) continue;  // a sub-tile past a short sequence's end (warp-uniform)

    const T* x = static_cast<const T*>(p.x) + static_cast<int64_t>(row_begin) * C + c0;
    T* out = static_cast<T*>(p.out) + static_cast<int64_t>(row_begin) * C + c0;
    const int t_first = t_base + tc * kRowsL;
    if (tc == 0 && chan_ok && !from_prev) {  // the tile kernel's left-input loads
#pragma unroll
      for (int i = 0; i < K - 1; ++i) {
        const int t = t_base - (K - 1) + i;  // < 0: still in the conv state
        if (t >= 0) {
          XPack v;
          v.load(x + static_cast<int64_t>(t) * C);
#pragma unroll
          for (int e = 0; e < E; ++e) halo[i][e] = v.get(e);
        } else {
#pragma unroll
          for (int e = 0; e < E; ++e) {
            halo[i][e] = load_elem(p.conv_state, p.state_dtype, (slot * C + c0 + e) * (K - 1) + (K - 1) + t);
          }
        }
      }
    }
    auto hist = [&](int i, int e) -> float { return i < K - 1 ? halo[i][e] : xr[i - (K - 1)].get(e); };
#pragma unroll
    for (int r = 0; r < kRowsL; r += 2) {
      XPack o0, o1;
      o0.zero();
      o1.zero();
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const float4 wv = s_w[warp][cl][e];
        const float wj[4] = {wv.x, wv.y, wv.z, wv.w};
        float a0 = s_b[warp][cl][e], a1 = a0;
#pragma unroll
        for (int j = 0; j < K; ++j) {
          a0 = __fmaf_rn(wj[j], hist(r + j, e), a0);
          a1 = __fmaf_rn(wj[j], hist(r + 1 + j, e), a1);
        }
        if (p.silu) {
          a0 = silu_fast(a0);
          a1 = silu_fast(a1);
        }
        o0.set(e, a0);
        o1.set(e, a1);
      }
      if (chan_ok && t_first + r < len) o0.store(out + static_cast<int64_t>(t_first + r) * C);
      if (chan_ok && t_first + r + 1 < len) o1.store(out + static_cast<int64_t>(t_first + r + 1) * C);
    }
    // Final state: the tile kernel's step 5, by the sequence's first unit (its halo is the old state).
    if (t_base == 0 && tc == 0 && chan_ok) store_final_state<T, K, E>(p, x, C, c0, len, slot, halo);
  }
  cp_async_wait<0>();  // nothing is left in flight (the last groups are empty), but leave no copy behind
}

template <typename T, int K, int kRowsL>
void launch_persistent(const Conv1dParams& q, cudaStream_t stream) {
  constexpr int E = 16 / static_cast<int>(sizeof(T));
  constexpr int kSub = kConv1dTileRows / (kTimeLanes * kRowsL);
  constexpr size_t smem = persist_smem_bytes<kRowsL>();
  auto* kernel = causal_conv1d_persistent_kernel<T, K, kRowsL>;
  // The opt-in above 48 KB is per device: set it on every launch (a cheap host call), occupancy once.
  set_max_dynamic_smem(kernel, smem, "ops::causal_conv1d (persistent)");
  static const int per_sm = mamba::resident_blocks_per_sm(kernel, kThreads, smem, "ops::causal_conv1d (occupancy)");
  Conv1dParams p = q;
  const int64_t n_cg = ceil_div(p.C, int64_t{kChanLanes} * E);
  const int64_t n_units = static_cast<int64_t>(p.n_tiles) * kSub;  // per channel group
  const int64_t resident_warps = static_cast<int64_t>(per_sm) * kWarps * sm_count();
  int64_t max_chunks = std::max<int64_t>(1, resident_warps / n_cg);
  if (q.persist_chunks > 0) max_chunks = std::min<int64_t>(max_chunks, q.persist_chunks);
  // Every chunk the same number of units (the last maybe fewer), so the warps finish together.
  const int64_t rounds = ceil_div(n_units, max_chunks);
  p.persist_chunks = static_cast<int>(ceil_div(n_units, rounds));
  const int64_t blocks = ceil_div(n_cg * p.persist_chunks, int64_t{kWarps});
  launch(kernel, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), smem, stream, p);
}

template <typename T, int K>
void launch_typed(const Conv1dParams& p, cudaStream_t stream) {
  constexpr int E = 16 / static_cast<int>(sizeof(T));
  const bool vec = mamba::aligned16(p.x) && mamba::aligned16(p.out) && p.C % E == 0;
  const int per_block = kWarps * kChanLanes * (vec ? E : 1);
  const dim3 grid(static_cast<unsigned>(ceil_div(p.C, per_block)), static_cast<unsigned>(p.n_tiles));
  if (p.n_tiles > 65535) {
    throw_runtime(str_cat("ops::causal_conv1d: ", p.n_tiles, " tiles of ", kConv1dTileRows,
                          " tokens exceed 65535 (split the batch)"));
  }
  Conv1dParams q = p;
  q.taps_vec = vec && mamba::aligned16(p.weight) && p.weight_dtype == p.act &&
               (p.bias == nullptr || (mamba::aligned16(p.bias) && p.bias_dtype == p.act));
  if (vec && p.prefill_kernel == 2) {
    switch (p.prefill_persist_rows) {
      case 0:
      case 8:
        return launch_persistent<T, K, 8>(q, stream);
      case 4:
        return launch_persistent<T, K, 4>(q, stream);
      default:
        throw_runtime(str_cat("ops::causal_conv1d: prefill_persist_rows ", p.prefill_persist_rows,
                              " is not supported (0, 4, 8)"));
    }
  }
  if (vec) {
    launch(causal_conv1d_kernel<T, K, true>, grid, dim3(kThreads), 0, stream, q);
  } else {
    launch(causal_conv1d_kernel<T, K, false>, grid, dim3(kThreads), 0, stream, q);
  }
}

}  // namespace conv

std::vector<Conv1dTile> conv1d_tiles(std::span<const int32_t> cu_seqlens, std::span<const int32_t> slots) {
  std::vector<Conv1dTile> tiles;
  for (size_t s = 0; s < slots.size(); ++s) {
    if (slots[s] < 0) continue;
    const int32_t len = cu_seqlens[s + 1] - cu_seqlens[s];
    for (int32_t t0 = 0; t0 < len; t0 += kConv1dTileRows) tiles.push_back({cu_seqlens[s], len, t0, slots[s]});
  }
  return tiles;
}

void launch_causal_conv1d(const Conv1dParams& p, cudaStream_t stream) {
  if (p.n_tiles == 0 || p.C == 0) return;
  CHIMERA_DISPATCH_FLOAT(p.act, "ops::causal_conv1d x", T, {
    switch (p.K) {
      case 2:
        conv::launch_typed<T, 2>(p, stream);
        break;
      case 3:
        conv::launch_typed<T, 3>(p, stream);
        break;
      case 4:
        conv::launch_typed<T, 4>(p, stream);
        break;
      default:
        throw_runtime(str_cat("ops::causal_conv1d: conv_kernel ", p.K, " is not supported on CUDA (2, 3, 4)"));
    }
  });
  CHIMERA_LAUNCH_CHECK("ops::causal_conv1d");
}

namespace {

// Tensors -> Conv1dParams (everything but the batch metadata); one activation dtype per call.
Conv1dParams conv_params(const char* op, const Tensor& out, const Tensor& x, const Tensor& weight, const Tensor& bias,
                         const Tensor& conv_state, bool silu) {
  if (out.dtype() != x.dtype()) {
    throw_runtime(str_cat(op, ": out ", out.describe(), " and x ", x.describe(), " must share one dtype on CUDA"));
  }
  Conv1dParams p;
  p.x = x.data();
  p.out = out.data();
  p.weight = weight.data();
  p.bias = bias ? bias.data() : nullptr;
  p.conv_state = conv_state.data();
  p.act = x.dtype();
  p.weight_dtype = weight.dtype();
  p.bias_dtype = bias ? bias.dtype() : DType::kF32;
  p.state_dtype = conv_state.dtype();
  p.C = x.dim(1);
  p.K = static_cast<int>(weight.dim(-1));
  p.silu = silu;
  return p;
}

}  // namespace

void causal_conv1d(const ops::Context& ctx, const Tensor& out, const Tensor& x, const Tensor& weight, const Tensor& bias,
                   const Tensor& conv_state, std::span<const int32_t> cu_seqlens, std::span<const int32_t> slots,
                   bool silu) {
  Conv1dParams p = conv_params("ops::causal_conv1d", out, x, weight, bias, conv_state, silu);
  const auto* xo = static_cast<const char*>(x.data());
  const auto* oo = static_cast<const char*>(out.data());
  if (x.nbytes() > 0 && xo < oo + out.nbytes() && oo < xo + x.nbytes()) {
    throw_runtime("ops::causal_conv1d: out must not overlap x on CUDA (tiles read their neighbours' inputs)");
  }
  const std::vector<Conv1dTile> tiles = conv1d_tiles(cu_seqlens, slots);
  if (tiles.empty()) return;
  const cudaStream_t stream = as_stream(ctx.stream);
  p.tiles = static_cast<const Conv1dTile*>(
      upload_scratch(tiles.data(), tiles.size() * sizeof(Conv1dTile), stream, 0));
  p.n_tiles = static_cast<int>(tiles.size());
  p.tiles_before_wait = true;  // uploaded by a copy on the stream: no kernel writes the list
  launch_causal_conv1d(p, stream);
}

void causal_conv1d_update(const ops::Context& ctx, const Tensor& out, const Tensor& x, const Tensor& weight,
                          const Tensor& bias, const Tensor& conv_state, const ops::Indices& slots, bool silu) {
  Conv1dParams p = conv_params("ops::causal_conv1d_update", out, x, weight, bias, conv_state, silu);
  if (slots.empty()) return;
  const cudaStream_t stream = as_stream(ctx.stream);
  p.slots = device_indices(slots, stream, 0);
  p.batch = static_cast<int>(slots.size());
  p.slots_before_wait = true;  // ops::Indices: step metadata, never a kernel's output
  launch_causal_conv1d_update(p, stream);
}

}  // namespace chimera::cuda
