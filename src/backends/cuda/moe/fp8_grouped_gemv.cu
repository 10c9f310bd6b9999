// Grouped FP8 expert GEMVs (fp8_moe_kernels.h). Two kernels: the persistent one (Fp8PersistentGemvParams, below
// the general one) for decode with bf16 / f16 activations and 16-multiple K, which is every model's shape; and the
// general one (Fp8GemvParams), which takes any K, F32 activations and every shape outside the CUTLASS FP8 grouped
// GEMM's domain.
//
// The general kernel: Grid (max_items, ceil(N / kFp8GemvRowsPerBlock)); block (i, j) takes work item i (exits
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
#include "backends/cuda/cuda_vec.cuh"
#include "backends/cuda/gemm/fp8_quant.cuh"
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

// ---- the persistent GEMV ------------------------------------------------------------------------------------------
//
// Why: at T = 1 the general kernel's grid (one block per item and 32 rows: 348 blocks of 86 KB for Nano's up
// projection) runs 1.3 waves of blocks that each wait for their item, stage x and then issue only three load steps:
// 30 % of the weight floor. Here (as the bf16 grouped GEMV, grouped_gemv.cu) the grid is 2 blocks per SM and each
// block walks units u = blockIdx.x, + gridDim.x, ... of 16 rows of one item's expert; the next unit's first weight
// loads go out during this unit's last step, so every lane keeps 2 rows x 4 16-byte loads in flight across units.
// The unit's token rows are staged in shared memory as [nt][planes][K / 16] 16-byte planes (two per 16 elements of
// a 16-bit dtype), so lane l's read of plane q at chunk c + l is 512 contiguous bytes per warp; W8A8 rows are staged
// as the e4m3 values of row / s (exact in bf16 and f16), so the loop multiplies decoded weights by staged values
// only and the scales meet the fp32 sum once.
namespace {

constexpr int kPThreads = 256, kPWarps = kPThreads / 32;
constexpr int kPBlocksPerSm = 2;
constexpr int kPUnroll = 4;                  // 16-byte chunks per row and lane per step
constexpr int kPStepChunks = 32 * kPUnroll;  // chunks of a row one step covers (2048 e4m3 weights)
constexpr int kPRows = 2;                    // weight rows per warp (they share the staged token chunks)
constexpr int kPRowsPerUnit = kPWarps * kPRows;

struct PUnit {
  const uint4* w;  // the expert's [N, K / 16] chunks
  int e, row0, r0, nt;
};

template <typename TA, int NT, bool kUp>
__global__ void __launch_bounds__(kPThreads, kPBlocksPerSm)
    moe_fp8_gemv_persistent_kernel(const Fp8PersistentGemvParams p) {
  constexpr int kPlanes = static_cast<int>(sizeof(TA));  // 16-byte planes per 16 elements
  extern __shared__ __align__(16) unsigned char smem_raw[];
  uint4* xs = reinterpret_cast<uint4*>(smem_raw);  // [NT][kPlanes][KC]
  const int tid = static_cast<int>(threadIdx.x), lane = tid % 32, warp = tid / 32;
  const int KC = p.K / 16, N = p.N;
  const int n_tiles = (N + kPRowsPerUnit - 1) / kPRowsPerUnit;
  const uint4* W = reinterpret_cast<const uint4*>(p.weight);

  pdl_wait();  // the permutation, x / h and the up launch's maxima are visible from here
  pdl_trigger();
  const int total = *p.n_items * n_tiles;
  // The dynamic scale is per tensor: the same s in every block (block-uniform work before the first unit).
  float s_dyn = 1.0f;
  if (p.act == Fp8GemvAct::kDynamic) {
    if constexpr (kUp) {
      s_dyn = fp8::block_dynamic_scale<TA, kPThreads>(static_cast<const TA*>(p.x), static_cast<int64_t>(p.T) * p.K);
    } else {
      float m = 0.0f;
      for (int i = tid; i < p.amax_count; i += kPThreads) m = fmaxf(m, p.amax_in[i]);
      s_dyn = fp8::scale_for_amax(fp8::block_max<kPThreads>(m));
    }
  }

  auto unit_of = [&](int u) {
    const int4 item = p.items[u / n_tiles];
    return PUnit{W + static_cast<int64_t>(item.x) * N * KC, item.x, (u % n_tiles) * kPRowsPerUnit + warp * kPRows,
                 item.y, item.z};
  };
  uint4 wnext[kPRows][kPUnroll];
  auto load_step = [&](const PUnit& un, int c0) {
#pragma unroll
    for (int v = 0; v < kPUnroll; ++v) {
      const int c = c0 + v * 32 + lane;
#pragma unroll
      for (int r = 0; r < kPRows; ++r) {
        const uint4* row = un.w + static_cast<int64_t>(min(un.row0 + r, N - 1)) * KC;
        wnext[r][v] = un.row0 < N && c < KC ? ld_stream(row + c) : make_uint4(0, 0, 0, 0);
      }
    }
  };

  float local_max = 0.0f;  // up: the largest h this thread stored
  int u = static_cast<int>(blockIdx.x);
  PUnit cur{};
  if (u < total) {
    cur = unit_of(u);
    load_step(cur, 0);
  }
  while (u < total) {
    const int un = u + static_cast<int>(gridDim.x);
    const bool has_next = un < total;
    const float s = p.act == Fp8GemvAct::kStatic ? p.in_scale[cur.e] : s_dyn;
    __syncthreads();  // the previous unit's readers of xs are done
    // Stage the unit's rows: up: the x row of each pair's token; down: h rows r0 .. r0 + nt.
    for (int i = tid; i < cur.nt * KC; i += kPThreads) {
      const int m = i / KC, c = i - m * KC;
      const int64_t src = kUp ? p.sorted_pair[cur.r0 + m] / p.top_k : cur.r0 + m;
      const uint4* X = static_cast<const uint4*>(p.x) + src * KC * kPlanes + static_cast<int64_t>(c) * kPlanes;
#pragma unroll
      for (int q = 0; q < kPlanes; ++q) {
        uint4 v = X[q];
        if (p.act != Fp8GemvAct::kNone) {
          float f[8];
          unpack8<TA>(v, f);
          alignas(16) TA t[8];
#pragma unroll
          for (int j = 0; j < 8; j += 2) {
            const float2 d = fp8::decode2(fp8::quantize2(f[j], f[j + 1], s));
            t[j] = from_float<TA>(d.x);
            t[j + 1] = from_float<TA>(d.y);
          }
          memcpy(&v, t, sizeof(v));
        }
        xs[(m * kPlanes + q) * KC + c] = v;
      }
    }
    const PUnit nxt = has_next ? unit_of(un) : cur;
    __syncthreads();

    float acc[kPRows][NT];
#pragma unroll
    for (int r = 0; r < kPRows; ++r)
#pragma unroll
      for (int t = 0; t < NT; ++t) acc[r][t] = 0.0f;
    for (int c0 = 0; c0 < KC; c0 += kPStepChunks) {
      uint4 wcur[kPRows][kPUnroll];
#pragma unroll
      for (int r = 0; r < kPRows; ++r)
#pragma unroll
        for (int v = 0; v < kPUnroll; ++v) wcur[r][v] = wnext[r][v];
      // In flight during this step's FMAs: this unit's next step, or the next unit's first one.
      if (c0 + kPStepChunks < KC) {
        load_step(cur, c0 + kPStepChunks);
      } else if (has_next) {
        load_step(nxt, 0);
      }
#pragma unroll
      for (int v = 0; v < kPUnroll; ++v) {
        const int c = c0 + v * 32 + lane;
        if (c >= KC) break;  // chunks past the row: only in the row's last step
        float wf[kPRows][16];
#pragma unroll
        for (int r = 0; r < kPRows; ++r) e4m3x16_to_f32(wcur[r][v], wf[r]);
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          if (t >= cur.nt) break;
#pragma unroll
          for (int q = 0; q < kPlanes; ++q) {
            float xf[8];
            unpack8<TA>(xs[(t * kPlanes + q) * KC + c], xf);
#pragma unroll
            for (int r = 0; r < kPRows; ++r)
#pragma unroll
              for (int j = 0; j < 8; ++j) acc[r][t] = fmaf(wf[r][8 * q + j], xf[j], acc[r][t]);
          }
        }
      }
    }

    // Lane t stores token t's outputs of this warp's rows.
    const float alpha = p.w_scale[cur.e] * (p.act == Fp8GemvAct::kNone ? 1.0f : s);
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      if (t >= cur.nt) break;
      float v[kPRows];
#pragma unroll
      for (int r = 0; r < kPRows; ++r) v[r] = warp_sum(acc[r][t]);
      if (lane != t) continue;
      const int64_t row = cur.r0 + t;
#pragma unroll
      for (int r = 0; r < kPRows; ++r) {
        const int n = cur.row0 + r;
        if (n >= N) continue;
        const float val = v[r] * alpha;
        if constexpr (kUp) {
          const float g = fmaxf(val, 0.0f);
          const TA h = from_float<TA>(g * g);  // the activation dtype's rounding point
          static_cast<TA*>(p.out)[row * N + n] = h;
          local_max = fmaxf(local_max, to_float(h));
        } else {
          const int pair = p.sorted_pair[row];
          static_cast<float*>(p.out)[static_cast<int64_t>(pair) * N + n] = __fmul_rn(p.topk_weights[pair], val);
        }
      }
    }
    u = un;
    cur = nxt;
  }
  if (kUp && p.amax_out != nullptr) {
    const float m = fp8::block_max<kPThreads>(local_max);
    if (tid == 0) p.amax_out[blockIdx.x] = m;
  }
}

