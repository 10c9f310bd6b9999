// Device pieces shared by the ONESHOT, TWOSHOT and NCCL-epilogue kernels: 16-byte vectors of T <-> fp32
// registers, the Lamport empty pattern, the fused epilogue (residual add -> RMSNorm -> FP8) and the
// runtime -> template dispatch.
#pragma once

#include <cuda_fp8.h>

#include "backends/cuda/cuda_common.cuh"
#include "backends/cuda/dist/allreduce_kernels.h"
#include "backends/cuda/norm/row_norm.cuh"

namespace chimera::cuda::dist {

using chimera::dist::has_fp8_out;
using chimera::dist::has_norm;
using chimera::dist::has_norm_out;
using chimera::dist::has_residual;
using chimera::dist::kLamportEmpty32;
using chimera::dist::lamport_clear_slot;
using chimera::dist::lamport_next_slot;
using chimera::dist::lamport_offset;
using chimera::dist::Range;

inline constexpr int kMaxThreads = 1024;
inline constexpr int kMaxItems = 4;  // 16-byte vectors per thread (dist::kMaxRowVecs = 1024 x 4)

template <typename T>
struct VecOf {
  static constexpr int kN = 16 / static_cast<int>(sizeof(T));  // elements in one 16-byte vector
};

// u by value: a caller passing a vector in global memory gets one 16-byte load (a reference let the memcpy below
// read it as 16 single-byte loads: as the PTX of the kernels shows).
template <typename T>
__device__ __forceinline__ void add_unpacked(const uint4 u, float (&acc)[VecOf<T>::kN]) {
  constexpr int kN = VecOf<T>::kN;
  T e[kN];
  static_assert(sizeof(e) == 16);
  __builtin_memcpy(e, &u, 16);
#pragma unroll
  for (int j = 0; j < kN; ++j) acc[j] += to_float<T>(e[j]);
}

template <typename T>
__device__ __forceinline__ uint4 pack(const float (&v)[VecOf<T>::kN]) {
  constexpr int kN = VecOf<T>::kN;
  T e[kN];
#pragma unroll
  for (int j = 0; j < kN; ++j) e[j] = from_float<T>(v[j]);
  uint4 u;
  __builtin_memcpy(&u, e, 16);
  return u;
}

// ---- the Lamport empty pattern (allreduce_index.h) --------------------------------------------------------
__device__ __forceinline__ bool word_has_empty16(uint32_t w) {
  return (w & 0xffffu) == 0x8000u || (w >> 16) == 0x8000u;
}
template <typename T>
__device__ __forceinline__ bool has_empty(const uint4& u) {
  if constexpr (sizeof(T) == 4) {
    return u.x == kLamportEmpty32 || u.y == kLamportEmpty32 || u.z == kLamportEmpty32 || u.w == kLamportEmpty32;
  } else {
    return word_has_empty16(u.x) || word_has_empty16(u.y) || word_has_empty16(u.z) || word_has_empty16(u.w);
  }
}
// Real values that look empty: 16-bit -0.0 -> +0.0; fp32 0x80008000 (-1.8e-40) -> -0.0f.
__device__ __forceinline__ uint32_t canon_word16(uint32_t w) {
  if ((w & 0xffffu) == 0x8000u) w &= 0xffff0000u;
  if ((w >> 16) == 0x8000u) w &= 0x0000ffffu;
  return w;
}
template <typename T>
__device__ __forceinline__ uint4 canonicalise(uint4 u) {
  if constexpr (sizeof(T) == 4) {
    u.x = u.x == kLamportEmpty32 ? 0x80000000u : u.x;
    u.y = u.y == kLamportEmpty32 ? 0x80000000u : u.y;
    u.z = u.z == kLamportEmpty32 ? 0x80000000u : u.z;
    u.w = u.w == kLamportEmpty32 ? 0x80000000u : u.w;
  } else {
    u.x = canon_word16(u.x);
    u.y = canon_word16(u.y);
    u.z = canon_word16(u.z);
    u.w = canon_word16(u.w);
  }
  return u;
}

// A load that always goes to memory (the Lamport spin: peers write this location while we poll it).
__device__ __forceinline__ uint4 ld_volatile(const uint4* p) {
  uint4 u;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(u.x), "=r"(u.y), "=r"(u.z), "=r"(u.w)
               : "l"(p)
               : "memory");
  return u;
}

__device__ __forceinline__ uint4 lamport_empty_vec() {
  return make_uint4(kLamportEmpty32, kLamportEmpty32, kLamportEmpty32, kLamportEmpty32);
}

