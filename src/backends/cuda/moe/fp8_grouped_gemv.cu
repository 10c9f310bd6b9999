// Grouped FP8 expert GEMV (fp8_moe_kernels.h, Fp8GemvParams): decode, and every shape outside the CUTLASS FP8
// grouped GEMM's domain. Grid (max_items, ceil(N / kFp8GemvRowsPerBlock)); block (i, j) takes work item i (exits
// when i >= *n_items) and weight rows [32 j, 32 j + 32) of its expert: the item's input rows are staged in shared
// memory in the activation dtype (quantized to e4m3 values on the way in for the W8A8 up-projection), then warp w
// streams rows 4w .. 4w + 3, lane l the 16-byte chunks l, l + 32, ... of each, two chunks per row per step (eight
// 16-byte loads in flight per lane before the FMAs that use them; the first step's are issued before the staging,
// which depends on the item only through the expert, so the staging's round trips overlap them), the e4m3 bytes
// converted through half2 (exact), fp32 FMAs against every staged row, warp-shuffle reduction (a fixed order: the
// same bits on every run). At decode (one token per active expert) a block moves 32 x K weight bytes and touches
// each once: the expert bytes stream from HBM once per item, the floor being the selected experts' bytes over the
// copy bandwidth.
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>

#include "backends/cuda/cuda_common.cuh"
#include "backends/cuda/launch.cuh"
#include "backends/cuda/moe/fp8_moe_kernels.h"

namespace chimera::cuda::moe {
namespace {

constexpr int kThreads = 256;
constexpr int kRows = kFp8GemvRowsPerWarp;
constexpr int kUnroll = 2;  // 16-byte chunks per row and lane per step
constexpr int kMaxNt = kFp8GemvMaxTileRows;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float e4m3_value(uint8_t code) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code), __NV_E4M3)));
}
// Saturated (+-448), round to nearest even; NaN stays NaN.
__device__ __forceinline__ uint8_t e4m3_code(float v) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

// 16 e4m3 bytes -> 16 floats (through half2: exact).
__device__ __forceinline__ void e4m3x16_to_f32(const uint4& c, float (&w)[16]) {
  const uint32_t words[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(words[i] & 0xffffu), __NV_E4M3);
    const __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(words[i] >> 16), __NV_E4M3);
    const float2 a = __half22float2(__half2(lo)), b = __half22float2(__half2(hi));
    w[4 * i + 0] = a.x;
    w[4 * i + 1] = a.y;
    w[4 * i + 2] = b.x;
    w[4 * i + 3] = b.y;
  }
}

// 16 staged activations (one 16-element chunk of a row) -> floats.
template <typename TA>
__device__ __forceinline__ void load16(const TA* p, float (&v)[16]) {
  if constexpr (sizeof(TA) == 4) {
    const float4* q = reinterpret_cast<const float4*>(p);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float4 f = q[i];
      v[4 * i] = f.x;
      v[4 * i + 1] = f.y;
      v[4 * i + 2] = f.z;
      v[4 * i + 3] = f.w;
    }
  } else {
    const uint4* q = reinterpret_cast<const uint4*>(p);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const uint4 u = q[i];
      const TA* h = reinterpret_cast<const TA*>(&u);
#pragma unroll
      for (int j = 0; j < 8; ++j) v[8 * i + j] = to_float(h[j]);
    }
  }
}