template <typename TA, int NT>
void launch_persistent_nt(const Fp8PersistentGemvParams& p, cudaStream_t stream) {
  const size_t smem = static_cast<size_t>(NT) * p.K * sizeof(TA);
  auto* kernel = p.up ? moe_fp8_gemv_persistent_kernel<TA, NT, true> : moe_fp8_gemv_persistent_kernel<TA, NT, false>;
  set_max_dynamic_smem(kernel, kFp8GemvMaxSmemBytes, "cuda::moe_experts_fp8");
  const dim3 grid(static_cast<unsigned>(fp8_persistent_gemv_grid(p.N, p.max_items)));
  CHIMERA_CUDA_CHECK(launch(kernel, grid, dim3(kPThreads), smem, stream, p), "cuda::moe_experts_fp8");
}

template <typename TA>
void launch_persistent_typed(const Fp8PersistentGemvParams& p, cudaStream_t stream) {
  switch (p.tile_rows) {
    case 1: return launch_persistent_nt<TA, 1>(p, stream);
    case 2: return launch_persistent_nt<TA, 2>(p, stream);
    case 4: return launch_persistent_nt<TA, 4>(p, stream);
    case 8: return launch_persistent_nt<TA, 8>(p, stream);
    default:
      throw_runtime(str_cat("cuda::moe_experts_fp8: persistent GEMV tile of ", p.tile_rows, " rows (1, 2, 4 or 8)"));
  }
}

}  // namespace

