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
  // The tile: before pdl_wait, as the list is step metadata no kernel writes (Conv1dParams::tiles), which takes its
  // round trip off the path tile -> x address -> x loads.
  const Conv1dTile tile = p.tiles[blockIdx.y];
  pdl_wait();  // PDL: x, slots and states are step data
  pdl_trigger();
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

// One thread per (channel, checkpoint): the K-1 inputs before the cut, from x where the cut is at least that many
// rows in, else partly from the sequence's state (which the prefill launched after this one then overwrites).
__global__ void conv1d_checkpoints_kernel(Conv1dParams p, const Conv1dCheckpoint* cps) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= p.C) return;
  const Conv1dCheckpoint k = cps[blockIdx.y];
  const int W = p.K - 1;
  for (int j = 0; j < W; ++j) {
    const int t = k.rows - W + j;  // relative to the sequence's first new row
    const float v = t >= 0 ? load_elem(p.x, p.act, (static_cast<int64_t>(k.row_begin) + t) * p.C + c)
                           : load_elem(p.conv_state, p.state_dtype, (k.src_slot * p.C + c) * W + W + t);
    mamba::store_elem(p.conv_state, p.state_dtype, (k.dst_slot * p.C + c) * W + j, v);
  }
}

}  // namespace

void launch_conv1d_checkpoints(const Conv1dParams& p, const Conv1dCheckpoint* checkpoints, int n, cudaStream_t stream) {
  if (n == 0 || p.C == 0 || p.K < 2) return;
  constexpr int kThreadsPerBlock = 256;
  const dim3 grid(static_cast<unsigned>((p.C + kThreadsPerBlock - 1) / kThreadsPerBlock), static_cast<unsigned>(n));
  conv1d_checkpoints_kernel<<<grid, kThreadsPerBlock, 0, stream>>>(p, checkpoints);
  CHIMERA_LAUNCH_CHECK("ops::causal_conv1d (checkpoints)");
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

void causal_conv1d(const ops::Context& ctx, const Tensor& out, const Tensor& x, const Tensor& weight,
                   const Tensor& bias, const Tensor& conv_state, std::span<const int32_t> cu_seqlens,
                   std::span<const int32_t> slots, bool silu, std::span<const ops::StateCheckpoint> checkpoints) {
  Conv1dParams p = conv_params("ops::causal_conv1d", out, x, weight, bias, conv_state, silu);
  const auto* xo = static_cast<const char*>(x.data());
  const auto* oo = static_cast<const char*>(out.data());
  if (x.nbytes() > 0 && xo < oo + out.nbytes() && oo < xo + x.nbytes()) {
    throw_runtime("ops::causal_conv1d: out must not overlap x on CUDA (tiles read their neighbours' inputs)");
  }
  const std::vector<Conv1dTile> tiles = conv1d_tiles(cu_seqlens, slots);
  if (tiles.empty()) return;
  const cudaStream_t stream = as_stream(ctx.stream);
  if (!checkpoints.empty()) {
    std::vector<Conv1dCheckpoint> cps;
    for (const ops::StateCheckpoint& k : checkpoints) {
      const auto s = static_cast<size_t>(k.seq);
      cps.push_back({cu_seqlens[s], k.rows, slots[s], k.slot});
    }
    launch_conv1d_checkpoints(p,
                              static_cast<const Conv1dCheckpoint*>(
                                  upload_scratch(cps.data(), cps.size() * sizeof(Conv1dCheckpoint), stream, 1)),
                              static_cast<int>(cps.size()), stream);
  }
  p.tiles = static_cast<const Conv1dTile*>(
      upload_scratch(tiles.data(), tiles.size() * sizeof(Conv1dTile), stream, 0));
  p.n_tiles = static_cast<int>(tiles.size());
  launch_causal_conv1d(p, stream);
}

void causal_conv1d_update(const ops::Context& ctx, const Tensor& out, const Tensor& x, const Tensor& weight,
                          const Tensor& bias, const Tensor& conv_state, const ops::Indices& slots, bool silu,
                          const ops::Indices& dst_slots) {
  Conv1dParams p = conv_params("ops::causal_conv1d_update", out, x, weight, bias, conv_state, silu);
  if (slots.empty()) return;
  const cudaStream_t stream = as_stream(ctx.stream);
  p.slots = device_indices(slots, stream, 0);
  p.dst_slots = dst_slots.empty() ? nullptr : device_indices(dst_slots, stream, 1);
  p.batch = static_cast<int>(slots.size());
  launch_causal_conv1d_update(p, stream);
}

}  // namespace chimera::cuda
