// Tensor-core SSD stages 3 (chunk_state) and 5 (chunk_scan) for bf16 / f16 activations at the Nemotron shape
// (head_dim P = 64, ssm_state_size N = 128, chunk 128): mma.sync m16n8k16 with fp32 accumulation, operands
// read from shared memory with ldmatrix (.trans where the operand's k runs down the stored rows), chunk
// tiles fetched with cp.async into a double buffer so the next chunk loads while this one computes.
// Portable across sm_80+, built here for sm_90a.
// Measured (docs/perf.md, H200, 32K tokens, 128 heads): chunk_scan 2.17 ms at ~97 TFLOP/s, chunk_state 0.47 ms
// at ~147 TFLOP/s, i.e. ~0.11-0.14 mma.sync per cycle per SM, whatever the C.B^T loop structure or the number
// of heads sharing B: the likely limit is feeding shared memory (one 89 KB chunk in flight per SM through
// per-thread cp.async), not the tensor cores. Next: TMA bulk copies with a third stage, blocks of several
// heads sharing the B / C tiles and C.B^T in the scan, then wgmma.
//
// One block of 8 warps per (superchunk, head); grid order puts the heads of one superchunk next to each other
// so the B / C tiles they share stay in L2. Shared-memory tiles (xs, bs, cs: ssd_mma_tiles.cuh) keep the global
// layout (rows = tokens), padded by 8 elements per row; the scan adds
//   sb [P, N + 8]   the entering state in bf16    (B of Y_off)
// Rounding follows mamba_ssm: the decay/dt-weighted C.B tile, the dt-weighted x and the entering state are
// rounded to the activation type before their matrix products; everything accumulates in fp32.
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
template <typename T>
struct ScanSmem {
  ScanTiles<T> stage[2];
  T sb[kP * kBStride];
};
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

