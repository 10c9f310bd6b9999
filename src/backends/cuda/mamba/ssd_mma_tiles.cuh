// The pieces the tensor-core SSD kernels share (ssd_mma.cu: chunk_state; ssd_mma_split.cu: chunk_scan): tile shapes, shared-memory chunk tiles and their cp.async loaders,
// ldmatrix wrappers, fragment lane roles, the C.B^T -> A fragment conversion, the accumulator steps the scans
// share (Y_off's row decay, the state rounded into sb, y + D x) and the launch. Every kernel that includes this
// computes its per-element values with these same functions, which is what keeps their results bit-identical.
//
// Shared-memory tiles keep the global layout (rows = tokens), padded by 8 elements per row so ldmatrix row
// addresses fall in distinct bank groups:
//   xs [Q, P + 8]   x rows of this head           (A^T of the state update, B of Y_diag)
//   bs [Q, N + 8]   B rows of this head's group   (B of C.B^T, B of the state update)
//   cs [Q, N + 8]   C rows                        (A of C.B^T and of Y_off)           (scan only)
#pragma once

#include <cstdint>
#include <cstring>

#include "backends/cuda/mamba/mamba_common.cuh"
#include "backends/cuda/mamba/ssd_kernels.cuh"
#include "backends/cuda/mma_sync.cuh"

namespace chimera::cuda::ssd_mma {

constexpr int kQ = kSsdMmaChunk;
constexpr int kP = kSsdMmaHeadDim;
constexpr int kN = kSsdMmaStateSize;
constexpr int kXStride = kP + 8;
constexpr int kBStride = kN + 8;
static_assert(kQ == 128 && kP == 64 && kN == 128, "the warp tilings assume Q = 128, P = 64, N = 128");

// The kernel files take every name here with `using namespace ssd_mma;` plus `using ssd_mma::cp_async_commit;
// using ssd_mma::cp_async_wait;`, which pick these over mma_sync.cuh's chimera::cuda versions of the same name.
//
// ---- PTX wrappers ----------------------------------------------------------------------------------------
// The copy pipeline and ldmatrix here clobber "memory" (the scans write shared tiles they then read through
// ldmatrix): cp_async16 / commit / wait are mamba_common.cuh's; mma_16816, pack2 and smem_addr come from
// mma_sync.cuh.
// 16 bytes global -> shared, zero-filled when !valid (src is then not read).
using mamba::cp_async16;
__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(valid ? 4 : 0)
               : "memory");
}
using mamba::cp_async_commit;
using mamba::cp_async_wait;
// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i.
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p))
               : "memory");
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p))
               : "memory");
}
// Two 8x8 b16 matrices; lanes 0-7 and 8-15 give the row addresses (the other lanes' are not read).
__device__ __forceinline__ void ldsm_x2(uint32_t (&r)[2], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_addr(p))
               : "memory");
}

// One register of two 16-bit values -> two floats (the inverse of pack2, mma_sync.cuh).
template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t u);
template <>
__device__ __forceinline__ float2 unpack2<__nv_bfloat16>(uint32_t u) {
  __nv_bfloat162 v;
  memcpy(&v, &u, 4);
  return __bfloat1622float2(v);
}
template <>
__device__ __forceinline__ float2 unpack2<__half>(uint32_t u) {
  __half2 v;
  memcpy(&v, &u, 4);
  return __half22float2(v);
}

// ---- shared memory ---------------------------------------------------------------------------------
// The scan's tiles of one chunk of one head.
template <typename T>
struct ScanTiles {
  T xs[kQ * kXStride];
  T bs[kQ * kBStride];
  T cs[kQ * kBStride];
  float dt[kQ];
  float acs[kQ];  // dA_cumsum; rows past the chunk's end are zero-filled (finite, and dt = 0 there)
};

