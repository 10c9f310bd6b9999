// Shared pieces of the CUDA backend: error checks that name the op, dtype <-> C++ type mapping, loud
// runtime-to-template dispatch, float conversions usable in kernels.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.h"
#include "core/error_base.h"

namespace chimera::cuda {

// CHIMERA_CUDA_CHECK(cudaMemcpyAsync(...), "ops::linear") -> kRuntime error naming the op and the CUDA error.
#define CHIMERA_CUDA_CHECK(expr, op)                                                                        \
  do {                                                                                                      \
    const cudaError_t chimera_err_ = (expr);                                                                \
    if (chimera_err_ != cudaSuccess) {                                                                      \
      ::chimera::throw_runtime(::chimera::str_cat((op), ": ", #expr, " failed: ", cudaGetErrorName(chimera_err_), \
                                                  " (", cudaGetErrorString(chimera_err_), ") at ", __FILE__, \
                                                  ":", __LINE__));                                          \
    }                                                                                                       \
  } while (0)

// After every launch: catches bad configurations (and, with CHIMERA_SYNC_CHECK defined, faults).
#define CHIMERA_LAUNCH_CHECK(op) CHIMERA_CUDA_CHECK(cudaGetLastError(), op)

inline cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

// Multiprocessors of the calling thread's current device, queried once per device (device_api.cu). For grid sizing.
int sm_count();

// ---- element types -------------------------------------------------------------------------------
template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <>
__device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

// A plain (coherent) load of element i of an F32 / BF16 / F16 array whose dtype is known only at run time.
__device__ __forceinline__ float load_elem(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::kBF16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case DType::kF16:
      return __half2float(static_cast<const __half*>(p)[i]);
    default:
      return static_cast<const float*>(p)[i];
  }
}

// Runtime dtype -> C++ type: CHIMERA_DISPATCH_FLOAT(t.dtype(), "ops::rms_norm x", T, { launch<T>(...); });
// Anything else fails loudly with the supported set.
#define CHIMERA_DISPATCH_FLOAT(dtype, what, T, ...)                                                   \
  do {                                                                                                \
    switch (dtype) {                                                                                  \
      case ::chimera::DType::kF32: {                                                                  \
        using T = float;                                                                              \
        __VA_ARGS__;                                                                                  \
        break;                                                                                        \
      }                                                                                               \
      case ::chimera::DType::kBF16: {                                                                 \
        using T = __nv_bfloat16;                                                                      \
        __VA_ARGS__;                                                                                  \
        break;                                                                                        \
      }                                                                                               \
      case ::chimera::DType::kF16: {                                                                  \
        using T = __half;                                                                             \
        __VA_ARGS__;                                                                                  \
        break;                                                                                        \
      }                                                                                               \
      default:                                                                                        \
        ::chimera::throw_runtime(::chimera::str_cat((what), ": dtype ", ::chimera::dtype_name(dtype),  \
                                                    " is not supported on CUDA (supported: F32, BF16, F16)")); \
    }                                                                                                 \
  } while (0)

inline int ceil_div(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

// Device scratch for small per-call metadata (cu_seqlens, slots, ...) copied from the host: a per-thread
// growable buffer; the copy is stream-ordered, so reuse across calls on one stream is safe.
void* upload_scratch(const void* host, size_t bytes, cudaStream_t stream, int slot);

// Opt a kernel in to `smem` bytes of dynamic shared memory (needed above the default 48 KB; the setting is per
// device); op names the operation in errors.
template <typename Kernel>
void set_max_dynamic_smem(Kernel* kernel, size_t smem, const char* op) {
  CHIMERA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)),
                     op);
}

// An ops::Indices array (slots, ids) as a device pointer: its `device` copy when it has one (the CUDA-graph decode
// inputs), else `host` uploaded to scratch slot `slot`. A template so this header needs no ops.h.
template <typename Indices>
const int32_t* device_indices(const Indices& ids, cudaStream_t stream, int slot) {
  return ids.device ? ids.device
                    : static_cast<const int32_t*>(upload_scratch(ids.host.data(), ids.host.size_bytes(), stream, slot));
}

}  // namespace chimera::cuda