// ---- the scans' mma steps (every kernel runs the same sequence per accumulator, hence the same bits) -------
// A fragment of the C rows [r0, r0 + 16) of a [Q, N + 8] tile, k = n in [16 kk, 16 kk + 16).
template <typename T>
__device__ __forceinline__ void load_c_rows(uint32_t (&a)[4], const T* cs, int r0, int kk, const Lane& ln) {
  ldsm_x4(a, &cs[(r0 + (ln.lane & 15)) * kBStride + kk * 16 + (ln.lane >> 4) * 8]);
}
// Y_off, step kk over k = N: acc [16 rows, P] += a . sb^T; B[k = n][col = p] = sb[p][n] (non-transposed ldmatrix).
template <typename T>
__device__ __forceinline__ void y_off_step(float (&acc)[8][4], const uint32_t (&a)[4], const T* sb, int kk,
                                           const Lane& ln) {
#pragma unroll
  for (int np = 0; np < kP / 16; ++np) {
    uint32_t b[4];
    ldsm_x4(b, &sb[(np * 16 + ln.mrow + (ln.mat >> 1) * 8) * kBStride + kk * 16 + (ln.mat & 1) * 8]);
    mma_16816<T>(acc[2 * np], a, b[0], b[1]);
    mma_16816<T>(acc[2 * np + 1], a, b[2], b[3]);
  }
}
// Y_diag, column tile j: acc [16 rows, P] += af . x rows [16 j, 16 j + 16); B[k = s][col = p] = xs[s][p]:
// matrices (s 0-7, p 0-7), (s 8-15, p 0-7), (s 0-7, p 8-15), (s 8-15, p 8-15).
template <typename T>
__device__ __forceinline__ void y_diag_tile(float (&acc)[8][4], const uint32_t (&af)[4], const T* xs, int j,
                                            const Lane& ln) {
#pragma unroll
  for (int np = 0; np < kP / 16; ++np) {
    uint32_t b[4];
    ldsm_x4_trans(b, &xs[(j * 16 + ln.mrow + (ln.mat & 1) * 8) * kXStride + np * 16 + (ln.mat >> 1) * 8]);
    mma_16816<T>(acc[2 * np], af, b[0], b[1]);
    mma_16816<T>(acc[2 * np + 1], af, b[2], b[3]);
  }
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

// Stage 5: y for every chunk of the superchunk, carrying the state chunk to chunk. Warp w computes the output
// rows l in [16 w, 16 w + 16) of each chunk:
//   Y_off  = exp(Acum[l]) * C[l] . S_in^T                   (k = N, S_in rounded to T in sb)
//   Y_diag = sum_{s <= l} (C[l] . B[s]) exp(Acum[l] - Acum[s]) dt[s] x[s]   (C.B^T tile j by tile j, its
//            accumulators re-packed in registers as the A fragment of the product with x; tiles past the
//            diagonal skipped)
//   y      = Y_off + Y_diag + D x
// then advances its share of the state (as stage 3) unless this is the superchunk's last chunk.
// kFusedCb: C.B^T and Y_off in one pass over k = N (each C fragment loaded once, the C.B^T tiles of all
// j <= w accumulated side by side: 2 (w + 1) independent mma chains instead of 2); else tile j by tile j.
template <typename T, bool kFusedCb>
__global__ void __launch_bounds__(kThreads, 1) ssd_chunk_scan_mma_kernel(SsdParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto& sm = *reinterpret_cast<ScanSmem<T>*>(smem_raw);
  const int sc = blockIdx.x / p.H, h = blockIdx.x % p.H, g = h / p.heads_per_group;
  const int2 su = p.supers[sc];
  const int warp = threadIdx.x / 32;
  const Lane ln(threadIdx.x % 32);
  const int p0 = (warp & 3) * 16, n0 = (warp >> 2) * 64;
  float st[8][4];
  load_entering_state(st, p, sc, h, p0, n0, ln);
  const float d_skip = p.D[h];
  T* y = static_cast<T*>(p.y);
  {
    const int2 ch = p.chunks[su.x];
    load_scan_chunk<T, kThreads>(sm.stage[0], p, ch.x, ch.y - ch.x, h, g);
    cp_async_commit();
  }
  const int m0 = warp * 16;  // this warp's output rows
  const int l0 = m0 + ln.gid, l1 = l0 + 8;
  for (int ci = 0; ci < su.y; ++ci) {
    const int2 ch = p.chunks[su.x + ci];
    const int len = ch.y - ch.x;
    if (ci + 1 < su.y) {
      const int2 nx = p.chunks[su.x + ci + 1];
      load_scan_chunk<T, kThreads>(sm.stage[(ci + 1) & 1], p, nx.x, nx.y - nx.x, h, g);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    store_state_tile(sm.sb, st, p0, n0, ln);  // the entering state, rounded to T, as the B operand of Y_off
    __syncthreads();
    const auto& t = sm.stage[ci & 1];
    const float al0 = t.acs[l0], al1 = t.acs[l1];

    float acc[8][4] = {};
    if constexpr (kFusedCb) {
      float cb[kQ / 16][2][4] = {};
#pragma unroll
      for (int kk = 0; kk < kN / 16; ++kk) {
        uint32_t a[4];
        load_c_rows(a, t.cs, m0, kk, ln);
        y_off_step(acc, a, sm.sb, kk, ln);
#pragma unroll
        for (int j = 0; j < kQ / 16; ++j) {
          // C.B^T: B[k = n][col = s] = bs[s][n]: matrices (s 0-7, n 0-7), (s 0-7, n 8-15), (s 8-15, n 0-7), ...
          if (j <= warp) {
            uint32_t b[4];
            ldsm_x4(b, &t.bs[(j * 16 + ln.mrow + (ln.mat >> 1) * 8) * kBStride + kk * 16 + (ln.mat & 1) * 8]);
            mma_16816<T>(cb[j][0], a, b[0], b[1]);
            mma_16816<T>(cb[j][1], a, b[2], b[3]);
          }
        }
      }
      scale_rows(acc, al0, al1);
#pragma unroll
      for (int j = 0; j < kQ / 16; ++j) {
        if (j <= warp) {
          uint32_t af[4];
          cb_to_a<T>(af, cb[j], t.acs, t.dt, j, l0, l1, al0, al1, ln);
          y_diag_tile(acc, af, t.xs, j, ln);
        }
      }
    } else {
      // Y_off: A = C rows (k = n).
#pragma unroll
      for (int kk = 0; kk < kN / 16; ++kk) {
        uint32_t a[4];
        load_c_rows(a, t.cs, m0, kk, ln);
        y_off_step(acc, a, sm.sb, kk, ln);
      }
      scale_rows(acc, al0, al1);
      // Y_diag over the column tiles s in [16 j, 16 j + 16), j <= warp.
      for (int j = 0; j <= warp; ++j) {
        float cb[2][4] = {};
#pragma unroll
        for (int kk = 0; kk < kN / 16; ++kk) {
          uint32_t a[4], b[4];
          load_c_rows(a, t.cs, m0, kk, ln);
          ldsm_x4(b, &t.bs[(j * 16 + ln.mrow + (ln.mat >> 1) * 8) * kBStride + kk * 16 + (ln.mat & 1) * 8]);
          mma_16816<T>(cb[0], a, b[0], b[1]);
          mma_16816<T>(cb[1], a, b[2], b[3]);
        }
        uint32_t af[4];
        cb_to_a<T>(af, cb, t.acs, t.dt, j, l0, l1, al0, al1, ln);
        y_diag_tile(acc, af, t.xs, j, ln);
      }
    }
    // + D x, stored as T.
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int pc = j * 8 + 2 * ln.t4;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int l = half ? l1 : l0;
        if (l < len) {
          *reinterpret_cast<uint32_t*>(&y[(static_cast<size_t>(ch.x + l) * p.H + h) * kP + pc]) =
              y_plus_dx(acc[j][2 * half], acc[j][2 * half + 1], d_skip, t.xs, l, pc);
        }
      }
    }
    if (ci + 1 < su.y) state_step(st, t.xs, t.bs, t.acs, t.dt, len, p0, n0, ln);
    __syncthreads();  // sb and this stage are rewritten next
  }
}

