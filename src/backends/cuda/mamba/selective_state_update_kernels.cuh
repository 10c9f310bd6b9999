// Kernels of the selective state update (see selective_state_update.cuh for the math), templated on the
// state element type S; included by the per-dtype instantiation files only.
//
// Fast kernel (the seed's "simple" kernel, 6.4.1, with its dim-tiled grid for small batches):
//   grid (ceil(P / rows_per_block), H, batch), 4 warps (heads of one slot are adjacent in memory, so blocks
//   dispatched together stream through contiguous state). A state row S[p, :] is N contiguous elements; a group
//   of kLanesPerRow lanes covers one row with 16-byte vectors (fp32 N=128: 32 lanes x 4 floats; bf16 N=128:
//   16 lanes x 8 bf16, two rows per warp pass). Each warp owns kRowsPerWarp consecutive rows and issues all
//   their state loads before the first use (kRowsPerWarp / kRowsPerPass independent 16-byte loads in flight
//   per lane), then updates, writes back (streaming stores: the state is touched once per step) and reduces
//   y over the row's lanes with xor shuffles. dt, dA and D are per-head scalars; B, C come from L1/L2.
//   Rows per warp: about 2 KB of state per warp (fp32 N=128: 4 rows, bf16: 8; measured best on the H200 at
//   batch 64 and 256, see bench/mamba_notes.md), halved while the grid would leave SMs idle (the seed's
//   dim-tiling rule: tile when there are fewer than 2 blocks per SM).
// Portable kernel: any P, N, alignment: a warp per row, lanes stride over N.
#pragma once

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

// Rounding to the activation dtype (runtime) for the hf_rounding instances.
struct RoundAct {
  DType act;
  __device__ __forceinline__ float operator()(float v) const { return mamba::round_dtype(v, act); }
};

template <bool kHf = false>
__device__ __forceinline__ HeadScalars head_scalars(const SsuParams& p, const HeadWeights& w, int b, int h) {
  HeadScalars s;
  const float raw = load_elem(p.dt_raw, p.act, static_cast<int64_t>(b) * p.H + h);
  if constexpr (kHf) {
    s.dt = mamba::discretize_dt_hf(raw, w.dt_bias, p.dt_min, p.dt_max, RoundAct{p.act});
  } else {
    s.dt = discretize_dt(raw + w.dt_bias, p.dt_min, p.dt_max);
  }
  s.dA = expf(s.dt * w.A);
  s.d_skip = w.d_skip;
  return s;
}

// state: [num_slots, H, P, N] S; see the file comment for the mapping.
// kStream: cache-streaming hints on the state loads and stores (default; the plain variant is a benchmark).
// kHf: transformers' rounding points (SsuParams::hf_rounding).
template <typename S, int N, int kRowsPerWarp, bool kStream, bool kHf = false>
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
        st[i][v].template load<kStream>(state + static_cast<int64_t>(row) * N + (v * L::kLanesPerRow + seg) * L::kVecElems);
      } else {
        st[i][v].zero();
      }
    }
  }
  // 2. Per-head scalars, x of this lane's rows, B and C at this lane's columns (tiny, cached).
  const HeadScalars hs = head_scalars<kHf>(p, hw, b, h);
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
  [[maybe_unused]] const RoundAct round{p.act};
  [[maybe_unused]] float dBv[kHf ? kE : 1];  // hf: round(dt * B) per column
  if constexpr (kHf) {
#pragma unroll
    for (int e = 0; e < kE; ++e) dBv[e] = round(hs.dt * Bv[e]);
  }
  // 3. Update, write back, reduce y over the row's lanes.
