// The fused Mamba-2 decode kernel (mamba_decode_fused.cuh for the contract), templated on the activation type
// T, the SSM state type S and the state size N; included by the per-state-dtype instantiation files only.
//
// grid (G * cluster, batch), clusters of `cluster` CTAs along x, 256 threads. CTA rank r of group g's cluster
// owns heads g * hpg + r * hpc .. + hpc - 1 (hpg = H / G heads per group, hpc = hpg / cluster), i.e. nx = hpc * P
// contiguous x channels and the same slice of the norm group. Phases:
//   0. before pdl_wait: conv taps and bias of the CTA's channels, its slice of the norm weight (constants);
//   1. the first chunk of SSM state loads issued (in flight during the conv);
//   2. conv of nx x channels + the group's 2N B/C channels (thread per channel, the conv1d_update FMA order),
//      outputs rounded to T into shared memory; x-channel conv state written (owned), B/C next state staged;
//   3. cluster barrier: every CTA has read the old B/C conv state -> the B/C state is written, channel i by rank
//      i % cluster;
//   4. the selective state update of the CTA's heads in chunks of 64 rows (8 warps x 8 rows), with the lane
//      layout of selective_state_update_kernels.cuh (ssu::Layout, same FMA and shuffle order -> same bits for
//      N 64, 128, 256; N 16 and 32, which the SSU runs in its portable kernel, sum y in another order, the state
//      is still the same bits); y rounded to T into shared memory;
//   5. gated norm: u = y * silu(z); the CTA's sum of squares -> shared memory; cluster barrier; each CTA sums the
//      cluster's partials in rank order through distributed shared memory; out = w * (u * rsqrt(mean + eps)).
//   A final split barrier (arrive after the remote reads, wait before exit) keeps every CTA's shared memory alive
//   while the others read it.
#pragma once

#include <cooperative_groups.h>

#include <map>
#include <mutex>
#include <tuple>

#include "backends/cuda/launch.cuh"
#include "backends/cuda/mamba/mamba_common.cuh"
#include "backends/cuda/mamba/mamba_decode_fused.cuh"
#include "backends/cuda/mamba/selective_state_update_kernels.cuh"
#include "backends/cuda/norm/row_norm.cuh"