// ---- group_cb: C.B^T once per (chunk, group), a scan of two heads per block reading it ------------------
// The default scan recomputes C.B^T (causal half of 128 x 128 x 128 per chunk) for every head although C and B
// belong to the group (16 heads per group at Super, 8 at Nano): ~30 % of its mma work. Here stage 2b computes it
// once per (chunk, group) and the scan, one block per (superchunk, 2 heads of a group), reads it; the two heads
// also share the block's B and C tiles, so a head-chunk fetches x 16 KB + (B 32 + C 32 + C.B^T 36 KB) / 2 = 66 KB
// instead of 80 KB, and 16 warps are resident per SM instead of 8.
//
// cb layout: per (chunk, group) the 36 tiles (r, j <= r) of 16 x 16 (rows l = 16 r + .., columns s = 16 j + ..),
// tile index r (r + 1) / 2 + j, each stored as the mma accumulators of its 32 lanes: lane * 8 + nt * 4 + e is
// accumulator e of n8-tile nt (rows gid | gid + 8, columns 2 t4 (+1)). A scan lane then reads its A fragment
// source with two 16-byte shared loads (conflict-free), and the values are those the default scan computes in
// registers (same mma sequence over k = N), so both give the same bits.
constexpr int kCbTileFloats = 32 * 8;
static_assert(kSsdCbChunkFloats == kSsdCbTiles * kCbTileFloats, "cb tile layout");

template <typename T>
struct BmmSmem {
  T bs[kQ * kBStride];
  T cs[kQ * kBStride];
};

