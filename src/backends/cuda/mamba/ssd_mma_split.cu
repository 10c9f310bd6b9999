// SSD stage 5 (chunk_scan) on tensor cores: 16 warps per (superchunk, head), y staged through shared memory and
// stored as whole 128-byte rows.
//
// Why 16 warps: a scan of 8 warps per block (245 registers, 195 KB of shared memory) holds one block per SM
// and is latency bound (ncu at Super 32K: 2 warps per scheduler, 0.36 eligible, issue slots 28 % busy,
// tensor pipe ~22 %); its warps are unbalanced (warp w owns output row tile w, so warp 7 does 8 causal C.B^T
// tiles and warp 0 one: 320 vs 152 mma per chunk) and every warp recomputes the state step's decay weights
// and re-packs its x fragments. Here, per chunk:
//   - 16 warps (<= 128 registers each) in 4 groups q = 0..3 of 4 warps c = 0..3. Group q owns the output row
//     tiles q and 7 - q (9 of the 36 causal 16 x 16 C.B^T tiles for every q: balanced); warp c of it the output
//     columns p in [16 c, 16 c + 16) of both row tiles, and the state rows p in [16 q, 16 q + 16), columns
//     n in [32 c, 32 c + 32).
//   - Y_off (C . S_in^T) and the group's C.B^T tiles share one pass over k = N.
//     The 9 C.B^T tiles are 18 n8 halves, dealt round-robin to the group's 4 warps (5, 5, 4, 4); each warp
//     scales its halves (cb_half_to_a: exp(Acum[l] - Acum[s]) dt[s], causal mask, rounded to T) and leaves
//     them in shared memory as mma A fragments (`af`), from which all 4 warps read the tiles of their rows.
//   - The state step's A operand x[s][p] * w[s], w[s] = exp(Acum[last] - Acum[s]) dt[s] rounded to T, is
//     computed once per element into a shared tile (`xw`) instead of once per warp in registers.
//   - Two block barriers per chunk: after the copy wait (tiles, sb visible), after the C.B^T exchange.
//   - y goes into the chunk's C tile (dead by then) and, after a barrier of the 4-warp group, out as the group's
//     32 rows in whole 128-byte lines.
// Per warp and chunk: 122 mma (+8 wasted on warps 2, 3 of each group, see the slots below), ~1100 instructions
// (an 8-warp split: 236 mma, ~2240 instructions per warp); 125-128 registers, no spills (ptxas -v).
// Per element every product is one fixed mma chain (Y_off over k = N in kk order, times exp(Acum[l]), then the
// C.B^T tiles j = 0.. in order; the state times exp(Acum[last]) then the chunk's rows in kk order), and every
// scaling the same fp32 expression (ssd_mma_tiles.cuh).
//
// Shared memory (bf16 / f16, 232448 bytes: the sm_90 per-block maximum, one block per SM):
//   stage[2]  xs [Q, P + 8], bs, cs [Q, N + 8], dt, dA_cumsum [Q]     the chunk tiles, double-buffered
//   sb [P, N + 8]     the entering state in T (B of Y_off)
//   xw [Q, P + 8]     x * w in T (A^T of the state step)
//   af [4][9][32]     per group and C.B^T tile, each lane's 4 A-fragment registers (one 16-byte load per tile)
#include <cstdint>

#include "backends/cuda/mamba/ssd_kernels.cuh"
#include "backends/cuda/mamba/ssd_mma_tiles.cuh"
#include "backends/cuda/mma_sync.cuh"