namespace chimera::cuda {
namespace mamba_fused {

namespace cg = cooperative_groups;
using cuda::load_elem;
using mamba::load_param;
using mamba::Pack;
using mamba::silu_fast;
using mamba::store_elem;

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
// State rows per warp in one pass of the SSU: 8 (a chunk of 64 rows per CTA), or one lane pass when a pass
// covers more rows (N 16 with a 16-bit state: 16 rows of two lanes).
template <typename S, int N>
constexpr int kRowsPerWarp = ssu::Layout<S, N>::kRowsPerPass > 8 ? ssu::Layout<S, N>::kRowsPerPass : 8;
constexpr int kMaxK = 4;                               // conv widths 2..4, as conv1d_update
constexpr int kConvIters = 4;                          // channels per thread: nx + 2N <= 1024
constexpr int kNormIters = 4;                          // head channels per thread: nx <= 1024
constexpr int kMaxChannels = kConvIters * kThreads;
constexpr int kMaxHeadChannels = kNormIters * kThreads;

// Dynamic shared memory: conv out [nx + 2N], y / u [nx], next B/C conv state [2N, K-1], all fp32.
inline size_t smem_bytes(int nx, int N, int K) {
  return sizeof(float) * static_cast<size_t>(2 * nx + 2 * N + 2 * N * (K - 1));
}

template <typename T, typename S, int N>
__global__ void __launch_bounds__(kThreads) mamba_decode_fused_kernel(const MambaDecodeParams p) {
  using L = ssu::Layout<S, N>;
  constexpr int kRows = kRowsPerWarp<S, N>;
  constexpr int kChunkRows = kWarps * kRows;
  static_assert(kRows % L::kRowsPerPass == 0, "rows per warp must be whole passes");
  constexpr int kPasses = kRows / L::kRowsPerPass;
  constexpr int kE = L::kElemsPerLane;

  const cg::cluster_group cluster = cg::this_cluster();
  const int cs = static_cast<int>(cluster.num_blocks());
  const int rank = static_cast<int>(cluster.block_rank());
  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
  const int b = static_cast<int>(blockIdx.y);
  const int g = static_cast<int>(blockIdx.x) / cs;
  const int hpg = p.H / p.G, hpc = hpg / cs;
  const int head0 = g * hpg + rank * hpc;
  const int P = p.P, K = p.K;
  const int nx = hpc * P;        // this CTA's x channels = its slice of the norm group
  const int nch = nx + 2 * N;    // + the group's B and C channels
  const int64_t Di = static_cast<int64_t>(p.H) * P;
  const int64_t Cd = Di + 2 * static_cast<int64_t>(p.G) * N;
  const int64_t ld = Di + Cd + p.H;  // in_proj row: z | xBC | dt_raw

  extern __shared__ float smem[];
  float* conv_out = smem;         // [nch]: x (head0.., P each), B, C, each rounded to T
  float* y_s = conv_out + nch;    // [nx]: y rounded to T
  float* bc_next = y_s + nx;      // [2N, K-1]: the group's next B/C conv state
  __shared__ float warp_ss[kWarps];
  __shared__ float cta_ss;

  // xBC channel of the CTA's conv index i.
  const auto channel = [&](int i) -> int64_t {
    if (i < nx) return static_cast<int64_t>(head0) * P + i;
    if (i < nx + N) return Di + static_cast<int64_t>(g) * N + (i - nx);
    return Di + static_cast<int64_t>(p.G + g) * N + (i - nx - N);
  };

  // 0. Constants only before the wait (launch.cuh's contract).
  float taps[kConvIters][kMaxK], cbias[kConvIters];
#pragma unroll
  for (int it = 0; it < kConvIters; ++it) {
    const int i = tid + it * kThreads;
    const int64_t c = i < nch ? channel(i) : 0;
#pragma unroll
    for (int j = 0; j < kMaxK; ++j) {
      taps[it][j] = i < nch && j < K ? load_param(p.conv_weight, p.conv_weight_dtype, c * K + j) : 0.0f;
    }
    cbias[it] = i < nch && p.conv_bias != nullptr ? load_param(p.conv_bias, p.conv_bias_dtype, c) : 0.0f;
  }
  float nw[kNormIters];
#pragma unroll
  for (int k = 0; k < kNormIters; ++k) {
    const int i = tid + k * kThreads;
    nw[k] = i < nx ? load_param(p.norm_weight, p.norm_weight_dtype, static_cast<int64_t>(head0) * P + i) : 0.0f;
  }

  // 1. The slot's states into registers: the first SSM state chunk (16-byte cache-streaming loads) and the CTA's
  // conv state taps, in flight during the conv. With p.states_before_wait ("two back", launch.cuh) they are loaded
  // before the wait, overlapping the predecessor (in_proj, which touches neither state; the slot ids are step
  // metadata, uploaded before the step's first kernel; the states were last written by this kernel in the previous
  // step); otherwise right after it.
  const int seg = lane % L::kLanesPerRow, sub = lane / L::kLanesPerRow;
  const int n_chunks = (P + kChunkRows - 1) / kChunkRows;
  int slot = -1;
  S* state_base = nullptr;
  Pack<S, L::kVecElems> st[kPasses][L::kVecsPerLane];
  const auto load_chunk = [&](int k) {
    const int hl = k / n_chunks, rb = (k % n_chunks) * kChunkRows;
    S* const state = state_base + static_cast<int64_t>(hl) * P * N;
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const int row = rb + warp * kRows + sub + i * L::kRowsPerPass;
#pragma unroll
      for (int v = 0; v < L::kVecsPerLane; ++v) {
        if (row < P) {
          st[i][v].template load<true>(state + static_cast<int64_t>(row) * N + (v * L::kLanesPerRow + seg) * L::kVecElems);
        } else {
          st[i][v].zero();
        }
      }
    }
  };
  float prev[kConvIters][kMaxK];  // the conv state taps of the CTA's channels
  const auto load_states = [&] {
    slot = p.slots[b];
    if (slot < 0) return;
    state_base = static_cast<S*>(p.ssm_state) + (static_cast<int64_t>(slot) * p.H + head0) * P * N;
    load_chunk(0);
#pragma unroll
    for (int it = 0; it < kConvIters; ++it) {
      const int i = tid + it * kThreads;
      const int64_t s0 = (static_cast<int64_t>(slot) * Cd + (i < nch ? channel(i) : 0)) * (K - 1);
#pragma unroll
      for (int j = 0; j < kMaxK; ++j) {
        prev[it][j] = i < nch && j < K - 1 ? load_elem(p.conv_state, p.conv_state_dtype, s0 + j) : 0.0f;
      }
    }
  };
  if (!p.states_before_wait) pdl_wait();
  load_states();  // one call site: two inlined copies made ptxas spill
  if (p.states_before_wait) pdl_wait();
  if (slot < 0) return;  // pad: the whole cluster (one sequence) leaves before any barrier
  pdl_trigger();