// Stage 2b: one block of 8 warps per (chunk, group); warp w computes tiles w, w + 8, ... (4 or 5 of the 36).
template <typename T>
__global__ void __launch_bounds__(kThreads) ssd_chunk_bmm_mma_kernel(SsdParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto& sm = *reinterpret_cast<BmmSmem<T>*>(smem_raw);
  const int ci = blockIdx.x / p.G, g = blockIdx.x % p.G;
  const int2 ch = p.chunks[ci];
  const int len = ch.y - ch.x;
#pragma unroll
  for (int i = 0; i < kQ * kN / 8 / kThreads; ++i) {
    load_bc(sm.bs, p.B, p, ch.x, len, g, threadIdx.x + i * kThreads);
    load_bc(sm.cs, p.C, p, ch.x, len, g, threadIdx.x + i * kThreads);
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  const int warp = threadIdx.x / 32;
  const Lane ln(threadIdx.x % 32);
  float* out = p.cb + (static_cast<size_t>(ci) * p.G + g) * kSsdCbChunkFloats;
  for (int t = warp; t < kSsdCbTiles; t += kThreads / 32) {
    int r = 0;
    while ((r + 1) * (r + 2) / 2 <= t) ++r;
    const int j = t - r * (r + 1) / 2;
    float cb[2][4] = {};
#pragma unroll
    for (int kk = 0; kk < kN / 16; ++kk) {
      uint32_t a[4], b[4];
      load_c_rows(a, sm.cs, r * 16, kk, ln);
      ldsm_x4(b, &sm.bs[(j * 16 + ln.mrow + (ln.mat >> 1) * 8) * kBStride + kk * 16 + (ln.mat & 1) * 8]);
      mma_16816<T>(cb[0], a, b[0], b[1]);
      mma_16816<T>(cb[1], a, b[2], b[3]);
    }
    float4* dst = reinterpret_cast<float4*>(out + t * kCbTileFloats + ln.lane * 8);
    dst[0] = make_float4(cb[0][0], cb[0][1], cb[0][2], cb[0][3]);
    dst[1] = make_float4(cb[1][0], cb[1][1], cb[1][2], cb[1][3]);
  }
}

// The group scan's shared memory (214 KB): x, dt, dA_cumsum of both heads double-buffered; C.B^T, C and B
// single-buffered, each refilled for the next chunk as soon as the phase that reads it is over (C after Y_off,
// C.B^T after Y_diag, B after the state step), so its copy overlaps the rest of this chunk and the next one's
// first phases; the entering state of each head in T.
constexpr int kGroupHeads = 2;
constexpr int kGroupThreads = kGroupHeads * kThreads;  // 16 warps: 8 per head
template <typename T>
struct GroupStage {
  T xs[kGroupHeads][kQ * kXStride];
  float dt[kGroupHeads][kQ];
  float acs[kGroupHeads][kQ];  // rows past the chunk's end zero-filled (finite; dt = 0 there)
};
template <typename T>
struct GroupScanSmem {
  GroupStage<T> stage[2];
  float cb[kSsdCbChunkFloats];
  T cs[kQ * kBStride];
  T bs[kQ * kBStride];
  T sb[kGroupHeads][kP * kBStride];
};

// Copies of chunk rows [begin, begin + len) for heads h0 .. h0 + nh - 1 of group g, spread over the block's
// kGroupThreads threads; the caller commits.
template <typename T>
__device__ __forceinline__ void load_group_stage(GroupStage<T>& t, const SsdParams& p, int begin, int len, int h0,
                                                 int nh) {
  const int tid = threadIdx.x;
  constexpr int kXVec = kQ * kP / 8;
#pragma unroll
  for (int i = 0; i < kGroupHeads * kXVec / kGroupThreads; ++i) {
    const int idx = tid + i * kGroupThreads, hh = idx / kXVec;
    if (hh < nh) load_x(t.xs[hh], p, begin, len, h0 + hh, idx % kXVec);
  }
  static_assert(kGroupThreads == kGroupHeads * 2 * kQ, "one dt / dA_cumsum row per thread");
  const int hh = tid / (2 * kQ), which = (tid / kQ) % 2;
  if (hh < nh) load_dt(which == 0 ? t.dt[hh] : t.acs[hh], p, begin, len, h0 + hh, which, tid % kQ);
}
template <typename T>
__device__ __forceinline__ void load_group_bc(T* tile, const void* src, const SsdParams& p, int begin, int len, int g) {
#pragma unroll
  for (int i = 0; i < kQ * kN / 8 / kGroupThreads; ++i) load_bc(tile, src, p, begin, len, g, threadIdx.x + i * kGroupThreads);
}
__device__ __forceinline__ void load_group_cb(float* cb, const SsdParams& p, int chunk, int g) {
  const float* src = p.cb + (static_cast<size_t>(chunk) * p.G + g) * kSsdCbChunkFloats;
  constexpr int kVec = kSsdCbChunkFloats / 4;
#pragma unroll
  for (int i = 0; i < (kVec + kGroupThreads - 1) / kGroupThreads; ++i) {
    const int v = threadIdx.x + i * kGroupThreads;
    if (v < kVec) cp_async16(&cb[v * 4], src + v * 4, true);
  }
}

// Stage 5 on stage 2b's C.B^T: one block per (superchunk, 2 heads of a group), 8 warps per head (the second
// head's warps idle, but still copy and synchronise, when the group has an odd head count). Per chunk:
//   Y_off  = exp(Acum[l]) * C[l] . S_in^T          warp (rp, ph) of its head: row tiles rp and 7 - rp (so every
//   Y_diag = sum_{s <= l} cb[l][s] exp(..) dt[s] x[s]  warp has 9 of the 36 causal tiles), columns p in
//   y      = Y_off + Y_diag + D x                      [32 ph, 32 ph + 32)
//   state step as stage 3 (warp's rows p0.., columns n0.., as the default scan), unless the superchunk ends.
// cp.async groups are committed in a fixed order, one per copy kind and chunk, empty when there is nothing to
// copy: stage(c + 1) at the top of chunk c, C(c + 1) after its Y_off, cb(c + 1) after its Y_diag, B(c + 1) after
// its state step; so "wait until at most k groups are pending" names one copy (see the waits below).
template <typename T>
__global__ void __launch_bounds__(kGroupThreads, 1) ssd_chunk_scan_group_mma_kernel(SsdParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto& sm = *reinterpret_cast<GroupScanSmem<T>*>(smem_raw);
  const auto [sc, g, h0, nh] = HeadBlock<kGroupHeads>(p);
  const int2 su = p.supers[sc];
  const int warp = threadIdx.x / 32, hh = warp / 8, hw = warp % 8;
  const bool active = hh < nh;
  const int h = h0 + (active ? hh : 0);
  const Lane ln(threadIdx.x % 32);
  const int p0 = (hw & 3) * 16, n0 = (hw >> 2) * 64;  // state step tiling (as the default scan)
  const int ra = hw >> 1, rb = 7 - ra, pc0 = (hw & 1) * 32;  // output tiling: row tiles ra < rb, 32 columns
  float st[8][4];
  load_entering_state(st, p, sc, h, p0, n0, ln, active);
  const float d_skip = active ? p.D[h] : 0.0f;
  T* y = static_cast<T*>(p.y);
  T* sb = sm.sb[hh < nh ? hh : 0];
  {
    const int2 ch = p.chunks[su.x];
    const int len = ch.y - ch.x;
    load_group_stage(sm.stage[0], p, ch.x, len, h0, nh);
    cp_async_commit();
    load_group_bc(sm.cs, p.C, p, ch.x, len, g);
    cp_async_commit();
    load_group_cb(sm.cb, p, su.x, g);
    cp_async_commit();
    if (su.y > 1) load_group_bc(sm.bs, p.B, p, ch.x, len, g);
    cp_async_commit();
  }
  for (int ci = 0; ci < su.y; ++ci) {
    const int2 ch = p.chunks[su.x + ci];
    const int len = ch.y - ch.x;
    const bool more = ci + 1 < su.y;
    const int2 nx = p.chunks[su.x + (more ? ci + 1 : ci)];
    // The entering state, rounded to T, as the B operand of Y_off (sb was last read by the previous Y_off).
    if (active) store_state_tile(sb, st, p0, n0, ln);
    if (more) load_group_stage(sm.stage[(ci + 1) & 1], p, nx.x, nx.y - nx.x, h0, nh);
    cp_async_commit();
    cp_async_wait<3>();  // pending at most: cb(c), B(c), stage(c + 1) -> stage(c) and C(c) landed
    __syncthreads();
    const auto& t = sm.stage[ci & 1];
    const float* acs = t.acs[active ? hh : 0];
    const float* dts = t.dt[active ? hh : 0];
    const T* xs = t.xs[active ? hh : 0];

    // Y_off over k = N: A = C rows of tiles ra and rb, B[k = n][col = p] = sb[p][n] (non-transposed ldmatrix).
    float acc[2][4][4] = {};
    if (active) {
#pragma unroll
      for (int kk = 0; kk < kN / 16; ++kk) {
        uint32_t a0[4], a1[4];
        load_c_rows(a0, sm.cs, ra * 16, kk, ln);
        load_c_rows(a1, sm.cs, rb * 16, kk, ln);
#pragma unroll
        for (int np = 0; np < 2; ++np) {
          uint32_t b[4];
          ldsm_x4(b, &sb[(pc0 + np * 16 + ln.mrow + (ln.mat >> 1) * 8) * kBStride + kk * 16 + (ln.mat & 1) * 8]);
          mma_16816<T>(acc[0][2 * np], a0, b[0], b[1]);
          mma_16816<T>(acc[0][2 * np + 1], a0, b[2], b[3]);
          mma_16816<T>(acc[1][2 * np], a1, b[0], b[1]);
          mma_16816<T>(acc[1][2 * np + 1], a1, b[2], b[3]);
        }
      }
    }
    const int la0 = ra * 16 + ln.gid, lb0 = rb * 16 + ln.gid;
    const float ala0 = acs[la0], ala1 = acs[la0 + 8], alb0 = acs[lb0], alb1 = acs[lb0 + 8];
    scale_rows(acc[0], ala0, ala1);
    scale_rows(acc[1], alb0, alb1);
    cp_async_wait<2>();  // pending at most: B(c), stage(c + 1) -> cb(c) landed
    __syncthreads();     // and every warp is past Y_off: C may be refilled
    if (more) load_group_bc(sm.cs, p.C, p, nx.x, nx.y - nx.x, g);
    cp_async_commit();

    // Y_diag, column tile j by column tile j (ascending, as the default scan): the x fragments of tile j serve
    // both row tiles; cb tile (r, j) scaled and masked by cb_to_a into the A fragment.
    if (active) {
#pragma unroll 1  // fully unrolled, the kernel spills more (it sits at the 128-register limit of 512 threads)
      for (int j = 0; j < kQ / 16; ++j) {
        if (j <= rb) {
          uint32_t b[2][4];
#pragma unroll
          for (int np = 0; np < 2; ++np) {
            ldsm_x4_trans(b[np],
                          &xs[(j * 16 + ln.mrow + (ln.mat & 1) * 8) * kXStride + pc0 + np * 16 + (ln.mat >> 1) * 8]);
          }
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int rt = r ? rb : ra;
            if (r == 1 || j <= ra) {
              const float4* src =
                  reinterpret_cast<const float4*>(&sm.cb[(rt * (rt + 1) / 2 + j) * kCbTileFloats + ln.lane * 8]);
              const float4 c0 = src[0], c1 = src[1];
              const float cbf[2][4] = {{c0.x, c0.y, c0.z, c0.w}, {c1.x, c1.y, c1.z, c1.w}};
              const int l0 = rt * 16 + ln.gid;
              uint32_t af[4];
              cb_to_a<T>(af, cbf, acs, dts, j, l0, l0 + 8, r ? alb0 : ala0, r ? alb1 : ala1, ln);
#pragma unroll
              for (int np = 0; np < 2; ++np) {
                mma_16816<T>(acc[r][2 * np], af, b[np][0], b[np][1]);
                mma_16816<T>(acc[r][2 * np + 1], af, b[np][2], b[np][3]);
              }
            }
          }
        }
      }
      // + D x, stored as T.
#pragma unroll
      for (int r = 0; r < 2; ++r) {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int pc = pc0 + q * 8 + 2 * ln.t4;
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int l = (r ? rb : ra) * 16 + ln.gid + half * 8;
            if (l < len) {
              *reinterpret_cast<uint32_t*>(&y[(static_cast<size_t>(ch.x + l) * p.H + h) * kP + pc]) =
                  y_plus_dx(acc[r][q][2 * half], acc[r][q][2 * half + 1], d_skip, xs, l, pc);
            }
          }
        }
      }
    }
    cp_async_wait<2>();  // pending at most: stage(c + 1), C(c + 1) -> B(c) landed
    __syncthreads();     // and every warp is past Y_diag: cb may be refilled
    if (more) load_group_cb(sm.cb, p, su.x + ci + 1, g);
    cp_async_commit();

    if (more) {
      if (active) state_step(st, xs, sm.bs, acs, dts, len, p0, n0, ln);
      __syncthreads();  // every warp is past the state step: B and this stage may be refilled
      if (ci + 2 < su.y) load_group_bc(sm.bs, p.B, p, nx.x, nx.y - nx.x, g);
    }
    cp_async_commit();
  }
  cp_async_wait<0>();  // nothing left in flight when the block exits
}