// The ONESHOT push (oneshot.cu): message vectors [begin, end) of the input, canonicalised,
// into region [slot][this rank] of the Lamport buffers of ranks rank + first, ..., rank + n - 1 (mod n): first = 0
// includes this rank's own buffer, 1 the peers only. Each rank starts at a different peer.
template <typename T>
__device__ __forceinline__ void lamport_push(const FusionArgs& a, const PeerArgs& p, int slot, int n, int64_t stride,
                                             int64_t begin, int64_t end, int first) {
  for (int64_t e = begin + threadIdx.x; e < end; e += blockDim.x) {
    const uint4 u = canonicalise<T>(__ldg(reinterpret_cast<const uint4*>(a.input) + e));
    for (int k = first; k < n; ++k) {
      const int dst = (p.rank + k) % n;
      __stcg(reinterpret_cast<uint4*>(p.lamport[dst]) + lamport_offset(slot, p.rank, e, n, stride), u);
    }
  }
}

// ---- the fused epilogue -----------------------------------------------------------------------------------
// y (the kN normalized values of 16-byte vector e of the row-major output) -> kN e4m3 bytes at fp8_out + e * kN.
template <int kN>
__device__ __forceinline__ void store_fp8(const float (&y)[kN], float inv_scale, void* fp8_out, int64_t e) {
  uint8_t q[kN];
#pragma unroll
  for (int j = 0; j < kN; ++j) {
    q[j] = static_cast<uint8_t>(__nv_cvt_float_to_fp8(y[j] * inv_scale, __NV_SATFINITE, __NV_E4M3));
  }
  uint8_t* dst = static_cast<uint8_t*>(fp8_out) + e * kN;
  if constexpr (kN == 8) {
    uint2 u;
    __builtin_memcpy(&u, q, 8);
    *reinterpret_cast<uint2*>(dst) = u;
  } else {
    uint32_t u;
    __builtin_memcpy(&u, q, 4);
    *reinterpret_cast<uint32_t*>(dst) = u;
  }
}

// The epilogue of fuse_row and fuse_row_loaded, which differ only in where the residual and the norm weight
// come from: residual(i, e) and weight(i, vi) return the raw 16-byte vector of residual_in at [row, n_vecs]
// index e = row * n_vecs + vi and of norm_weight at vi, for this thread's item i (vi = threadIdx.x + i *
// blockDim.x < n_vecs). Each is called once, at the point in the arithmetic where the value is first used.
template <typename T, FusionPattern P, int kItems, typename Residual, typename Weight>
__device__ __forceinline__ void fuse_row_with(float (&v)[kItems][VecOf<T>::kN], int64_t row, int n_vecs,
                                              const FusionArgs& a, Residual residual, Weight weight) {
  constexpr int kN = VecOf<T>::kN;
  const int64_t base = row * n_vecs;
  if constexpr (P == FusionPattern::kAllReduce) {
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int vi = static_cast<int>(threadIdx.x) + i * static_cast<int>(blockDim.x);
      if (vi < n_vecs) reinterpret_cast<uint4*>(a.output)[base + vi] = pack<T>(v[i]);
    }
  } else {
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int vi = static_cast<int>(threadIdx.x) + i * static_cast<int>(blockDim.x);
      if (vi >= n_vecs) continue;
      if constexpr (has_residual(P)) {
        add_unpacked<T>(residual(i, base + vi), v[i]);
        reinterpret_cast<uint4*>(a.residual_out)[base + vi] = pack<T>(v[i]);
      }
#pragma unroll
      for (int j = 0; j < kN; ++j) ss += v[i][j] * v[i][j];
    }
    const float rinv = rsqrtf(norm::row_sum(ss) / static_cast<float>(a.hidden) + a.eps);
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int vi = static_cast<int>(threadIdx.x) + i * static_cast<int>(blockDim.x);
      if (vi >= n_vecs) continue;
      float w[kN] = {};
      add_unpacked<T>(weight(i, vi), w);
      float y[kN];
#pragma unroll
      for (int j = 0; j < kN; ++j) y[j] = v[i][j] * rinv * w[j];
      if constexpr (has_norm_out(P)) reinterpret_cast<uint4*>(a.norm_out)[base + vi] = pack<T>(y);
      if constexpr (has_fp8_out(P)) store_fp8<kN>(y, a.fp8_inv_scale, a.fp8_out, base + vi);
    }
  }
}