int fp8_persistent_gemv_grid(int N, int max_items) {
  const int64_t units = static_cast<int64_t>((N + kPRowsPerUnit - 1) / kPRowsPerUnit) * max_items;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(units, int64_t{kPBlocksPerSm} * sm_count())));
}

void launch_moe_fp8_gemv_persistent(const Fp8PersistentGemvParams& p, DType act, cudaStream_t stream) {
  if (p.max_items <= 0 || p.N <= 0) return;
  const bool aligned =
      (reinterpret_cast<uintptr_t>(p.weight) & 15u) == 0 && (reinterpret_cast<uintptr_t>(p.x) & 15u) == 0;
  if (p.K % 16 != 0 || !aligned || static_cast<size_t>(p.tile_rows) * p.K * 2 > kFp8GemvMaxSmemBytes) {
    throw_runtime(str_cat("cuda::moe_experts_fp8: the persistent GEMV needs K % 16 == 0, 16-byte aligned rows and ",
                          p.tile_rows, " x K x 2 <= ", kFp8GemvMaxSmemBytes, " bytes (K = ", p.K, ")"));
  }
  switch (act) {
    case DType::kBF16: return launch_persistent_typed<__nv_bfloat16>(p, stream);
    case DType::kF16: return launch_persistent_typed<__half>(p, stream);
    default:
      throw_runtime(str_cat("cuda::moe_experts_fp8: the persistent GEMV takes BF16 or F16, not ", dtype_name(act)));
  }
}

}  // namespace chimera::cuda::moe
