// Vectorised global loads and stores of N consecutive elements converted to / from fp32 registers, and the
// host-side checks that decide whether a tensor may take the vector path (alignment) or share one dtype.
//
// load_f32<U, N, kReadOnly>(p, v): N elements of U at p; N * sizeof(U) bytes are moved in the widest chunks
// (16, 8, 4 or 2 bytes) that divide them, so one bf16 x 8 or f32 x 4 group is a single 16-byte access.
// p must be aligned to min(16, N * sizeof(U)) bytes: true for element offsets that are multiples of N from a
// 16-byte aligned base (what vec_aligned() checks on the host).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <utility>

#include "backends/cuda/cuda_common.cuh"
#include "core/tensor.h"

namespace chimera::cuda {

namespace detail {
template <int kBytes>
struct Chunk;
template <>
struct Chunk<16> {
  using type = uint4;
};
template <>
struct Chunk<8> {
  using type = uint2;
};
template <>
struct Chunk<4> {
  using type = uint32_t;
};
template <>
struct Chunk<2> {
  using type = uint16_t;
};
constexpr int chunk_bytes(int bytes) {
  return bytes >= 16 ? 16 : bytes;
}
}  // namespace detail

// kReadOnly: the data is not written while the kernel runs (weights, inputs): the non-coherent path (__ldg).
template <typename U, int N, bool kReadOnly = true>
__device__ __forceinline__ void load_f32(const U* p, float (&v)[N]) {
  constexpr int kBytes = N * static_cast<int>(sizeof(U));
  constexpr int kChunkBytes = detail::chunk_bytes(kBytes);
  using C = typename detail::Chunk<kChunkBytes>::type;
  alignas(16) U tmp[N];
  const C* src = reinterpret_cast<const C*>(p);
  C* dst = reinterpret_cast<C*>(tmp);
#pragma unroll
  for (int c = 0; c < kBytes / kChunkBytes; ++c) {
    if constexpr (kReadOnly) {
      dst[c] = __ldg(src + c);
    } else {
      dst[c] = src[c];
    }
  }
#pragma unroll
  for (int j = 0; j < N; ++j) v[j] = to_float<U>(tmp[j]);
}

template <typename U, int N>
__device__ __forceinline__ void store_f32(U* p, const float (&v)[N]) {
  constexpr int kBytes = N * static_cast<int>(sizeof(U));
  constexpr int kChunkBytes = detail::chunk_bytes(kBytes);
  using C = typename detail::Chunk<kChunkBytes>::type;
  alignas(16) U tmp[N];
#pragma unroll
  for (int j = 0; j < N; ++j) tmp[j] = from_float<U>(v[j]);
  const C* src = reinterpret_cast<const C*>(tmp);
  C* dst = reinterpret_cast<C*>(p);
#pragma unroll
  for (int c = 0; c < kBytes / kChunkBytes; ++c) dst[c] = src[c];
}

// Rounds v to U and back: the value a reader of the stored element will see.
template <typename U>
__device__ __forceinline__ float round_to(float v) {
  return to_float<U>(from_float<U>(v));
}

// Elements of one 16-byte access.
template <typename T>
constexpr int vec_width() {
  return 16 / static_cast<int>(sizeof(T));
}

// 8 packed 16-bit values (one 16-byte access of bf16 / f16) -> fp32: the GEMV kernels' weight and activation chunks.
template <typename T>
__device__ __forceinline__ void unpack8(const uint4& v, float (&f)[8]);
template <>
__device__ __forceinline__ void unpack8<__nv_bfloat16>(const uint4& v, float (&f)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {  // bf16 -> f32 is a shift: low half is element 2i, high half 2i + 1
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
template <>
__device__ __forceinline__ void unpack8<__half>(const uint4& v, float (&f)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    __half2 h;
    static_assert(sizeof(h) == sizeof(uint32_t));
    __builtin_memcpy(&h, &w[i], sizeof(h));
    const float2 p = __half22float2(h);
    f[2 * i] = p.x;
    f[2 * i + 1] = p.y;
  }
}

// A 16-byte load of data read once per step and never written while the kernel runs (streamed weights): the
// non-coherent path without L1 allocation. volatile keeps the loads where they are written (issued ahead of the
// FMAs that consume the previous ones); the registers are waited for only where they are used.
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// True when every pointer is 16-byte aligned (then element offsets that are multiples of the vector width
// keep every access aligned).
inline bool vec_aligned(std::initializer_list<const void*> ptrs) {
  for (const void* p : ptrs) {
    if (p != nullptr && reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  }
  return true;
}

// One activation dtype per call (the CUDA backend's contract): fails naming every tensor when they differ.
inline void require_same_dtype(const char* op, std::initializer_list<std::pair<const char*, const Tensor*>> ts) {
  const DType d = ts.begin()->second->dtype();
  for (const auto& e : ts) {
    if (e.second->dtype() == d) continue;
    std::string all;
    for (const auto& f : ts) all += str_cat(all.empty() ? "" : ", ", f.first, " ", f.second->describe());
    throw_runtime(str_cat(op, ": the activations of one call must share a dtype on CUDA, got ", all));
  }
}

}  // namespace chimera::cuda