// cp.async copies of chunk rows [begin, begin + len): x of head h into xs, B (and C) of group g; rows past
// len are zero-filled. `idx` runs over the calling threads; the caller commits.
template <typename T>
__device__ __forceinline__ void load_x(T* xs, const SsdParams& p, int begin, int len, int h, int idx) {
  const T* x = static_cast<const T*>(p.x);
  const int r = idx / (kP / 8), v = idx % (kP / 8);
  const bool ok = r < len;
  cp_async16(&xs[r * kXStride + v * 8], ok ? x + (static_cast<size_t>(begin + r) * p.H + h) * kP + v * 8 : x, ok);
}
template <typename T>
__device__ __forceinline__ void load_bc(T* tile, const void* src_base, const SsdParams& p, int begin, int len, int g,
                                        int idx) {
  const T* src = static_cast<const T*>(src_base);
  const int r = idx / (kN / 8), v = idx % (kN / 8);
  const bool ok = r < len;
  cp_async16(&tile[r * kBStride + v * 8], ok ? src + (static_cast<size_t>(begin + r) * p.G + g) * kN + v * 8 : src, ok);
}
// which = 0: dt, 1: dA_cumsum; row r of the chunk of head h.
__device__ __forceinline__ void load_dt(float* dst, const SsdParams& p, int begin, int len, int h, int which, int r) {
  const bool ok = r < len;
  const float* src = which == 0 ? p.dt : p.dA_cumsum;
  cp_async4(&dst[r], ok ? src + static_cast<size_t>(h) * p.T + begin + r : src, ok);
}

// All of one chunk's scan tiles, spread over the block's kBlockThreads threads (>= 2 Q: the first 2 Q copy one
// dt / dA_cumsum row each).
template <typename T, int kBlockThreads>
__device__ __forceinline__ void load_scan_chunk(ScanTiles<T>& t, const SsdParams& p, int begin, int len, int h, int g) {
  static_assert(kBlockThreads >= 2 * kQ && (kQ * kP / 8) % kBlockThreads == 0, "copy split");
  const int tid = threadIdx.x;
#pragma unroll
  for (int i = 0; i < kQ * kP / 8 / kBlockThreads; ++i) load_x(t.xs, p, begin, len, h, tid + i * kBlockThreads);
#pragma unroll
  for (int i = 0; i < kQ * kN / 8 / kBlockThreads; ++i) {
    load_bc(t.bs, p.B, p, begin, len, g, tid + i * kBlockThreads);
    load_bc(t.cs, p.C, p, begin, len, g, tid + i * kBlockThreads);
  }
  if (kBlockThreads == 2 * kQ || tid < 2 * kQ) load_dt(tid < kQ ? t.dt : t.acs, p, begin, len, h, tid / kQ, tid % kQ);
}

// Lane roles in the fragments (PTX ISA, mma.m16n8k16 and ldmatrix):
//   gid = lane / 4, t4 = lane % 4: accumulator (row gid | gid + 8, cols 2 t4, 2 t4 + 1)
//   ldmatrix x4: lane supplies row (lane % 8) of matrix (lane / 8).
struct Lane {
  int lane, gid, t4, mrow, mat;
  __device__ explicit Lane(int l) : lane(l), gid(l >> 2), t4(l & 3), mrow(l & 7), mat(l >> 3) {}
};

// One n8 half of a C.B^T tile: accumulators cb (rows l0, l1; columns s, s + 1 with s = 16 j + 8 nt + 2 t4)
// scaled by exp(Acum[l] - Acum[s]) dt[s] (zero above the diagonal; as = Acum[s], Acum[s + 1], d = dt[s],
// dt[s + 1]) and packed to T: lo = {row l0, s, s + 1}, hi = {row l1, s, s + 1}, i.e. A fragment registers 2 nt
// and 2 nt + 1 of the product with x.
// kCausal = false: the caller knows the tile lies below the diagonal (s < l0 for every element), the mask is
// then always true and skipped; the values are the same.
template <typename T, bool kCausal = true>
__device__ __forceinline__ void cb_half_to_a(uint32_t& lo, uint32_t& hi, const float (&cb)[4], float2 as, float2 d,
                                             int s, int l0, int l1, float al0, float al1) {
  const float v00 = !kCausal || s <= l0 ? cb[0] * __expf(al0 - as.x) * d.x : 0.0f;
  const float v01 = !kCausal || s + 1 <= l0 ? cb[1] * __expf(al0 - as.y) * d.y : 0.0f;
  const float v10 = !kCausal || s <= l1 ? cb[2] * __expf(al1 - as.x) * d.x : 0.0f;
  const float v11 = !kCausal || s + 1 <= l1 ? cb[3] * __expf(al1 - as.y) * d.y : 0.0f;
  lo = pack2<T>(v00, v01);
  hi = pack2<T>(v10, v11);
}