  // 2. Conv update + SiLU of the CTA's channels (conv1d_update.cu's order: bias, K-1 state taps, the new input).
  const T* const row_in = static_cast<const T*>(p.zxbcdt) + static_cast<int64_t>(b) * ld;
#pragma unroll
  for (int it = 0; it < kConvIters; ++it) {
    const int i = tid + it * kThreads;
    if (i >= nch) continue;
    const int64_t c = channel(i);
    const float xin = to_float<T>(row_in[Di + c]);
    const int64_t s0 = (static_cast<int64_t>(slot) * Cd + c) * (K - 1);
    float acc = cbias[it], w_last = 0.0f;
#pragma unroll
    for (int j = 0; j < kMaxK; ++j) {
      if (j < K - 1) acc = __fmaf_rn(taps[it][j], prev[it][j], acc);
      if (j == K - 1) w_last = taps[it][j];
    }
    acc = __fmaf_rn(w_last, xin, acc);
    conv_out[i] = round_to<T>(silu_fast(acc));
#pragma unroll
    for (int j = 0; j + 1 < kMaxK; ++j) {
      if (j >= K - 1) continue;
      const float next = j + 1 < K - 1 ? prev[it][j + 1] : xin;
      if (i < nx) {
        store_elem(p.conv_state, p.conv_state_dtype, s0 + j, next);  // this CTA's own channels
      } else {
        bc_next[(i - nx) * (K - 1) + j] = next;
      }
    }
  }
  // z of the CTA's slice for the norm (same row, read now so the load overlaps the barrier).
  float zv[kNormIters];
#pragma unroll
  for (int k = 0; k < kNormIters; ++k) {
    const int i = tid + k * kThreads;
    zv[k] = i < nx ? to_float<T>(row_in[static_cast<int64_t>(head0) * P + i]) : 0.0f;
  }

  // 3. Every CTA of the group has read the old B/C conv state (and conv_out is visible in this CTA).
  cluster.sync();
  for (int i = tid; i < 2 * N; i += kThreads) {
    if (i % cs != rank) continue;
    const int64_t s0 = (static_cast<int64_t>(slot) * Cd + channel(nx + i)) * (K - 1);
    for (int j = 0; j < K - 1; ++j) store_elem(p.conv_state, p.conv_state_dtype, s0 + j, bc_next[i * (K - 1) + j]);
  }

  // 4. Selective state update of the CTA's heads (selective_state_update_body's math and lane layout).
  float Bv[kE], Cv[kE];
#pragma unroll
  for (int v = 0; v < L::kVecsPerLane; ++v) {
#pragma unroll
    for (int e = 0; e < L::kVecElems; ++e) {
      const int col = (v * L::kLanesPerRow + seg) * L::kVecElems + e;
      Bv[v * L::kVecElems + e] = conv_out[nx + col];
      Cv[v * L::kVecElems + e] = conv_out[nx + N + col];
    }
  }
  uint64_t sr_key = 0;  // F16 state: the sequence's stochastic-rounding key (ssu::update_state_vec)
  if constexpr (std::is_same_v<S, __half>) sr_key = mamba::state_key(p.state_seed, p.positions, b);
  for (int k = 0; k < hpc * n_chunks; ++k) {
    const int hl = k / n_chunks, rb = (k % n_chunks) * kChunkRows, h = head0 + hl;
    if (k > 0) load_chunk(k);
    const float raw = to_float<T>(row_in[Di + Cd + h]);
    const float dt = mamba::discretize_dt(raw + load_param(p.dt_bias, p.dt_bias_dtype, h), p.dt_min, p.dt_max);
    const float A = -expf(load_param(p.A_log, p.a_log_dtype, h));
    const float dA = expf(dt * A);
    const float d_skip = load_param(p.D, p.d_dtype, h);
    S* const state = state_base + static_cast<int64_t>(hl) * P * N;
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const int row = rb + warp * kRows + sub + i * L::kRowsPerPass;
      const float xv = row < P ? conv_out[hl * P + row] : 0.0f;
      const float dtx = dt * xv;
      const uint32_t sr_e0 = static_cast<uint32_t>((h * P + row) * N + seg * L::kVecElems);
      float acc = 0.0f;
#pragma unroll
      for (int v = 0; v < L::kVecsPerLane; ++v) {
        ssu::update_state_vec<L>(st[i][v], v, dA, dtx, Bv, Cv, acc, sr_key, sr_e0);
        if (row < P) {
          st[i][v].template store<true>(state + static_cast<int64_t>(row) * N + (v * L::kLanesPerRow + seg) * L::kVecElems);
        }
      }
      acc = ssu::reduce_row<L>(acc);
      if (seg == 0 && row < P) y_s[hl * P + row] = round_to<T>(acc + d_skip * xv);
    }
  }
  __syncthreads();