// kVec: K % 16 == 0 and 16-byte aligned weight rows and staged rows.
// At most 128 registers a thread, so two blocks share an SM (16 warps keeping 8 loads each in flight).
template <typename TA, bool kVec>
__global__ void __launch_bounds__(kThreads, 2) moe_fp8_gemv_kernel(const Fp8GemvParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  TA* xs = reinterpret_cast<TA*>(smem_raw);  // [tile_rows][K]
  pdl_wait();                                // the permutation, x / h and the scales' producers
  pdl_trigger();
  const int item_idx = static_cast<int>(blockIdx.x);
  if (item_idx >= *p.n_items) return;
  const int4 item = p.items[item_idx];
  const int e = item.x, r0 = item.y, rows = item.z;
  const int K = p.K, N = p.N;
  const float in_s = p.in_scale ? p.in_scale[e] : 1.0f;
  const bool up_quant = p.up && p.in_scale != nullptr;
  const bool in_codes = !p.up && p.in_scale != nullptr;

  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid / 32, lane = tid % 32;
  const int n0 = static_cast<int>(blockIdx.y) * kFp8GemvRowsPerBlock + warp * kRows;
  const int nrows = max(0, min(kRows, N - n0));
  const uint8_t* wbase = p.weight + (static_cast<int64_t>(e) * N + min(n0, N - 1)) * K;
  [[maybe_unused]] const int chunks = K / 16;
  // The first step's weight chunks are requested before the staging (they depend on the item only), so the
  // staging's round trips overlap them.
  [[maybe_unused]] uint4 wc[kRows][kUnroll];
  [[maybe_unused]] auto load_step = [&](int c0) {
#pragma unroll
    for (int j = 0; j < kRows; ++j) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int c = c0 + u * 32 + lane;
        wc[j][u] = (j < nrows && c < chunks)
                       ? __ldg(reinterpret_cast<const uint4*>(wbase + static_cast<int64_t>(j) * K) + c)
                       : make_uint4(0, 0, 0, 0);
      }
    }
  };
  if constexpr (kVec) load_step(0);

  // Stage the item's input rows.
  for (int r = 0; r < rows; ++r) {
    const int64_t src_row = p.up ? p.sorted_pair[r0 + r] / p.top_k : r0 + r;
    TA* dst = xs + static_cast<int64_t>(r) * K;
    if (in_codes) {
      const uint8_t* src = static_cast<const uint8_t*>(p.x) + src_row * K;
      for (int k = tid; k < K; k += kThreads) dst[k] = from_float<TA>(e4m3_value(src[k]));
    } else {
      const TA* src = static_cast<const TA*>(p.x) + src_row * K;
      if (up_quant) {
        for (int k = tid; k < K; k += kThreads)
          dst[k] = from_float<TA>(e4m3_value(e4m3_code(__fdiv_rn(to_float(src[k]), in_s))));
      } else {
        for (int k = tid; k < K; k += kThreads) dst[k] = src[k];
      }
    }
  }
  __syncthreads();

  if (n0 >= N) return;
  float acc[kRows][kMaxNt];
#pragma unroll
  for (int j = 0; j < kRows; ++j) {
#pragma unroll
    for (int r = 0; r < kMaxNt; ++r) acc[j][r] = 0.0f;
  }
  if constexpr (kVec) {
    for (int c0 = 0; c0 < chunks; c0 += 32 * kUnroll) {
      if (c0 > 0) load_step(c0);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int c = c0 + u * 32 + lane;
        if (c >= chunks) break;
        float wf[kRows][16];
#pragma unroll
        for (int j = 0; j < kRows; ++j) e4m3x16_to_f32(wc[j][u], wf[j]);
#pragma unroll
        for (int r = 0; r < kMaxNt; ++r) {
          if (r >= rows) break;
          float xv[16];
          load16(xs + static_cast<int64_t>(r) * K + c * 16, xv);
#pragma unroll
          for (int j = 0; j < kRows; ++j) {
#pragma unroll
            for (int i = 0; i < 16; ++i) acc[j][r] = fmaf(wf[j][i], xv[i], acc[j][r]);
          }
        }
      }
    }
  } else {
    for (int k = lane; k < K; k += 32) {
      float wf[kRows];
#pragma unroll
      for (int j = 0; j < kRows; ++j)
        wf[j] = j < nrows ? e4m3_value(__ldg(wbase + static_cast<int64_t>(j) * K + k)) : 0.0f;
#pragma unroll
      for (int r = 0; r < kMaxNt; ++r) {
        if (r >= rows) break;
        const float xv = to_float(xs[static_cast<int64_t>(r) * K + k]);
#pragma unroll
        for (int j = 0; j < kRows; ++j) acc[j][r] = fmaf(wf[j], xv, acc[j][r]);
      }
    }
  }

  const float alpha = p.w_scale[e] * in_s;
  const float out_s = p.out_scale ? p.out_scale[e] : 1.0f;