// Y_off's decay: kTiles accumulator tiles of rows l0 (elements 0, 1) and l1 (elements 2, 3) times exp(al0) and
// exp(al1), al = Acum[l].
template <int kTiles>
__device__ __forceinline__ void scale_rows(float (&acc)[kTiles][4], float al0, float al1) {
  const float e0 = __expf(al0), e1 = __expf(al1);
#pragma unroll
  for (int j = 0; j < kTiles; ++j) {
    acc[j][0] *= e0;
    acc[j][1] *= e0;
    acc[j][2] *= e1;
    acc[j][3] *= e1;
  }
}

// This warp's C.B^T tile j (rows l0, l1; both n8 halves) as the A fragment of the product with x:
// {row gid, k 0-7}, {row gid + 8, k 0-7}, {row gid, k 8-15}, {row gid + 8, k 8-15}.
template <typename T>
__device__ __forceinline__ void cb_to_a(uint32_t (&af)[4], const float (&cb)[2][4], const float* acs, const float* dt,
                                        int j, int l0, int l1, float al0, float al1, const Lane& ln) {
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    const int s = j * 16 + nt * 8 + 2 * ln.t4;
    cb_half_to_a<T>(af[2 * nt], af[2 * nt + 1], cb[nt], make_float2(acs[s], acs[s + 1]), make_float2(dt[s], dt[s + 1]),
                    s, l0, l1, al0, al1);
  }
}

// The state entering superchunk sc of head h (stage 4's output, fp32) into this lane's share of the state-step
// accumulators: rows p0 + gid (st[j][0..1]) and p0 + gid + 8 (st[j][2..3]), columns n0 + 8 j + 2 t4 and + 1, j < J.
// Zeros when !active (an idle head slot of the group scan).
template <int J>
__device__ __forceinline__ void load_entering_state(float (&st)[J][4], const SsdParams& p, int sc, int h, int p0,
                                                    int n0, const Lane& ln, bool active = true) {
  const float* s_in = p.entering + (static_cast<size_t>(sc) * p.H + h) * (kP * kN);
#pragma unroll
  for (int j = 0; j < J; ++j) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int pr = p0 + ln.gid + half * 8, nc = n0 + j * 8 + 2 * ln.t4;
      const float2 v = active ? *reinterpret_cast<const float2*>(&s_in[pr * kN + nc]) : make_float2(0.0f, 0.0f);
      st[j][2 * half] = v.x;
      st[j][2 * half + 1] = v.y;
    }
  }
}

// The same lane share of the state, rounded to T, into sb [P, N + 8] (the B operand of Y_off).
template <typename T, int J>
__device__ __forceinline__ void store_state_tile(T* sb, const float (&st)[J][4], int p0, int n0, const Lane& ln) {
#pragma unroll
  for (int j = 0; j < J; ++j) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int pr = p0 + ln.gid + half * 8, nc = n0 + j * 8 + 2 * ln.t4;
      *reinterpret_cast<uint32_t*>(&sb[pr * kBStride + nc]) = pack2<T>(st[j][2 * half], st[j][2 * half + 1]);
    }
  }
}

// y at row l, columns pc and pc + 1 of the chunk, rounded to T: the accumulators (acc0, acc1) + D x, x read from
// the xs tile.
template <typename T>
__device__ __forceinline__ uint32_t y_plus_dx(float acc0, float acc1, float d_skip, const T* xs, int l, int pc) {
  const float2 xv = unpack2<T>(*reinterpret_cast<const uint32_t*>(&xs[l * kXStride + pc]));
  return pack2<T>(acc0 + d_skip * xv.x, acc1 + d_skip * xv.y);
}

// Host: kernel<<<blocks, threads, smem, stream>>>(p) after the opt-in to more than 48 KB of dynamic shared memory
// (every SSD mma kernel uses it); op names the operation in errors.
inline void launch_with_smem(void (*kernel)(SsdParams), unsigned blocks, unsigned threads, size_t smem,
                             const SsdParams& p, cudaStream_t stream, const char* op) {
  set_max_dynamic_smem(kernel, smem, op);
  kernel<<<blocks, threads, smem, stream>>>(p);
  CHIMERA_LAUNCH_CHECK(op);
}

}  // namespace chimera::cuda::ssd_mma