#pragma unroll
  for (int i = 0; i < kPasses; ++i) {
    const int row = row0 + i * L::kRowsPerPass;
    [[maybe_unused]] const float dtx = hs.dt * xv[i];
    float acc = 0.0f;
#pragma unroll
    for (int v = 0; v < L::kVecsPerLane; ++v) {
#pragma unroll
      for (int e = 0; e < L::kVecElems; ++e) {
        if constexpr (kHf) {
          const float s = mamba::ssm_state_hf(st[i][v].get(e), hs.dA, dBv[v * L::kVecElems + e], xv[i], round);
          st[i][v].set(e, s);
          acc = fmaf(round(s), Cv[v * L::kVecElems + e], acc);
        } else {
          const float s = fmaf(st[i][v].get(e), hs.dA, dtx * Bv[v * L::kVecElems + e]);
          st[i][v].set(e, s);
          acc = fmaf(s, Cv[v * L::kVecElems + e], acc);
        }
      }
      if (row < p.P) {
        st[i][v].template store<kStream>(state + static_cast<int64_t>(row) * N + (v * L::kLanesPerRow + seg) * L::kVecElems);
      }
    }
#pragma unroll
    for (int off = L::kLanesPerRow / 2; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (seg == 0 && row < p.P) {
      const float y = kHf ? mamba::ssm_y_hf(acc, xv[i], hs.d_skip, round) : acc + hs.d_skip * xv[i];
      store_elem(p.y, p.act, xrow + row, y);
    }
  }
}

template <typename S, int N, int kRowsPerWarp, bool kHf>
__global__ void __launch_bounds__(kThreads) selective_state_update_kernel(const SsuParams p) {
  if constexpr (kHf) {
    selective_state_update_body<S, N, kRowsPerWarp, true, true>(p);
  } else if (p.plain_state_access) {
    selective_state_update_body<S, N, kRowsPerWarp, false>(p);
  } else {
    selective_state_update_body<S, N, kRowsPerWarp, true>(p);
  }
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
  const bool hf = p.hf_rounding;  // rare (a parity mode), and this kernel is the portable fallback: a runtime branch
  const HeadScalars hs = hf ? head_scalars<true>(p, hw, b, h) : head_scalars<false>(p, hw, b, h);
  const RoundAct round{p.act};
  const int64_t xi = (static_cast<int64_t>(b) * p.H + h) * p.P + row;
  const float xv = load_elem(p.x, p.act, xi);
  const float dtx = hs.dt * xv;
  S* st = static_cast<S*>(p.state) + ((static_cast<int64_t>(slot) * p.H + h) * p.P + row) * p.N;
  const int64_t bc = (static_cast<int64_t>(b) * p.G + g) * p.N;
  float acc = 0.0f;
  for (int n = lane; n < p.N; n += 32) {
    const float bn = load_elem(p.B, p.act, bc + n), cn = load_elem(p.C, p.act, bc + n);
    if (hf) {
      const float s = mamba::ssm_state_hf(to_float(st[n]), hs.dA, round(hs.dt * bn), xv, round);
      st[n] = from_float<S>(s);
      acc = fmaf(round(s), cn, acc);
    } else {
      const float s = fmaf(to_float(st[n]), hs.dA, dtx * bn);
      st[n] = from_float<S>(s);
      acc = fmaf(s, cn, acc);
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (lane == 0) store_elem(p.y, p.act, xi, hf ? mamba::ssm_y_hf(acc, xv, hs.d_skip, round) : acc + hs.d_skip * xv);
}

template <typename S, int N, int kRowsPerWarp>
void launch_fast(const SsuParams& p, cudaStream_t stream) {
  const dim3 grid(ceil_div(p.P, kWarps * kRowsPerWarp), p.H, p.batch);
  if (p.hf_rounding) {
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

template <typename S>
void launch_selective_state_update_typed(const SsuParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.H == 0 || p.P == 0) return;
  if (p.batch > 65535 || p.H > 65535) {
    throw_runtime(str_cat("ops::selective_state_update: batch ", p.batch, " or heads ", p.H, " exceeds 65535"));
  }
  const bool fast = mamba::aligned16(p.state) && (p.N == 64 || p.N == 128 || p.N == 256);
  if (fast && p.N == 64) {
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