  // 5. Gated grouped RMSNorm over the cluster's heads (row_norm.cuh kGated's math).
  float u[kNormIters];
  float ss = 0.0f;
#pragma unroll
  for (int k = 0; k < kNormIters; ++k) {
    const int i = tid + k * kThreads;
    u[k] = i < nx ? y_s[i] * norm::silu_f32(zv[k]) : 0.0f;
    ss += u[k] * u[k];
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, off);
  if (lane == 0) warp_ss[warp] = ss;
  __syncthreads();
  if (tid == 0) {
    float t = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) t += warp_ss[w];
    cta_ss = t;
  }
  cluster.sync();  // every CTA's partial is written
  float total = 0.0f;
  for (int r = 0; r < cs; ++r) total += *cluster.map_shared_rank(&cta_ss, static_cast<unsigned>(r));
  cluster_arrive_release();  // done with the other CTAs' shared memory
  const float inv = 1.0f / sqrtf(total / static_cast<float>(hpg * P) + p.eps);
  T* const out = static_cast<T*>(p.out) + static_cast<int64_t>(b) * Di + static_cast<int64_t>(head0) * P;
#pragma unroll
  for (int k = 0; k < kNormIters; ++k) {
    const int i = tid + k * kThreads;
    if (i < nx) out[i] = from_float<T>(nw[k] * (u[k] * inv));
  }
  cluster_wait_acquire();  // nobody leaves while a peer may still read its cta_ss
}

// Whether `cluster` CTAs of this kernel with `smem` bytes can be co-scheduled (cached: the occupancy query
// is not free and the answer does not change within a process).
template <typename T, typename S, int N>
bool cluster_fits(int cluster, size_t smem) {
  static std::mutex mu;
  static std::map<std::pair<int, size_t>, bool> cache;
  const std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_pair(cluster, smem);
  if (auto it = cache.find(key); it != cache.end()) return it->second;
  auto* kernel = mamba_decode_fused_kernel<T, S, N>;
  bool ok = true;
  if (cluster > 8) {
    ok = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) == cudaSuccess;
  }
  if (ok && smem > 48 * 1024) {
    ok = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)) ==
         cudaSuccess;
  }
  if (ok) ok = cluster_fits_once(kernel, static_cast<unsigned>(cluster), static_cast<unsigned>(kThreads), smem);
  (void)cudaGetLastError();  // a refused attribute is an answer, not a sticky error
  cache.emplace(key, ok);
  return ok;
}

// The cluster size for these sizes (see mamba_decode_fused_cluster), launching when `launch`.
template <typename T, typename S, int N>
int plan_or_launch(const MambaDecodeParams& p, cudaStream_t stream, bool launch) {
  const int hpg = p.H / p.G;
  int candidates[8];
  int n = 0;
  if (p.cluster > 0) {
    if (hpg % p.cluster == 0) candidates[n++] = p.cluster;
  } else {
    if (hpg > 8 && hpg <= 16) candidates[n++] = hpg;  // one CTA per head, non-portable
    for (int c = hpg < 8 ? hpg : 8; c >= 1 && n < 8; --c) {
      if (hpg % c == 0) candidates[n++] = c;
    }
  }
  for (int i = 0; i < n; ++i) {
    const int cs = candidates[i];
    const int nx = hpg / cs * p.P;
    if (nx > kMaxHeadChannels || nx + 2 * N > kMaxChannels) continue;
    const size_t smem = smem_bytes(nx, N, p.K);
    if (!cluster_fits<T, S, N>(cs, smem)) continue;
    if (launch) {
      const dim3 grid(static_cast<unsigned>(p.G * cs), static_cast<unsigned>(p.batch));
      CHIMERA_CUDA_CHECK(launch_cluster(mamba_decode_fused_kernel<T, S, N>, grid, dim3(kThreads), smem, stream,
                                        static_cast<unsigned>(cs), p),
                         "ops::mamba_decode_update");
    }
    return cs;
  }
  return 0;
}

}  // namespace mamba_fused

template <typename S>
int mamba_decode_fused_typed(const MambaDecodeParams& p, cudaStream_t stream, bool launch) {
  if (p.G <= 0 || p.H % p.G != 0 || p.K < 2 || p.K > mamba_fused::kMaxK || p.P <= 0) return 0;
  if (p.batch > 65535 || !mamba::aligned16(p.ssm_state)) return 0;
  int cs = 0;
  CHIMERA_DISPATCH_FLOAT(p.act, "ops::mamba_decode_update activations", T, {
    switch (p.N) {
      case 16:
        cs = mamba_fused::plan_or_launch<T, S, 16>(p, stream, launch);
        break;
      case 32:
        cs = mamba_fused::plan_or_launch<T, S, 32>(p, stream, launch);
        break;
      case 64:
        cs = mamba_fused::plan_or_launch<T, S, 64>(p, stream, launch);
        break;
      case 128:
        cs = mamba_fused::plan_or_launch<T, S, 128>(p, stream, launch);
        break;
      case 256:
        cs = mamba_fused::plan_or_launch<T, S, 256>(p, stream, launch);
        break;
      default:
        break;
    }
  });
  return cs;
}

}  // namespace chimera::cuda
