// E4M3 conversions in kernels (the FP8 linear, the FP8 experts' GEMV, the quantizers and the fused norm + quant
// kernels), and the block-level dynamic scale (max |x| / 448) they share.
//
// Encoding: cvt.rn.satfinite.e4m3x2.f32 (sm_89+, one instruction for two values): round to nearest even,
// magnitudes beyond 448 (infinities included) saturate to +-448, NaN becomes a NaN code (0x7f / 0xff). That is
// core/fp8.h's f32_to_e4m3 with E4m3Overflow::kSaturate bit for bit on every finite input and on infinities (the
// tests do not pin the sign of a NaN code). The division x / input_scale is __fdiv_rn (IEEE, correctly rounded), as
// the CPU's `/`, so a quantized activation is the same byte on both.
// Decoding: cvt.rn.f16x2.e4m3x2: every e4m3 value is exact in f16 (3 mantissa bits; 2^-9 .. 448).
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

#include "backends/cuda/cuda_common.cuh"
#include "backends/cuda/cuda_vec.cuh"

namespace chimera::cuda::fp8 {

// Two values -> two e4m3 bytes (a in the low byte).
__device__ __forceinline__ uint16_t encode2(float a, float b) {
  return static_cast<uint16_t>(__nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3));
}

// e4m3(v / scale) as a byte pair: the quantizer's rounding (x / input_scale, then e4m3).
__device__ __forceinline__ uint16_t quantize2(float a, float b, float scale) {
  return encode2(__fdiv_rn(a, scale), __fdiv_rn(b, scale));
}

// Two e4m3 bytes (element 0 in the low byte) -> f16x2 holding their exact values.
__device__ __forceinline__ __half2 decode2_h(uint16_t pair) {
  const __half2_raw r = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair), __NV_E4M3);
  return __half2(r);
}

// Two e4m3 bytes -> their exact values in fp32.
__device__ __forceinline__ float2 decode2(uint16_t pair) {
  return __half22float2(decode2_h(pair));
}

// N values quantized to N bytes at dst (N = 1, 2, 4, 8 or 16; dst aligned to N bytes).
template <int N>
__device__ __forceinline__ void store_quantized(uint8_t* dst, const float (&v)[N], float scale) {
  if constexpr (N == 1) {
    *dst = static_cast<uint8_t>(quantize2(v[0], 0.0f, scale) & 0xffu);
  } else {
    uint16_t pairs[N / 2];
#pragma unroll
    for (int i = 0; i < N / 2; ++i) pairs[i] = quantize2(v[2 * i], v[2 * i + 1], scale);
    if constexpr (N == 2) {
      *reinterpret_cast<uint16_t*>(dst) = pairs[0];
    } else if constexpr (N == 4) {
      *reinterpret_cast<uint32_t*>(dst) = pairs[0] | (static_cast<uint32_t>(pairs[1]) << 16);
    } else {
      uint32_t w[N / 4];
#pragma unroll
      for (int i = 0; i < N / 4; ++i) w[i] = pairs[2 * i] | (static_cast<uint32_t>(pairs[2 * i + 1]) << 16);
      if constexpr (N == 8) {
        *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
      } else {
        *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
      }
    }
  }
}

// The maximum of m over the block, returned to every thread (fmaxf: NaNs skipped). Every thread must call it.
template <int kBlockThreads>
__device__ float block_max(float m) {
  __shared__ float warp_max[kBlockThreads / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = m;
  __syncthreads();
  m = 0.0f;
#pragma unroll
  for (int w = 0; w < kBlockThreads / 32; ++w) m = fmaxf(m, warp_max[w]);
  __syncthreads();  // warp_max is free again: a kernel may call this more than once
  return m;
}

// max / 448 correctly rounded (core/fp8.h's fp8_weight_scale), 1 for a zero maximum.
__device__ __forceinline__ float scale_for_amax(float m) {
  return m > 0.0f ? __fdiv_rn(m, 448.0f) : 1.0f;
}

// ActQuant::kDynamic's per-tensor scale of x [n] (n % 8 == 0, 16-byte aligned) as one block computes it: the
// maximum of |x| (fmaxf: a NaN is skipped, as std::max skips it on the CPU; an infinity gives s = inf), then
// scale_for_amax. Every thread gets s.
template <typename T, int kBlockThreads>
__device__ float block_dynamic_scale(const T* x, int64_t n) {
  float m = 0.0f;
  for (int64_t i = static_cast<int64_t>(threadIdx.x) * 8; i < n; i += int64_t{kBlockThreads} * 8) {
    float v[8];
    load_f32<T, 8, false>(x + i, v);
#pragma unroll
    for (int j = 0; j < 8; ++j) m = fmaxf(m, fabsf(v[j]));
  }
  return scale_for_amax(block_max<kBlockThreads>(m));
}

}  // namespace chimera::cuda::fp8