namespace chimera::cuda {
namespace {

using namespace ssd_mma;
using ssd_mma::cp_async_commit;  // not mma_sync.cuh's (ssd_mma_tiles.cuh)
using ssd_mma::cp_async_wait;

constexpr int kSplitThreads = 512;  // 16 warps
constexpr int kGroups = 4;          // row-tile pairs (q, 7 - q), 4 warps each
constexpr int kGroupTiles = 9;      // causal C.B^T tiles of row tiles q and 7 - q: (q + 1) + (8 - q)
constexpr int kSlots = 5;           // C.B^T n8 halves per warp: 18 per group over 4 warps -> 5, 5, 4, 4
constexpr int kGroupThreads = kSplitThreads / kGroups;
static_assert(kGroups * kGroupTiles == kSsdCbTiles && kGroupThreads == 4 * 32, "split tiling");
static_assert(kGroupThreads == kQ, "one x * w row per thread of a group");

template <typename T>
struct SplitSmem {
  ScanTiles<T> stage[2];
  T sb[kP * kBStride];
  T xw[kQ * kXStride];
  uint4 af[kGroups * kGroupTiles * 32];
};
constexpr size_t kMaxSmemPerBlock = 232448;  // sm_90 opt-in limit
static_assert(sizeof(SplitSmem<__nv_bfloat16>) <= kMaxSmemPerBlock, "split scan shared memory");

// Group q's C.B^T tile k (0..8): row tile 7 - q, column tile k for k <= 7 - q; else row tile q, column tile
// k - (8 - q). Y_diag reads row 7 - q's tile j at k = j and row q's at k = 8 - q + j.
__device__ __forceinline__ int af_index(int q, int k, int lane) {
  return (q * kGroupTiles + k) * 32 + lane;
}

// One chunk's tiles (the same copies as ssd_mma_tiles.cuh's load_scan_chunk) with the 64-bit address math done
// once per chunk: each thread's vectors sit at fixed 32-bit byte offsets from the chunk's x / B / C rows.
// kFull: len == Q (every chunk but a sequence's last), no row needs the zero fill.
template <typename T, bool kFull>
__device__ __forceinline__ void load_split_chunk(ScanTiles<T>& t, const SsdParams& p, int begin, int len, int h,
                                                 int g) {
  const int tid = threadIdx.x;
  const auto* xb =
      reinterpret_cast<const char*>(static_cast<const T*>(p.x) + (static_cast<size_t>(begin) * p.H + h) * kP);
  const auto* bb =
      reinterpret_cast<const char*>(static_cast<const T*>(p.B) + (static_cast<size_t>(begin) * p.G + g) * kN);
  const auto* cb =
      reinterpret_cast<const char*>(static_cast<const T*>(p.C) + (static_cast<size_t>(begin) * p.G + g) * kN);
  // Bytes between consecutive tokens (a chunk spans < 2^31 bytes of any of them).
  const uint32_t x_row = static_cast<uint32_t>(p.H * kP * sizeof(T)),
                 bc_row = static_cast<uint32_t>(p.G * kN * sizeof(T));
#pragma unroll
  for (int i = 0; i < kQ * kP / 8 / kSplitThreads; ++i) {
    const int r = tid / (kP / 8) + i * (kSplitThreads * 8 / kP), v = tid % (kP / 8);
    const bool ok = kFull || r < len;
    cp_async16(&t.xs[r * kXStride + v * 8], xb + (ok ? r * x_row + v * 16 : 0u), ok);
  }
#pragma unroll
  for (int i = 0; i < kQ * kN / 8 / kSplitThreads; ++i) {
    const int r = tid / (kN / 8) + i * (kSplitThreads * 8 / kN), v = tid % (kN / 8);
    const bool ok = kFull || r < len;
    const uint32_t off = ok ? r * bc_row + v * 16 : 0u;
    cp_async16(&t.bs[r * kBStride + v * 8], bb + off, ok);
    cp_async16(&t.cs[r * kBStride + v * 8], cb + off, ok);
  }
  if (tid < 2 * kQ) load_dt(tid < kQ ? t.dt : t.acs, p, begin, len, h, tid / kQ, tid % kQ);
}

template <typename T>
__device__ __forceinline__ void load_split_chunk(ScanTiles<T>& t, const SsdParams& p, int2 chunk, int h, int g) {
  const int len = chunk.y - chunk.x;
  if (len == kQ) {
    load_split_chunk<T, true>(t, p, chunk.x, len, h, g);
  } else {
    load_split_chunk<T, false>(t, p, chunk.x, len, h, g);
  }
}

template <typename T>
__device__ __forceinline__ uint32_t scale2(uint32_t u, float w) {
  const float2 v = unpack2<T>(u);
  return pack2<T>(v.x * w, v.y * w);
}

// Barrier of the 4 warps of group q (named barriers 1..4; 0 is __syncthreads).
__device__ __forceinline__ void group_sync(int q) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(q + 1), "n"(kGroupThreads) : "memory");
}

