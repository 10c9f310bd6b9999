// Tensor-core SSD stage 3 (chunk_state) for bf16 / f16 activations at the Nemotron shape (head_dim P = 64,
// ssm_state_size N = 128, chunk 128): mma.sync m16n8k16 with fp32 accumulation, operands read from shared memory
// with ldmatrix (.trans where the operand's k runs down the stored rows), chunk tiles fetched with cp.async into a
// double buffer so the next chunk loads while this one computes. Portable across sm_80+, built here for sm_90a.
// The scan (stage 5) is ssd_mma_split.cu.
//
// One block per (superchunk, two heads of one group): the heads share the B tile. Shared-memory tiles (xs, bs:
// ssd_mma_tiles.cuh) keep the global layout (rows = tokens), padded by 8 elements per row.
// Rounding follows mamba_ssm: the dt-weighted x is rounded to the activation type before its matrix product;
// everything accumulates in fp32.
#include <cstdint>

#include "backends/cuda/mamba/mamba_common.cuh"
#include "backends/cuda/mamba/ssd_kernels.cuh"
#include "backends/cuda/mamba/ssd_mma_tiles.cuh"
#include "backends/cuda/mma_sync.cuh"

namespace chimera::cuda {
namespace {

using namespace ssd_mma;
using ssd_mma::cp_async_commit;  // not mma_sync.cuh's (ssd_mma_tiles.cuh)
using ssd_mma::cp_async_wait;
constexpr int kThreads = 256;  // 8 warps
static_assert(kThreads == 2 * kQ, "dt / dA_cumsum rows are fetched one per thread");

// ---- shared memory ---------------------------------------------------------------------------------
// The state pass's tiles of one chunk for kHeads heads of one group (B shared).
template <typename T, int kHeads>
struct StateTiles {
  T xs[kHeads][kQ * kXStride];
  T bs[kQ * kBStride];
  float dt[kHeads][kQ];
  float acs[kHeads][kQ];
};
template <typename T, int kHeads>
struct StateSmem {
  StateTiles<T, kHeads> stage[2];
};

// Heads h0 .. h0 + nh - 1 (nh <= kHeads) with kHeads * kThreads threads.
template <typename T, int kHeads>
__device__ __forceinline__ void load_state_chunk(StateTiles<T, kHeads>& t, const SsdParams& p, int begin, int len,
                                                 int h0, int nh, int g) {
  constexpr int kAll = kHeads * kThreads;
  const int tid = threadIdx.x;
  constexpr int kXVec = kQ * kP / 8;  // 16-byte vectors of one head's x tile
#pragma unroll
  for (int i = 0; i < kHeads * kXVec / kAll; ++i) {
    const int idx = tid + i * kAll, hh = idx / kXVec;
    if (hh < nh) load_x(t.xs[hh], p, begin, len, h0 + hh, idx % kXVec);
  }
#pragma unroll
  for (int i = 0; i < kQ * kN / 8 / kAll; ++i) load_bc(t.bs, p.B, p, begin, len, g, tid + i * kAll);
  const int hh = tid / kThreads, which = (tid / kQ) % 2;
  if (hh < nh) load_dt(which == 0 ? t.dt[hh] : t.acs[hh], p, begin, len, h0 + hh, which, tid % kQ);
}

// The state step over one chunk, this warp's part of S [P, N]: rows p in [p0, p0 + 16), columns n in
// [n0, n0 + 64) (8 accumulator tiles): S = exp(Acum[last]) * S + (x * w)^T B over the chunk's rows s, with
// w[s] = exp(Acum[last] - Acum[s]) * dt[s] applied to the x fragment (rounded to T) before the product.
template <typename T>
__device__ __forceinline__ void state_step(float (&st)[8][4], const T* xs, const T* bs, const float* acs,
                                           const float* dt, int len, int p0, int n0, const Lane& ln) {
  const float a_last = acs[len - 1];
  const float dec = __expf(a_last);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) st[j][e] *= dec;
  }
#pragma unroll
  for (int kk = 0; kk < kQ / 16; ++kk) {
    // A[m = p][k = s] = xs[s][p]: matrices (s 0-7, p 0-7), (s 0-7, p 8-15), (s 8-15, p 0-7), (s 8-15, p 8-15).
    uint32_t a[4];
    ldsm_x4_trans(a, &xs[(kk * 16 + ln.mrow + (ln.mat >> 1) * 8) * kXStride + p0 + (ln.mat & 1) * 8]);
    const int s0 = kk * 16 + 2 * ln.t4;
    float w[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int s = s0 + (e & 1) + (e >> 1) * 8;
      w[e] = __expf(a_last - acs[s]) * dt[s];
    }
    // a[0], a[1]: k = s0, s0 + 1 (rows gid, gid + 8); a[2], a[3]: k = s0 + 8, s0 + 9.
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const float2 v = unpack2<T>(a[r]);
      const int wi = (r >> 1) * 2;
      a[r] = pack2<T>(v.x * w[wi], v.y * w[wi + 1]);
    }
#pragma unroll
    for (int jq = 0; jq < 4; ++jq) {
      // B[k = s][n] = bs[s][n]: matrices (s 0-7, n 0-7), (s 8-15, n 0-7), (s 0-7, n 8-15), (s 8-15, n 8-15).
      uint32_t b[4];
      ldsm_x4_trans(b, &bs[(kk * 16 + ln.mrow + (ln.mat & 1) * 8) * kBStride + n0 + jq * 16 + (ln.mat >> 1) * 8]);
      mma_16816<T>(st[2 * jq], a, b[0], b[1]);
      mma_16816<T>(st[2 * jq + 1], a, b[2], b[3]);
    }
  }
}

