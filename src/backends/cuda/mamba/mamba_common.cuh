// Device helpers shared by the Mamba kernels (conv1d, selective state update): packed vector access to
// F32 / BF16 / F16 data as raw 32-bit words, runtime-dtype scalar access for small parameter arrays, and the
// scalar math both kernels and the CPU reference agree on (softplus with threshold 20, fast SiLU).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "backends/cuda/cuda_common.cuh"
#include "core/stochastic_rounding.h"

namespace chimera::cuda::mamba {

// ---- raw packs ------------------------------------------------------------------------------------
// E elements of T (float, __nv_bfloat16 or __half) held as raw 32-bit words, so that a 16-byte pack is one
// vector load and can be moved between lanes with four 32-bit shuffles. Element indices must be
// compile-time constants after unrolling (the words stay in registers).
template <typename T, int E>
struct Pack {
  static constexpr int kBytes = E * static_cast<int>(sizeof(T));
  static constexpr int kWords = (kBytes + 3) / 4;
  // The widest access that divides the pack: 16, 8, 4 or 2 bytes. The caller guarantees that alignment.
  static constexpr int kAccess = kBytes % 16 == 0 ? 16 : kBytes % 8 == 0 ? 8 : kBytes % 4 == 0 ? 4 : 2;
  uint32_t w[kWords];

  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int k = 0; k < kWords; ++k) w[k] = 0u;
  }

  __device__ __forceinline__ float get(int i) const {
    if constexpr (sizeof(T) == 4) {
      return __uint_as_float(w[i]);
    } else {
      const uint32_t bits = (w[i / 2] >> (16 * (i % 2))) & 0xffffu;
      if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        return __uint_as_float(bits << 16);
      } else {
        return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
      }
    }
  }

  // Element i's raw 16 bits (16-bit T only): an already rounded value.
  __device__ __forceinline__ void set_bits(int i, uint32_t bits) {
    static_assert(sizeof(T) == 2, "raw 16-bit element");
    const int sh = 16 * (i % 2);
    w[i / 2] = (w[i / 2] & ~(0xffffu << sh)) | (bits << sh);
  }

  // Rounds v to T (round to nearest even) and stores it as element i.
  __device__ __forceinline__ void set(int i, float v) {
    if constexpr (sizeof(T) == 4) {
      w[i] = __float_as_uint(v);
    } else {
      uint32_t bits;
      if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        bits = __bfloat16_as_ushort(__float2bfloat16_rn(v));
      } else {
        bits = __half_as_ushort(__float2half_rn(v));
      }
      const int sh = 16 * (i % 2);
      w[i / 2] = (w[i / 2] & ~(0xffffu << sh)) | (bits << sh);
    }
  }

  // kStream: cache-streaming hints (ld.global.cs / st.global.cs) for data touched once (the SSM state).
  template <bool kStream = false>
  __device__ __forceinline__ void load(const T* p) {
    if constexpr (kAccess == 16) {
      const uint4* q = reinterpret_cast<const uint4*>(p);
#pragma unroll
      for (int k = 0; k < kWords / 4; ++k) {
        const uint4 v = kStream ? __ldcs(q + k) : q[k];
        w[4 * k] = v.x, w[4 * k + 1] = v.y, w[4 * k + 2] = v.z, w[4 * k + 3] = v.w;
      }
    } else if constexpr (kAccess == 8) {
      const uint2* q = reinterpret_cast<const uint2*>(p);
#pragma unroll
      for (int k = 0; k < kWords / 2; ++k) {
        const uint2 v = kStream ? __ldcs(q + k) : q[k];
        w[2 * k] = v.x, w[2 * k + 1] = v.y;
      }
    } else if constexpr (kAccess == 4) {
      const uint32_t* q = reinterpret_cast<const uint32_t*>(p);
#pragma unroll
      for (int k = 0; k < kWords; ++k) w[k] = q[k];
    } else {
      static_assert(kBytes == 2, "a 2-byte access only for a single 16-bit element");
      w[0] = *reinterpret_cast<const unsigned short*>(p);
    }
  }

  template <bool kStream = false>
  __device__ __forceinline__ void store(T* p) const {
    if constexpr (kAccess == 16) {
      uint4* q = reinterpret_cast<uint4*>(p);
#pragma unroll
      for (int k = 0; k < kWords / 4; ++k) {
        const uint4 v = make_uint4(w[4 * k], w[4 * k + 1], w[4 * k + 2], w[4 * k + 3]);
        if constexpr (kStream) {
          __stcs(q + k, v);
        } else {
          q[k] = v;
        }
      }
    } else if constexpr (kAccess == 8) {
      uint2* q = reinterpret_cast<uint2*>(p);
#pragma unroll
      for (int k = 0; k < kWords / 2; ++k) {
        const uint2 v = make_uint2(w[2 * k], w[2 * k + 1]);
        if constexpr (kStream) {
          __stcs(q + k, v);
        } else {
          q[k] = v;
        }
      }
    } else if constexpr (kAccess == 4) {
      uint32_t* q = reinterpret_cast<uint32_t*>(p);
#pragma unroll
      for (int k = 0; k < kWords; ++k) q[k] = w[k];
    } else {
      *reinterpret_cast<unsigned short*>(p) = static_cast<unsigned short>(w[0]);
    }
  }

  // The pack of the lane `delta` below (lanes < delta keep their own), word by word.
  __device__ __forceinline__ Pack shfl_up(unsigned delta) const {
    Pack r;
#pragma unroll
    for (int k = 0; k < kWords; ++k) r.w[k] = __shfl_up_sync(0xffffffffu, w[k], delta);
    return r;
  }
};