#pragma unroll
  for (int j = 0; j < kRows; ++j) {
#pragma unroll
    for (int r = 0; r < kMaxNt; ++r) {
      if (r >= rows) break;
      const float s = warp_sum(acc[j][r]);
      if (lane != 0 || j >= nrows) continue;
      const float v = s * alpha;
      const int n = n0 + j;
      const int64_t row = r0 + r;
      if (p.up) {
        const float h = fmaxf(v, 0.0f);
        const float r2 = to_float(from_float<TA>(h * h));  // the activation dtype's rounding point
        if (p.out_scale) {
          static_cast<uint8_t*>(p.out)[row * N + n] = e4m3_code(__fdiv_rn(r2, out_s));
        } else {
          static_cast<TA*>(p.out)[row * N + n] = from_float<TA>(r2);
        }
      } else {
        const int pair = p.sorted_pair[row];
        static_cast<float*>(p.out)[static_cast<int64_t>(pair) * N + n] = __fmul_rn(p.topk_weights[pair], v);
      }
    }
  }
}

template <typename TA, bool kVec>
void launch_typed(const Fp8GemvParams& p, cudaStream_t stream) {
  const size_t smem = static_cast<size_t>(p.tile_rows) * p.K * sizeof(TA);
  auto* kernel = moe_fp8_gemv_kernel<TA, kVec>;
  // The cap, not this launch's size: one value for every launch (occupancy follows each launch's own smem).
  set_max_dynamic_smem(kernel, kFp8GemvMaxSmemBytes, "cuda::moe_experts_fp8");
  const dim3 grid(static_cast<unsigned>(p.max_items), static_cast<unsigned>(ceil_div(p.N, kFp8GemvRowsPerBlock)));
  CHIMERA_CUDA_CHECK(launch(kernel, grid, dim3(kThreads), smem, stream, p), "cuda::moe_experts_fp8");
}

}  // namespace

void launch_moe_fp8_gemv(const Fp8GemvParams& p, DType act, cudaStream_t stream) {
  if (p.max_items <= 0 || p.N <= 0) return;
  if (p.tile_rows < 1 || p.tile_rows > kMaxNt) {
    throw_runtime(str_cat("cuda::moe_experts_fp8: tile_rows ", p.tile_rows, " (supported: 1..", kMaxNt, ")"));
  }
  if (static_cast<size_t>(p.tile_rows) * p.K * dtype_size(act) > kFp8GemvMaxSmemBytes) {
    throw_runtime(str_cat("cuda::moe_experts_fp8: ", p.tile_rows, " rows of K ", p.K, " exceed the GEMV's staging"));
  }
  const bool vec = p.K % 16 == 0 && (reinterpret_cast<uintptr_t>(p.weight) & 15u) == 0;
  switch (act) {
    case DType::kF32: vec ? launch_typed<float, true>(p, stream) : launch_typed<float, false>(p, stream); break;
    case DType::kBF16:
      vec ? launch_typed<__nv_bfloat16, true>(p, stream) : launch_typed<__nv_bfloat16, false>(p, stream);
      break;
    case DType::kF16: vec ? launch_typed<__half, true>(p, stream) : launch_typed<__half, false>(p, stream); break;
    default:
      throw_runtime(str_cat("cuda::moe_experts_fp8: activations ", dtype_name(act), " (supported: F32, BF16, F16)"));
  }
}

}  // namespace chimera::cuda::moe