template <typename T>
__global__ void __launch_bounds__(kSplitThreads, 1) ssd_chunk_scan_split_mma_kernel(SsdParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto& sm = *reinterpret_cast<SplitSmem<T>*>(smem_raw);
  const int sc = blockIdx.x / p.H, h = blockIdx.x % p.H, g = h / p.heads_per_group;
  const int2 su = p.supers[sc];
  const int warp = threadIdx.x / 32, q = warp / 4, c = warp % 4;
  const Lane ln(threadIdx.x % 32);
  const int r_lo = q, r_hi = 7 - q;    // output row tiles
  const int pc0 = c * 16;              // output columns
  const int p0 = q * 16, n0 = c * 32;  // state rows and columns

  // This warp's C.B^T halves: slot i is group half 4 i + c, i.e. tile k = 2 i + c / 2, n8 half nt = c % 2.
  // Slots 0, 1 always lie in row tile 7 - q; slots 2, 3 in 7 - q or q depending on q; slot 4 is row tile q's
  // diagonal tile (k = 8), whose halves belong to warps 0 and 1: warps 2 and 3 compute them too (their
  // schedulers have one slot less) but do not store them, which keeps the k loop free of branches.
  const int nt = c % 2;
  int slot_k[kSlots], slot_j[kSlots];
  bool slot_hi[kSlots];
#pragma unroll
  for (int i = 0; i < kSlots; ++i) {
    const int k = i < 4 ? 2 * i + c / 2 : 8;
    slot_k[i] = k;
    slot_hi[i] = k <= r_hi;
    slot_j[i] = slot_hi[i] ? k : k - (8 - q);
  }
  const bool stores_slot4 = c < 2;

  float st[4][4];
  load_entering_state(st, p, sc, h, p0, n0, ln);
  const float d_skip = p.D[h];
  T* y = static_cast<T*>(p.y);
  load_split_chunk(sm.stage[0], p, p.chunks[su.x], h, g);
  cp_async_commit();
  for (int ci = 0; ci < su.y; ++ci) {
    const int2 ch = p.chunks[su.x + ci];
    const int len = ch.y - ch.x;
    const bool more = ci + 1 < su.y;
    // The entering state, rounded to T, as the B operand of Y_off. Every warp finished the previous chunk's
    // Y_off (its last read of sb) before that chunk's second barrier.
    store_state_tile(sm.sb, st, p0, n0, ln);
    cp_async_wait<0>();
    __syncthreads();  // this chunk's tiles and sb visible; every warp is past the previous chunk
    if (more) {
      load_split_chunk(sm.stage[(ci + 1) & 1], p, p.chunks[su.x + ci + 1], h, g);
      cp_async_commit();
    }
    const auto& t = sm.stage[ci & 1];

    // x * w for the state step: group q's thread i, row s = i, columns [p0, p0 + 16) (those its warps read).
    if (more) {
      const int s = threadIdx.x % kGroupThreads;
      const float w = __expf(t.acs[len - 1] - t.acs[s]) * t.dt[s];
      const uint4* src = reinterpret_cast<const uint4*>(&t.xs[s * kXStride + p0]);
      uint4* dst = reinterpret_cast<uint4*>(&sm.xw[s * kXStride + p0]);
#pragma unroll
      for (int v = 0; v < 2; ++v) {
        uint4 u = src[v];
        u.x = scale2<T>(u.x, w);
        u.y = scale2<T>(u.y, w);
        u.z = scale2<T>(u.z, w);
        u.w = scale2<T>(u.w, w);
        dst[v] = u;
      }
    }

    // Y_off for rows of tiles q, 7 - q and columns [pc0, pc0 + 16), with this warp's C.B^T halves, over k = N.
    float acc[2][2][4] = {};  // [row tile q, 7 - q][n8 column tile][accumulator]
    float cb[kSlots][4] = {};
    {
      const int arow = ln.lane & 15, acol = (ln.lane >> 4) * 8;
      const T* a_lo_p = &t.cs[(r_lo * 16 + arow) * kBStride + acol];
      const T* a_hi_p = &t.cs[(r_hi * 16 + arow) * kBStride + acol];
      // Y_off: B[k = n][col = p] = sb[p][n] (non-transposed ldmatrix), as the default.
      const T* sb_p = &sm.sb[(pc0 + ln.mrow + (ln.mat >> 1) * 8) * kBStride + (ln.mat & 1) * 8];
      // C.B^T half: B[k = n][col = s] = bs[s][n], s in [16 j + 8 nt, +8): matrices (k 0-7), (k 8-15).
      const T* b_p[kSlots];
#pragma unroll
      for (int i = 0; i < kSlots; ++i) {
        b_p[i] = &t.bs[(slot_j[i] * 16 + nt * 8 + ln.mrow) * kBStride + (ln.mat & 1) * 8];
      }
#pragma unroll
      for (int kk = 0; kk < kN / 16; ++kk) {
        uint32_t a_lo[4], a_hi[4], b[4];
        ldsm_x4(a_lo, a_lo_p + kk * 16);
        ldsm_x4(a_hi, a_hi_p + kk * 16);
        ldsm_x4(b, sb_p + kk * 16);
        mma_16816<T>(acc[0][0], a_lo, b[0], b[1]);
        mma_16816<T>(acc[0][1], a_lo, b[2], b[3]);
        mma_16816<T>(acc[1][0], a_hi, b[0], b[1]);
        mma_16816<T>(acc[1][1], a_hi, b[2], b[3]);
#pragma unroll
        for (int i = 0; i < kSlots; ++i) {
          uint32_t bb[2];
          ldsm_x2(bb, b_p[i] + kk * 16);
          if (i < 2) {
            mma_16816<T>(cb[i], a_hi, bb[0], bb[1]);
          } else if (i == 4) {
            mma_16816<T>(cb[i], a_lo, bb[0], bb[1]);
          } else {
            // Slots 2 and 3 select their row's C fragment in registers (no extra shared load, and selects rather
            // than predicated mma, which ptxas fences with warp syncs).
            uint32_t am[4];
#pragma unroll
            for (int r = 0; r < 4; ++r) am[r] = slot_hi[i] ? a_hi[r] : a_lo[r];
            mma_16816<T>(cb[i], am, bb[0], bb[1]);
          }
        }
      }
    }
    const int l_lo = r_lo * 16 + ln.gid, l_hi = r_hi * 16 + ln.gid;
    const float al_lo0 = t.acs[l_lo], al_lo1 = t.acs[l_lo + 8], al_hi0 = t.acs[l_hi], al_hi1 = t.acs[l_hi + 8];
    scale_rows(acc[0], al_lo0, al_lo1);
    scale_rows(acc[1], al_hi0, al_hi1);
    // This warp's C.B^T halves -> A fragments in af (registers 2 nt, 2 nt + 1 of each lane's 16 bytes).
#pragma unroll
    for (int i = 0; i < kSlots; ++i) {
      if (i == 4 && !stores_slot4) continue;
      const bool hi = slot_hi[i];
      const int l0 = hi ? l_hi : l_lo;
      const int s = slot_j[i] * 16 + nt * 8 + 2 * ln.t4;  // even: 8-byte aligned pairs
      const float2 as = *reinterpret_cast<const float2*>(&t.acs[s]), d = *reinterpret_cast<const float2*>(&t.dt[s]);
      const float al0 = hi ? al_hi0 : al_lo0, al1 = hi ? al_hi1 : al_lo1;
      uint32_t lo_reg, hi_reg;
      // Only diagonal tiles need the causal mask: slot 4 always, slots 2 and 3 for one q each; slots 0 and 1 hold
      // tiles 0..3 of row tile 7 - q >= 4 (warp-uniform branch).
      if (i < 2 || (i < 4 && slot_j[i] < (hi ? r_hi : r_lo))) {
        cb_half_to_a<T, false>(lo_reg, hi_reg, cb[i], as, d, s, l0, l0 + 8, al0, al1);
      } else {
        cb_half_to_a<T>(lo_reg, hi_reg, cb[i], as, d, s, l0, l0 + 8, al0, al1);
      }
      reinterpret_cast<uint2*>(&sm.af[af_index(q, slot_k[i], ln.lane)])[nt] = make_uint2(lo_reg, hi_reg);
    }
    __syncthreads();  // af and xw visible

    // Y_diag, column tile j by column tile j (ascending, as the default): B[k = s][col = p] = xs[s][p]
    // (matrices (s 0-7, p 0-7), (s 8-15, p 0-7), (s 0-7, p 8-15), (s 8-15, p 8-15)). Tiles j <= q serve both row
    // tiles, q < j <= 7 - q row tile 7 - q only: two runtime-length loops, each row tile's tiles still in
    // ascending j.
    {
      const T* xs_j = &t.xs[(ln.mrow + (ln.mat & 1) * 8) * kXStride + pc0 + (ln.mat >> 1) * 8];
      const uint4* af_hi = &sm.af[af_index(q, 0, ln.lane)];      // row tile 7 - q, column tile j at j * 32
      const uint4* af_lo = &sm.af[af_index(q, 8 - q, ln.lane)];  // row tile q
      int j = 0;
#pragma unroll 1
      for (; j <= r_lo; ++j) {
        uint32_t b[4];
        ldsm_x4_trans(b, xs_j);
        const uint4 fh = af_hi[j * 32], fl = af_lo[j * 32];
        const uint32_t ah[4] = {fh.x, fh.y, fh.z, fh.w}, al[4] = {fl.x, fl.y, fl.z, fl.w};
        mma_16816<T>(acc[1][0], ah, b[0], b[1]);
        mma_16816<T>(acc[1][1], ah, b[2], b[3]);
        mma_16816<T>(acc[0][0], al, b[0], b[1]);
        mma_16816<T>(acc[0][1], al, b[2], b[3]);
        xs_j += 16 * kXStride;
      }
#pragma unroll 1
      for (; j <= r_hi; ++j) {
        uint32_t b[4];
        ldsm_x4_trans(b, xs_j);
        const uint4 fh = af_hi[j * 32];
        const uint32_t ah[4] = {fh.x, fh.y, fh.z, fh.w};
        mma_16816<T>(acc[1][0], ah, b[0], b[1]);
        mma_16816<T>(acc[1][1], ah, b[2], b[3]);
        xs_j += 16 * kXStride;
      }
    }
    // + D x, rounded to T, through this stage's C tile (read by nobody until the copy of chunk ci + 2, issued after
    // the next chunk's first barrier) so that the group stores its 32 rows as whole 128-byte lines (straight from
    // the accumulators a lane would store 4 bytes, 16 of each 32-byte sector).
    T* yc = y + (static_cast<size_t>(ch.x) * p.H + h) * kP;  // this chunk's first row of head h
    const int y_row = p.H * kP;
    T* ys = sm.stage[ci & 1].cs;  // [Q, P + 8] tile of y
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int pc = pc0 + j * 8 + 2 * ln.t4;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int l = (r ? l_hi : l_lo) + half * 8;
          const uint32_t out = y_plus_dx(acc[r][j][2 * half], acc[r][j][2 * half + 1], d_skip, t.xs, l, pc);
          *reinterpret_cast<uint32_t*>(&ys[l * kXStride + pc]) = out;
        }
      }
    }
    {
      group_sync(q);  // the group's rows of ys written
      const int i = threadIdx.x % kGroupThreads, v = i % 8;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int l = (r ? r_hi : r_lo) * 16 + i / 8;
        if (l < len) {
          *reinterpret_cast<uint4*>(&yc[l * y_row + v * 8]) =
              *reinterpret_cast<const uint4*>(&ys[l * kXStride + v * 8]);
        }
      }
    }

    // The state step (as stage 3): S = exp(Acum[last]) S + (x w)^T B, A[m = p][k = s] = xw[s][p].
    if (more) {
      const float dec = __expf(t.acs[len - 1]);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) st[j][e] *= dec;
      }
      const T* xw_lane = &sm.xw[(ln.mrow + (ln.mat >> 1) * 8) * kXStride + p0 + (ln.mat & 1) * 8];
      // B[k = s][n] = bs[s][n]: matrices (s 0-7, n 0-7), (s 8-15, n 0-7), (s 0-7, n 8-15), (s 8-15, n 8-15).
      const T* bs_lane = &t.bs[(ln.mrow + (ln.mat & 1) * 8) * kBStride + n0 + (ln.mat >> 1) * 8];