// ---- runtime-dtype scalars (parameters: conv weight / bias, A_log, D, dt_bias; small activations) -----
// Read-only parameter loads go through the read-only data cache (__ldg).
__device__ __forceinline__ float load_param(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::kBF16:
      return __bfloat162float(__ldg(static_cast<const __nv_bfloat16*>(p) + i));
    case DType::kF16:
      return __half2float(__ldg(static_cast<const __half*>(p) + i));
    default:
      return __ldg(static_cast<const float*>(p) + i);
  }
}

// Plain (coherent) loads and stores of one element of a runtime-dtype array (load_elem: cuda_common.cuh).

__device__ __forceinline__ void store_elem(void* p, DType t, int64_t i, float v) {
  switch (t) {
    case DType::kBF16:
      static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
      break;
    case DType::kF16:
      static_cast<__half*>(p)[i] = __float2half_rn(v);
      break;
    default:
      static_cast<float*>(p)[i] = v;
  }
}

// ---- scalar math ----------------------------------------------------------------------------------
// SiLU with the SFU exponential and an approximate divide (__fdividef is MUFU.RCP + FMUL, whereas
// __frcp_rn is the correctly rounded reciprocal with its refinement sequence): a few ulp, far inside the fp32
// elementwise bound. For v < -88, 1 + e^-v is +inf and the result is -0 (the true value is below 1e-37).
// ---- SSM state rounding (ops.h SsmParams, core/stochastic_rounding.h) -----------------------------------
// The rounding key of sequence i of a call: the layer's seed and the position of the token after which the state is
// written (positions: device [batch], nullptr: 0).
__device__ __forceinline__ uint64_t state_key(uint64_t seed, const int32_t* positions, int i) {
  return ssm_rounding_key(seed, positions != nullptr ? positions[i] : 0);
}

// v rounded to the state type S for state element e of its slot: stochastically for __half (the key's bits for e),
// to nearest even otherwise.
template <typename S>
__device__ __forceinline__ S round_state(float v, uint64_t key, uint32_t e) {
  if constexpr (std::is_same_v<S, __half>) {
    return __ushort_as_half(f32_to_f16_stochastic(v, ssm_rounding_bits(key, e)));
  } else {
    return from_float<S>(v);
  }
}

__device__ __forceinline__ float silu_fast(float v) { return __fdividef(v, 1.0f + __expf(-v)); }

// dt = clamp(softplus(dt_raw + dt_bias), dt_min, dt_max) with softplus(v) = v for v > 20 (the CPU reference,
// mamba_ssm and HF); accurate expf / log1pf: dt feeds every state element of the head.
__device__ __forceinline__ float discretize_dt(float v, float dt_min, float dt_max) {
  const float sp = v > 20.0f ? v : log1pf(expf(v));
  return fminf(fmaxf(sp, dt_min), dt_max);
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Resident blocks per SM of a persistent kernel at `threads` threads and `smem` dynamic shared bytes, at least 1,
// for its grid size (persistent SSU, persistent conv1d prefill). Callers keep it in a function-local static: the
// occupancy is asked once per kernel instantiation.
template <typename Kernel>
int resident_blocks_per_sm(Kernel* kernel, int threads, size_t smem, const char* op) {
  int n = 0;
  CHIMERA_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem), op);
  return n > 1 ? n : 1;
}

// Conv taps and bias of E consecutive channels c0.. (weight [C, K], bias [C] or null), as fp32, through the
// read-only cache. vec: weight / bias are in the activation dtype T and 16-byte aligned, and E > 1:
// then E * K taps are E * K * sizeof(T) = 16 * K contiguous bytes, one vector load each 16 bytes.
template <typename T, int E, int K>
__device__ __forceinline__ void load_taps(const void* weight, DType weight_dtype, const void* bias, DType bias_dtype,
                                          bool vec, int64_t c0, float (&w)[E][K], float (&b)[E]) {
  if constexpr (E > 1) {
    if (vec) {
      Pack<T, E * K> wp;
      const uint4* q = reinterpret_cast<const uint4*>(static_cast<const T*>(weight) + c0 * K);
#pragma unroll
      for (int k = 0; k < Pack<T, E * K>::kWords / 4; ++k) {
        const uint4 v = __ldg(q + k);
        wp.w[4 * k] = v.x, wp.w[4 * k + 1] = v.y, wp.w[4 * k + 2] = v.z, wp.w[4 * k + 3] = v.w;
      }
#pragma unroll
      for (int e = 0; e < E; ++e) {
#pragma unroll
        for (int j = 0; j < K; ++j) w[e][j] = wp.get(e * K + j);
      }
      Pack<T, E> bp;
      bp.zero();
      if (bias != nullptr) {
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(static_cast<const T*>(bias) + c0));
        bp.w[0] = v.x, bp.w[1] = v.y, bp.w[2] = v.z, bp.w[3] = v.w;
      }
#pragma unroll
      for (int e = 0; e < E; ++e) b[e] = bp.get(e);
      return;
    }
  }
#pragma unroll
  for (int e = 0; e < E; ++e) {
#pragma unroll
    for (int j = 0; j < K; ++j) w[e][j] = load_param(weight, weight_dtype, (c0 + e) * K + j);
    b[e] = bias != nullptr ? load_param(bias, bias_dtype, c0 + e) : 0.0f;
  }
}

// cp.async for the staged Mamba kernels (persistent SSU, persistent conv1d prefill, SSD tensor-core stages): 16 bytes
// global -> shared, zero-filled when !valid (src is then not read). Unlike mma_sync.cuh's wrappers these clobber
// "memory": these kernels write shared tiles with plain stores and read them back after the wait.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(
                   static_cast<unsigned>(__cvta_generic_to_shared(dst))),
               "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

}  // namespace chimera::cuda::mamba