template <typename T, int kHeads>
void launch_state(const SsdParams& p, cudaStream_t stream) {
  launch_with_smem(ssd_chunk_state_mma_kernel<T, kHeads>, head_blocks<kHeads>(p), kThreads * kHeads,
                   sizeof(StateSmem<T, kHeads>), p, stream, "ops::ssd_chunk_scan (chunk_state mma)");
}

template <typename T, bool kFusedCb>
void launch_scan(const SsdParams& p, cudaStream_t stream) {
  launch_with_smem(ssd_chunk_scan_mma_kernel<T, kFusedCb>,
                   static_cast<unsigned>(p.n_supers) * static_cast<unsigned>(p.H), kThreads, sizeof(ScanSmem<T>), p,
                   stream, "ops::ssd_chunk_scan (chunk_scan mma)");
}

}  // namespace

template <typename T>
void launch_ssd_chunk_state_mma(const SsdParams& p, int heads_per_block, cudaStream_t stream) {
  if (heads_per_block == 2) {
    launch_state<T, 2>(p, stream);
  } else {
    launch_state<T, 1>(p, stream);
  }
}

template <typename T>
void launch_ssd_chunk_scan_mma(const SsdParams& p, bool fused_cb, cudaStream_t stream) {
  if (fused_cb) {
    launch_scan<T, true>(p, stream);
  } else {
    launch_scan<T, false>(p, stream);
  }
}