// Blocks of kHeads heads of one group: block -> superchunk sc, group g, heads h0 .. h0 + nh - 1 (nh <= kHeads; the
// last block of a group takes the rest). Grid: n_supers x G x per_group blocks, heads of one superchunk adjacent.
template <int kHeads>
struct HeadBlock {
  int sc, g, h0, nh;
  __device__ explicit HeadBlock(const SsdParams& p) {
    const int per_group = (p.heads_per_group + kHeads - 1) / kHeads;  // blocks per group and superchunk
    sc = blockIdx.x / (p.G * per_group);
    const int rest = blockIdx.x % (p.G * per_group);
    g = rest / per_group;
    h0 = g * p.heads_per_group + (rest % per_group) * kHeads;
    nh = min(kHeads, (g + 1) * p.heads_per_group - h0);
  }
};
template <int kHeads>
unsigned head_blocks(const SsdParams& p) {
  const unsigned per_group = static_cast<unsigned>((p.heads_per_group + kHeads - 1) / kHeads);
  return static_cast<unsigned>(p.n_supers) * static_cast<unsigned>(p.G) * per_group;
}

// Stage 3: the end state of each superchunk from a zero start, and its total decay. One block per
// (superchunk, kHeads heads of one group): 8 warps per head, the B tile shared by the heads.
template <typename T, int kHeads>
__global__ void __launch_bounds__(kThreads * kHeads, 3 - kHeads) ssd_chunk_state_mma_kernel(SsdParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto& sm = *reinterpret_cast<StateSmem<T, kHeads>*>(smem_raw);
  const auto [sc, g, h0, nh] = HeadBlock<kHeads>(p);
  const int2 su = p.supers[sc];
  const int warp = threadIdx.x / 32, hh = warp / 8, hw = warp % 8;
  const bool active = hh < nh;
  const Lane ln(threadIdx.x % 32);
  const int p0 = (hw & 3) * 16, n0 = (hw >> 2) * 64;
  float st[8][4] = {};
  float decay = 1.0f;
  {
    const int2 ch = p.chunks[su.x];
    load_state_chunk(sm.stage[0], p, ch.x, ch.y - ch.x, h0, nh, g);
    cp_async_commit();
  }
  for (int ci = 0; ci < su.y; ++ci) {
    const int2 ch = p.chunks[su.x + ci];
    const int len = ch.y - ch.x;
    if (ci + 1 < su.y) {
      const int2 nx = p.chunks[su.x + ci + 1];
      load_state_chunk(sm.stage[(ci + 1) & 1], p, nx.x, nx.y - nx.x, h0, nh, g);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const auto& t = sm.stage[ci & 1];
    if (active) {
      decay *= __expf(t.acs[hh][len - 1]);
      state_step(st, t.xs[hh], t.bs, t.acs[hh], t.dt[hh], len, p0, n0, ln);
    }
    __syncthreads();  // the stage is refilled two chunks later
  }
  if (!active) return;
  const int h = h0 + hh;
  float* out = p.states + (static_cast<size_t>(sc) * p.H + h) * (kP * kN);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int pr = p0 + ln.gid + half * 8, nc = n0 + j * 8 + 2 * ln.t4;
      *reinterpret_cast<float2*>(&out[pr * kN + nc]) = make_float2(st[j][2 * half], st[j][2 * half + 1]);
    }
  }
  if (threadIdx.x % kThreads == 0) p.decay[static_cast<size_t>(sc) * p.H + h] = decay;
}

template <typename T, int kHeads>
void launch_state(const SsdParams& p, cudaStream_t stream) {
  launch_with_smem(ssd_chunk_state_mma_kernel<T, kHeads>, head_blocks<kHeads>(p), kThreads * kHeads,
                   sizeof(StateSmem<T, kHeads>), p, stream, "ops::ssd_chunk_scan (chunk_state mma)");
}

}  // namespace

template <typename T>
void launch_ssd_chunk_state_mma(const SsdParams& p, cudaStream_t stream) {
  launch_state<T, 2>(p, stream);
}

template void launch_ssd_chunk_state_mma<__nv_bfloat16>(const SsdParams&, cudaStream_t);
template void launch_ssd_chunk_state_mma<__half>(const SsdParams&, cudaStream_t);

}  // namespace chimera::cuda