// v: this thread's vectors of row `row` (vector i is vecs_per_row index threadIdx.x + i * blockDim.x), the full
// sum over ranks in fp32. Every thread of the block calls it (the norm reduces over the block).
template <typename T, FusionPattern P, int kItems>
__device__ __forceinline__ void fuse_row(float (&v)[kItems][VecOf<T>::kN], int64_t row, int n_vecs,
                                         const FusionArgs& a) {
  fuse_row_with<T, P, kItems>(
      v, row, n_vecs, a,
      // Plain loads: residual_in may alias residual_out (each element is read before this thread writes it).
      [&](int, int64_t e) { return reinterpret_cast<const uint4*>(a.residual_in)[e]; },
      [&](int, int vi) { return __ldg(reinterpret_cast<const uint4*>(a.norm_weight) + vi); });
}

// fuse_row with the row's residual and the norm weight already in registers (raw 16-byte vectors, loaded by the
// caller before it polled the Lamport buffer, so their HBM latency overlaps the wait for the peers): res[i] and
// w[i] are vector threadIdx.x + i * blockDim.x of residual_in's row `row` and of norm_weight (unused where the
// pattern has no residual / no norm). Same arithmetic, same order, same stores as fuse_row (fuse_row_with).
template <typename T, FusionPattern P, int kItems>
__device__ __forceinline__ void fuse_row_loaded(float (&v)[kItems][VecOf<T>::kN], const uint4 (&res)[kItems],
                                                const uint4 (&w)[kItems], int64_t row, int n_vecs,
                                                const FusionArgs& a) {
  fuse_row_with<T, P, kItems>(
      v, row, n_vecs, a, [&](int i, int64_t) { return res[i]; }, [&](int i, int) { return w[i]; });
}

// ---- launch shape and dispatch ----------------------------------------------------------------------------
struct RowShape {
  int n_vecs;   // 16-byte vectors a row
  int threads;  // a multiple of 32, <= 1024
  int items;    // 1, 2 or 4 vectors a thread
};
inline RowShape row_shape(int hidden, int elem_bytes) {
  RowShape s;
  s.n_vecs = hidden * elem_bytes / 16;
  s.threads = std::min(kMaxThreads, (s.n_vecs + 31) / 32 * 32);
  const int items = (s.n_vecs + s.threads - 1) / s.threads;
  s.items = items <= 1 ? 1 : items <= 2 ? 2 : 4;
  return s;
}

// Calls LAUNCH<T, P, kItems>() for the runtime (dtype, pattern, items); fails loudly outside the supported set.
#define CHIMERA_DIST_DISPATCH_ITEMS(items, what, ...)                                                       \
  do {                                                                                                    \
    if ((items) == 1) {                                                                                   \
      constexpr int kItems = 1;                                                                           \
      __VA_ARGS__;                                                                                        \
    } else if ((items) == 2) {                                                                            \
      constexpr int kItems = 2;                                                                           \
      __VA_ARGS__;                                                                                        \
    } else if ((items) == 4) {                                                                            \
      constexpr int kItems = 4;                                                                           \
      __VA_ARGS__;                                                                                        \
    } else {                                                                                              \
      ::chimera::throw_runtime(::chimera::str_cat((what), ": ", (items), " vectors a thread (supported: 1, 2, 4)")); \
    }                                                                                                     \
  } while (0)

#define CHIMERA_DIST_PATTERN_CASE(name, ...)            \
  case FusionPattern::name: {                           \
    constexpr FusionPattern P = FusionPattern::name;    \
    __VA_ARGS__;                                        \
    break;                                              \
  }
#define CHIMERA_DIST_DISPATCH_PATTERN(pattern, what, ...)                                                \
  do {                                                                                                   \
    switch (pattern) {                                                                                   \
      CHIMERA_DIST_PATTERN_CASE(kAllReduce, __VA_ARGS__)                                                 \
      CHIMERA_DIST_PATTERN_CASE(kResidualRmsNorm, __VA_ARGS__)                                           \
      CHIMERA_DIST_PATTERN_CASE(kResidualRmsNormFp8, __VA_ARGS__)                                        \
      CHIMERA_DIST_PATTERN_CASE(kResidualRmsNormOutFp8, __VA_ARGS__)                                     \
      CHIMERA_DIST_PATTERN_CASE(kRmsNorm, __VA_ARGS__)                                                   \
      default:                                                                                           \
        ::chimera::throw_runtime(::chimera::str_cat((what), ": unknown fusion pattern ", static_cast<int>(pattern))); \
    }                                                                                                    \
  } while (0)

}  // namespace chimera::cuda::dist