template <typename T>
void launch_ssd_chunk_bmm_mma(const SsdParams& p, cudaStream_t stream) {
  launch_with_smem(ssd_chunk_bmm_mma_kernel<T>, static_cast<unsigned>(p.n_chunks) * static_cast<unsigned>(p.G),
                   kThreads, sizeof(BmmSmem<T>), p, stream, "ops::ssd_chunk_scan (chunk_bmm mma)");
}

template <typename T>
void launch_ssd_chunk_scan_group_mma(const SsdParams& p, cudaStream_t stream) {
  launch_with_smem(ssd_chunk_scan_group_mma_kernel<T>, head_blocks<kGroupHeads>(p), kGroupThreads,
                   sizeof(GroupScanSmem<T>), p, stream, "ops::ssd_chunk_scan (chunk_scan group mma)");
}

template void launch_ssd_chunk_state_mma<__nv_bfloat16>(const SsdParams&, int, cudaStream_t);
template void launch_ssd_chunk_state_mma<__half>(const SsdParams&, int, cudaStream_t);
template void launch_ssd_chunk_scan_mma<__nv_bfloat16>(const SsdParams&, bool, cudaStream_t);
template void launch_ssd_chunk_scan_mma<__half>(const SsdParams&, bool, cudaStream_t);
template void launch_ssd_chunk_bmm_mma<__nv_bfloat16>(const SsdParams&, cudaStream_t);
template void launch_ssd_chunk_bmm_mma<__half>(const SsdParams&, cudaStream_t);
template void launch_ssd_chunk_scan_group_mma<__nv_bfloat16>(const SsdParams&, cudaStream_t);
template void launch_ssd_chunk_scan_group_mma<__half>(const SsdParams&, cudaStream_t);

}  // namespace chimera::cuda