#pragma unroll
      for (int kk = 0; kk < kQ / 16; ++kk) {
        uint32_t a[4];
        ldsm_x4_trans(a, xw_lane + kk * 16 * kXStride);
#pragma unroll
        for (int jq = 0; jq < 2; ++jq) {
          uint32_t b[4];
          ldsm_x4_trans(b, bs_lane + kk * 16 * kBStride + jq * 16);
          mma_16816<T>(st[2 * jq], a, b[0], b[1]);
          mma_16816<T>(st[2 * jq + 1], a, b[2], b[3]);
        }
      }
    }
  }
}

template <typename T>
void launch_split(const SsdParams& p, cudaStream_t stream) {
  launch_with_smem(ssd_chunk_scan_split_mma_kernel<T>,
                   static_cast<unsigned>(p.n_supers) * static_cast<unsigned>(p.H), kSplitThreads, sizeof(SplitSmem<T>),
                   p, stream, "ops::ssd_chunk_scan (chunk_scan split mma)");
}

}  // namespace

template <typename T>
void launch_ssd_chunk_scan_split_mma(const SsdParams& p, cudaStream_t stream) {
  launch_split<T>(p, stream);
}

template void launch_ssd_chunk_scan_split_mma<__nv_bfloat16>(const SsdParams&, cudaStream_t);
template void launch_ssd_chunk_scan_split_mma<__half>(const SsdParams&, cudaStream_t);

}  // namespace chimera::cuda
