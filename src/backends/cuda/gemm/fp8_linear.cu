// FP8 dense layers (gemm/fp8_linear.h): the decode GEMV, the cuBLASLt FP8 GEMM, the dequantized fallback and the
// activation quantizer.
//
// GEMV (T <= kFp8GemvMaxTokens). A block is 8 warps; a weight row is shared by warps_per_row warps (1, 2, 4 or 8,
// the rule of gemm/gemv.cu: enough warps that small-N layers fill every SM, then split until a warp's share of a
// row is one load step); lanes stride the row's 16-byte vectors (16 e4m3 weights each) by 32, kUnroll loads in
// flight per lane; the first step's loads are issued before the PDL wait (weights are constant). Weights are decoded
// two at a time (cvt e4m3x2 -> f16x2, exact) and multiplied in fp32. x is staged once per block in shared memory in
// a staging type S: f32 at one token (no conversion in the loop); else the activation dtype for ActQuant::kNone and,
// for kStatic, the e4m3 values of x / input_scale, exact in f16 (quantized in the staging loop, or decoded from a
// prequantized F8_E4M3 x). The 16 elements that meet one
// weight vector are stored as sizeof(S) "planes" of 16 bytes ([token][plane][vector]), so that lane l's read of
// plane q at vector v + l is 512 contiguous bytes per warp (no bank conflicts). The sum is fp32 (per-lane partials,
// a warp butterfly, the row's warps in order), then y = sum * out_scale (+ bias), rounded once to the output dtype;
// out_scale = scale (kNone) or input_scale * scale (kStatic): the per-tensor scales applied once. ActQuant::kDynamic:
// every block first reduces max |x| over the whole [T, K] input (at most 8 x K values, read from L2 by each block)
// to the per-tensor scale s = max / 448 (1 for zeros), then stages x as kStatic does with s, and out_scale = s * scale.
//
// Dynamic activations at prefill sizes: dynamic_quantize_fp8 (two kernels: per-block maxima of |x|, then every block
// reduces those, block 0 stores s, and all quantize x / s) writes the codes and s to device memory; cuBLASLt reads s
// through CUBLASLT_MATMUL_DESC_B_SCALE_POINTER (D = alpha * scale_B * acc with alpha = scale, a host scalar).
//
// GEMM (cuBLASLt, FP8 E4M3 x E4M3 -> BF16 / F16, CUBLAS_COMPUTE_32F). Row-major y = xq W^T is column-major
// y^T = W xq^T: A is W seen column-major as [K, N] (ld K) with TRANSA = T, B is xq as [K, T] (ld K), D is y^T as
// [N, T] (ld N): the "TN" form FP8 requires. The scales go in as alpha = input_scale * scale, a host scalar: the
// epilogue computes D = alpha * acc exactly as with A / B scale pointers set to the two scales (it multiplies them
// into one fp32 factor), and a host alpha needs no device copy, no upload and nothing allocated per call; under CUDA
// graph capture its value is recorded with the launch (constant per weight). Fast accumulation is OFF
// (CUBLASLT_MATMUL_DESC_FAST_ACCUM = 0): Hopper's FP8 tensor cores keep fewer than 23 mantissa bits in their
// internal accumulator, and without fast accumulation cuBLASLt promotes the partial sums into fp32 registers every
// few k-blocks, which is what "fp32 accumulation" means here (and torch._scaled_mm's default). Per thread: a handle,
// a 32 MiB workspace and a plan cache keyed by shape, dtype, bias, fast_accum and pointer alignments (the algorithm
// is the heuristic's first answer for the key, deterministic on a given cuBLASLt and device).
#include "backends/cuda/gemm/fp8_linear.h"

#include <cublasLt.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <unordered_map>

#include "backends/cuda/cuda_common.cuh"
#include "backends/cuda/cuda_ops.h"
#include "backends/cuda/cuda_vec.cuh"
#include "backends/cuda/gemm/fp8_quant.cuh"
#include "backends/cuda/launch.cuh"
#include "backends/device_api.h"

namespace chimera::cuda {
namespace {

// ---- the GEMV ---------------------------------------------------------------------------------------------------

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kUnroll = 8;                         // 16-byte weight loads in flight per lane per step
constexpr int64_t kGemvMaxSmemBytes = 160 * 1024;  // x staged: tokens (rounded up to 1/2/4/8) x K x sizeof(S)

// Where the GEMV's x comes from.
enum class XSource : int {
  kRaw,       // x in the activation dtype T, used as it is (ActQuant::kNone); S = T
  kQuant,     // x in T, quantized while staged: e4m3(x / x_scale) (ActQuant::kStatic); S = __half
  kDynamic,   // as kQuant with x_scale = max |x| / 448 over all of x, reduced by each block (ActQuant::kDynamic)
  kPrequant,  // x F8_E4M3 codes (fp8_linear_prequant); S = __half
};

struct Fp8GemvParams {
  const void* x = nullptr;     // [T, K]: T (kRaw, kQuant) or e4m3 bytes (kPrequant)
  const uint4* w = nullptr;    // [N, K] e4m3, 16 per vector
  const void* bias = nullptr;  // [N] in the output dtype, or null
  void* y = nullptr;           // [T, N] output dtype
  int T = 0, K = 0, N = 0;
  float x_scale = 1.0f;    // kQuant: input_scale
  float out_scale = 1.0f;  // applied to the fp32 sum (kDynamic: times the block's s)
  int warps_per_row = 0;
};

// 16 bytes of staged x -> its 16 / sizeof(S) values.
template <typename S, int E>
__device__ __forceinline__ void unpack_plane(const uint4& v, float (&f)[E]) {
  if constexpr (std::is_same_v<S, float>) {
    f[0] = __uint_as_float(v.x);
    f[1] = __uint_as_float(v.y);
    f[2] = __uint_as_float(v.z);
    f[3] = __uint_as_float(v.w);
  } else {
    unpack8<S>(v, f);
  }
}

// 16 e4m3 weights -> fp32 (exact).
__device__ __forceinline__ void decode16(const uint4& v, float (&f)[16]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 lo = fp8::decode2(static_cast<uint16_t>(w[i] & 0xffffu));
    const float2 hi = fp8::decode2(static_cast<uint16_t>(w[i] >> 16));
    f[4 * i] = lo.x;
    f[4 * i + 1] = lo.y;
    f[4 * i + 2] = hi.x;
    f[4 * i + 3] = hi.y;
  }
}

// 16 e4m3 codes -> 16 exact f16 values as two 16-byte planes.
__device__ __forceinline__ void codes_to_half_planes(const uint32_t (&w)[4], uint4 (&out)[2]) {
  __half2 h[8];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    h[2 * i] = fp8::decode2_h(static_cast<uint16_t>(w[i] & 0xffffu));
    h[2 * i + 1] = fp8::decode2_h(static_cast<uint16_t>(w[i] >> 16));
  }
  static_assert(sizeof(h) == sizeof(out));
  memcpy(&out, h, sizeof(h));
}


// Dynamic shared memory: x staged as [MT][P][K / 16] 16-byte planes (zeros for the tokens past T).
template <typename T, typename S, XSource kSrc, int MT>
__global__ void __launch_bounds__(kThreads) fp8_gemv_kernel(const Fp8GemvParams p) {
  constexpr int P = static_cast<int>(sizeof(S));  // planes per 16 elements
  constexpr int E = 16 / P;                       // elements per plane
  extern __shared__ uint4 fp8_gemv_smem[];
  uint4* xs = fp8_gemv_smem;
  __shared__ float partial[kWarps][MT];

  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int wpr = p.warps_per_row, rows_per_group = kWarps / wpr;
  const int part = warp % wpr;
  const int kv = p.K / 16;  // 16-byte weight vectors per row
  const int per_part = (kv + wpr - 1) / wpr;
  const int v0 = part * per_part, v1 = min(kv, v0 + per_part);
  const int n_groups = (p.N + rows_per_group - 1) / rows_per_group;

  // Before the grid dependency: this warp's first weight vectors of its first row (constant data).
  uint4 wv[kUnroll];
  int row = static_cast<int>(blockIdx.x) * rows_per_group + warp / wpr;
  {
    const uint4* wrow = p.w + static_cast<int64_t>(min(row, p.N - 1)) * kv;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int v = v0 + lane + u * 32;
      wv[u] = row < p.N && v < v1 ? ld_stream(wrow + v) : make_uint4(0, 0, 0, 0);
    }
  }
  pdl_wait();
  pdl_trigger();
  float x_scale = p.x_scale, out_scale = p.out_scale;
  if constexpr (kSrc == XSource::kDynamic) {
    x_scale = fp8::block_dynamic_scale<T, kThreads>(static_cast<const T*>(p.x), static_cast<int64_t>(p.T) * p.K);
    out_scale *= x_scale;
  }

  // x -> shared memory, one 16-element group per thread and step.
  for (int i = static_cast<int>(threadIdx.x); i < MT * kv; i += kThreads) {
    const int t = i / kv, v = i % kv;
    uint4 planes[P];
    if (t >= p.T) {
#pragma unroll
      for (int q = 0; q < P; ++q) planes[q] = make_uint4(0, 0, 0, 0);
    } else if constexpr (kSrc == XSource::kRaw && std::is_same_v<S, T>) {
      const uint4* src = reinterpret_cast<const uint4*>(static_cast<const T*>(p.x) + static_cast<size_t>(t) * p.K +
                                                        static_cast<size_t>(v) * 16);
#pragma unroll
      for (int q = 0; q < P; ++q) planes[q] = src[q];
    } else if constexpr (kSrc == XSource::kPrequant && std::is_same_v<S, __half>) {
      const uint4 c = static_cast<const uint4*>(p.x)[static_cast<size_t>(t) * kv + v];
      const uint32_t w[4] = {c.x, c.y, c.z, c.w};
      codes_to_half_planes(w, planes);
    } else {
      // The group's 16 values in fp32 (x; the e4m3 values of x / x_scale; the prequantized codes' values), then
      // stored as S (exact: S is T itself, f32, or f16 holding e4m3 values).
      float f[16];
      if constexpr (kSrc == XSource::kPrequant) {
        const uint4 c = static_cast<const uint4*>(p.x)[static_cast<size_t>(t) * kv + v];
        decode16(c, f);
      } else {
        load_f32<T, 16, false>(static_cast<const T*>(p.x) + static_cast<size_t>(t) * p.K + static_cast<size_t>(v) * 16,
                               f);
        if constexpr (kSrc == XSource::kQuant || kSrc == XSource::kDynamic) {
#pragma unroll
          for (int k = 0; k < 8; ++k) {
            const float2 d = fp8::decode2(fp8::quantize2(f[2 * k], f[2 * k + 1], x_scale));
            f[2 * k] = d.x;
            f[2 * k + 1] = d.y;
          }
        }
      }
      alignas(16) S tmp[16];
#pragma unroll
      for (int j = 0; j < 16; ++j) tmp[j] = from_float<S>(f[j]);
      static_assert(sizeof(tmp) == sizeof(planes));
      memcpy(planes, tmp, sizeof(tmp));
    }
#pragma unroll
    for (int q = 0; q < P; ++q) xs[(t * P + q) * kv + v] = planes[q];
  }
  __syncthreads();

  bool preloaded = true;
  for (int g = static_cast<int>(blockIdx.x); g < n_groups; g += static_cast<int>(gridDim.x)) {
    row = g * rows_per_group + warp / wpr;
    const bool active = row < p.N;
    const uint4* wrow = p.w + static_cast<int64_t>(min(row, p.N - 1)) * kv;
    float acc[MT];
#pragma unroll
    for (int t = 0; t < MT; ++t) acc[t] = 0.0f;
    if (active) {
      for (int v = v0 + lane; v < v1; v += kUnroll * 32) {
        if (!preloaded) {
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            const int vu = v + u * 32;
            wv[u] = vu < v1 ? ld_stream(wrow + vu) : make_uint4(0, 0, 0, 0);
          }
        }
        preloaded = false;
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int vu = v + u * 32;
          if (vu < v1) {
            float wf[16];
            decode16(wv[u], wf);
#pragma unroll
            for (int t = 0; t < MT; ++t) {
              float s = acc[t];
#pragma unroll
              for (int q = 0; q < P; ++q) {
                float xf[E];
                unpack_plane<S>(xs[(t * P + q) * kv + vu], xf);
#pragma unroll
                for (int j = 0; j < E; ++j) s = fmaf(wf[q * E + j], xf[j], s);
              }
              acc[t] = s;
            }
          }
        }
      }
    }
    preloaded = false;
#pragma unroll
    for (int t = 0; t < MT; ++t) {
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) acc[t] += __shfl_xor_sync(0xFFFFFFFFu, acc[t], o);
    }
    if (wpr > 1) {
      if (lane == 0) {
#pragma unroll
        for (int t = 0; t < MT; ++t) partial[warp][t] = acc[t];
      }
      __syncthreads();
      if (part == 0) {
#pragma unroll
        for (int t = 0; t < MT; ++t) {
          float s = 0.0f;
          for (int q = 0; q < wpr; ++q) s += partial[warp + q][t];
          acc[t] = s;
        }
      }
      __syncthreads();  // partial is reused by the next row group
    }
    if (part == 0 && active && lane < p.T) {
      float s = 0.0f;
#pragma unroll
      for (int t = 0; t < MT; ++t) {
        if (t == lane) s = acc[t];
      }
      s *= out_scale;
      if (p.bias != nullptr) s += to_float(static_cast<const T*>(p.bias)[row]);
      static_cast<T*>(p.y)[static_cast<int64_t>(lane) * p.N + row] = from_float<T>(s);
    }
  }
}

int gemv_mt(int64_t T) {
  return T <= 1 ? 1 : T <= 2 ? 2 : T <= 4 ? 4 : 8;
}

int auto_warps_per_row(int64_t N, int64_t K, int64_t resident_warps) {
  const int64_t vectors = K / 16;
  int wpr = 1;
  while (wpr < kWarps && N * wpr < static_cast<int64_t>(sm_count()) * 16) wpr *= 2;
  while (wpr < kWarps && (vectors + wpr - 1) / wpr > kUnroll * 32 && N * wpr * 2 <= resident_warps) wpr *= 2;
  return wpr;
}

template <typename T, typename S, XSource kSrc, int MT>
void launch_gemv_mt(const Fp8GemvParams& p, cudaStream_t stream) {
  const char* op = "cuda::fp8_linear (gemv)";
  const size_t smem = sizeof(S) * static_cast<size_t>(MT) * static_cast<size_t>(p.K);
  auto* kernel = fp8_gemv_kernel<T, S, kSrc, MT>;
  if (smem > 48 * 1024) set_max_dynamic_smem(kernel, smem, op);
  int per_sm = 0;
  CHIMERA_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem), op);
  Fp8GemvParams q = p;
  const int resident = std::max(1, per_sm) * sm_count();
  if (q.warps_per_row == 0) q.warps_per_row = auto_warps_per_row(q.N, q.K, static_cast<int64_t>(resident) * kWarps);
  const int rows_per_group = kWarps / q.warps_per_row;
  const int n_groups = (p.N + rows_per_group - 1) / rows_per_group;
  const int rounds = (n_groups + resident - 1) / resident;
  const int blocks = (n_groups + rounds - 1) / rounds;
  CHIMERA_CUDA_CHECK(launch(kernel, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), smem, stream, q), op);
}

// One token stages x in fp32 whatever its source: no conversion per weight vector in the loop (shared-memory reads
// of 64 bytes per 16 weights are within the budget at one token, not at more).
template <typename T, typename S, XSource kSrc>
void launch_gemv_src(const Fp8GemvParams& p, cudaStream_t stream) {
  switch (gemv_mt(p.T)) {
    case 1: return launch_gemv_mt<T, float, kSrc, 1>(p, stream);
    case 2: return launch_gemv_mt<T, S, kSrc, 2>(p, stream);
    case 4: return launch_gemv_mt<T, S, kSrc, 4>(p, stream);
    default: return launch_gemv_mt<T, S, kSrc, 8>(p, stream);
  }
}

void launch_fp8_gemv(const Fp8GemvParams& p, DType act, XSource src, cudaStream_t stream) {
  CHIMERA_DISPATCH_FLOAT(act, "cuda::fp8_linear (gemv) activations", T, {
    switch (src) {
      case XSource::kRaw: launch_gemv_src<T, T, XSource::kRaw>(p, stream); break;
      case XSource::kQuant: launch_gemv_src<T, __half, XSource::kQuant>(p, stream); break;
      case XSource::kDynamic: launch_gemv_src<T, __half, XSource::kDynamic>(p, stream); break;
      case XSource::kPrequant: launch_gemv_src<T, __half, XSource::kPrequant>(p, stream); break;
    }
  });
}

size_t staged_bytes(XSource src, DType act, int64_t T) {
  if (T <= 1) return sizeof(float);
  return src == XSource::kRaw ? dtype_size(act) : sizeof(__half);
}

// ---- the tensor-core GEMV (W8A8 only) -------------------------------------------------------------------------------
//
// For an e4m3 x (ActQuant::kStatic, quantized while staged, or prequantized) the product of e4m3 weights and e4m3
// activations is what the FP8 tensor cores compute: mma.sync m16n8k32 (e4m3 x e4m3, fp32 accumulators; sm_89+),
// 16 weight rows x 8 token columns (tokens past T are zero rows of the staged x) x 32 k per instruction. No weight or
// activation conversion at all, which is what keeps T = 3..8 at the weight stream's rate (the CUDA-core kernel above
// spends 16 conversions and 16 FMAs per token per 16 weights: compute bound from T ~ 4).
//
// A warp owns a tile of 16 rows and a range of the K dimension in steps of 64 (warps_per_row warps split K, as
// above); per step, lane (g = lane / 4, c = lane % 4) loads the 16 bytes at k = step * 64 + 16 c of rows g and g + 8
// (16-byte loads; a warp's load covers 8 rows x 64 contiguous bytes) and the same 16 bytes of token g's staged x.
// Those bytes feed two mmas through a fixed permutation of k (the dot product does not care about the order, and A
// and B use the same one): mma 0 takes words x (k slots 4c..4c+3) and y (slots 16 + 4c..), mma 1 words z and w, of
// both the weight rows (A: a0 = row g, a1 = row g + 8, a2 / a3 the same rows' second word) and x (B: b0, b1).
// K % 16 == 0 makes each lane's 16-byte chunk either wholly inside the row or wholly past it (zeros).
// Accumulation: each step's two mmas start from zero and the step's result is added to fp32 registers, so the
// tensor cores' internal accumulator spans 64 products only (Hopper keeps fewer than fp32's bits there). Then as the
// kernel above: the row's warps summed in order, * out_scale (+ bias), one rounding.
// Staged x: [8][stride] bytes, stride = K rounded up to 128, + 64, so the 8 token rows of one B load fall in distinct
// banks.
constexpr int kMmaUnroll = 4;  // steps (2 x 16-byte weight loads each) in flight per lane

__device__ __forceinline__ void mma_e4m3_16832(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                               uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__host__ __device__ inline int64_t mma_x_stride(int64_t K) {
  return (K + 127) / 128 * 128 + 64;
}

template <typename T, XSource kSrc>
__global__ void __launch_bounds__(kThreads) fp8_gemv_mma_kernel(const Fp8GemvParams p) {
  static_assert(kSrc != XSource::kRaw, "the tensor-core GEMV needs an e4m3 x");
  extern __shared__ uint4 fp8_gemv_smem[];
  auto* xs = reinterpret_cast<uint8_t*>(fp8_gemv_smem);
  __shared__ float partial[kWarps][4][32];

  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int g = lane / 4, c = lane % 4;
  const int wpr = p.warps_per_row, tiles_per_group = kWarps / wpr;
  const int part = warp % wpr;
  const int kv = p.K / 16;              // 16-byte chunks per row
  const int n_steps = (p.K + 63) / 64;  // 64-k steps per row
  const int per_part = (n_steps + wpr - 1) / wpr;
  const int s0 = part * per_part, s1 = min(n_steps, s0 + per_part);
  const int n_tiles = (p.N + 15) / 16;
  const int n_groups = (n_tiles + tiles_per_group - 1) / tiles_per_group;
  const int stride = static_cast<int>(mma_x_stride(p.K));

  // Weight chunks of one step for rows g (wa) and g + 8 (wb) of the tile; zeros past the row or the matrix.
  uint4 wa[kMmaUnroll], wb[kMmaUnroll];
  const auto load_steps = [&](int tile, int s) {
    const int ra = tile * 16 + g, rb = ra + 8;
    const uint4* pa = p.w + static_cast<int64_t>(min(ra, p.N - 1)) * kv;
    const uint4* pb = p.w + static_cast<int64_t>(min(rb, p.N - 1)) * kv;
#pragma unroll
    for (int u = 0; u < kMmaUnroll; ++u) {
      const int chunk = (s + u) * 4 + c;
      const bool in = s + u < s1 && chunk < kv;
      wa[u] = in && ra < p.N ? ld_stream(pa + chunk) : make_uint4(0, 0, 0, 0);
      wb[u] = in && rb < p.N ? ld_stream(pb + chunk) : make_uint4(0, 0, 0, 0);
    }
  };
  int tile = static_cast<int>(blockIdx.x) * tiles_per_group + warp / wpr;
  if (tile < n_tiles) load_steps(tile, s0);  // before the grid dependency: constant data
  pdl_wait();
  pdl_trigger();
  float x_scale = p.x_scale, out_scale = p.out_scale;
  if constexpr (kSrc == XSource::kDynamic) {
    x_scale = fp8::block_dynamic_scale<T, kThreads>(static_cast<const T*>(p.x), static_cast<int64_t>(p.T) * p.K);
    out_scale *= x_scale;
  }

  // x -> shared memory as e4m3 codes, 8 token rows (zeros past T), 16 bytes per thread and step.
  for (int i = static_cast<int>(threadIdx.x); i < 8 * kv; i += kThreads) {
    const int t = i / kv, v = i % kv;
    uint4 q = make_uint4(0, 0, 0, 0);
    if (t < p.T) {
      if constexpr (kSrc == XSource::kQuant || kSrc == XSource::kDynamic) {
        float f[16];
        load_f32<T, 16, false>(static_cast<const T*>(p.x) + static_cast<size_t>(t) * p.K + static_cast<size_t>(v) * 16,
                               f);
        uint32_t w[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          w[k] = fp8::quantize2(f[4 * k], f[4 * k + 1], x_scale) |
                 (static_cast<uint32_t>(fp8::quantize2(f[4 * k + 2], f[4 * k + 3], x_scale)) << 16);
        }
        q = make_uint4(w[0], w[1], w[2], w[3]);
      } else {
        q = static_cast<const uint4*>(p.x)[static_cast<size_t>(t) * kv + v];
      }
    }
    *reinterpret_cast<uint4*>(xs + static_cast<size_t>(t) * stride + static_cast<size_t>(v) * 16) = q;
  }
  __syncthreads();

  bool preloaded = true;
  for (int grp = static_cast<int>(blockIdx.x); grp < n_groups; grp += static_cast<int>(gridDim.x)) {
    tile = grp * tiles_per_group + warp / wpr;
    const bool active = tile < n_tiles;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (active) {
      for (int s = s0; s < s1; s += kMmaUnroll) {
        if (!preloaded) load_steps(tile, s);
        preloaded = false;
#pragma unroll
        for (int u = 0; u < kMmaUnroll; ++u) {
          const int chunk = (s + u) * 4 + c;
          if (s + u < s1) {  // uniform across the warp (mma.sync needs every lane)
            const uint4 b = chunk < kv ? *reinterpret_cast<const uint4*>(xs + static_cast<size_t>(g) * stride +
                                                                         static_cast<size_t>(chunk) * 16)
                                       : make_uint4(0, 0, 0, 0);
            float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            mma_e4m3_16832(d, wa[u].x, wb[u].x, wa[u].y, wb[u].y, b.x, b.y);
            mma_e4m3_16832(d, wa[u].z, wb[u].z, wa[u].w, wb[u].w, b.z, b.w);
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[j] += d[j];
          }
        }
      }
    }
    preloaded = false;
    if (wpr > 1) {
#pragma unroll
      for (int j = 0; j < 4; ++j) partial[warp][j][lane] = acc[j];
      __syncthreads();
      if (part == 0) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          float s = 0.0f;
          for (int q = 0; q < wpr; ++q) s += partial[warp + q][j][lane];
          acc[j] = s;
        }
      }
      __syncthreads();  // partial is reused by the next group
    }
    if (part == 0 && active) {
      // acc[0], acc[1]: row g, tokens 2c, 2c + 1; acc[2], acc[3]: row g + 8, the same tokens.
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int row = tile * 16 + g + (j >= 2 ? 8 : 0), token = 2 * c + (j & 1);
        if (row < p.N && token < p.T) {
          float s = acc[j] * out_scale;
          if (p.bias != nullptr) s += to_float(static_cast<const T*>(p.bias)[row]);
          static_cast<T*>(p.y)[static_cast<int64_t>(token) * p.N + row] = from_float<T>(s);
        }
      }
    }
  }
}

template <typename T, XSource kSrc>
void launch_gemv_mma_src(const Fp8GemvParams& p, cudaStream_t stream) {
  const char* op = "cuda::fp8_linear (tensor-core gemv)";
  const size_t smem = static_cast<size_t>(8 * mma_x_stride(p.K));
  auto* kernel = fp8_gemv_mma_kernel<T, kSrc>;
  if (smem > 48 * 1024) set_max_dynamic_smem(kernel, smem, op);
  int per_sm = 0;
  CHIMERA_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem), op);
  Fp8GemvParams q = p;
  const int resident = std::max(1, per_sm) * sm_count();
  const int64_t n_tiles = (p.N + 15) / 16;
  if (q.warps_per_row == 0) {
    // The rule of auto_warps_per_row with tiles for rows and a warp's step of kMmaUnroll 64-k steps.
    const int64_t steps = (p.K + 63) / 64;
    int wpr = 1;
    while (wpr < kWarps && n_tiles * wpr < static_cast<int64_t>(sm_count()) * 16) wpr *= 2;
    while (wpr < kWarps && (steps + wpr - 1) / wpr > kMmaUnroll && n_tiles * wpr * 2 <= int64_t{resident} * kWarps) {
      wpr *= 2;
    }
    q.warps_per_row = wpr;
  }
  const int tiles_per_group = kWarps / q.warps_per_row;
  const int n_groups = static_cast<int>((n_tiles + tiles_per_group - 1) / tiles_per_group);
  const int rounds = (n_groups + resident - 1) / resident;
  const int blocks = (n_groups + rounds - 1) / rounds;
  CHIMERA_CUDA_CHECK(launch(kernel, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), smem, stream, q), op);
}

void launch_fp8_gemv_mma(const Fp8GemvParams& p, DType act, XSource src, cudaStream_t stream) {
  CHIMERA_DISPATCH_FLOAT(act, "cuda::fp8_linear (tensor-core gemv) activations", T, {
    if (src == XSource::kQuant) {
      launch_gemv_mma_src<T, XSource::kQuant>(p, stream);
    } else if (src == XSource::kDynamic) {
      launch_gemv_mma_src<T, XSource::kDynamic>(p, stream);
    } else {
      launch_gemv_mma_src<T, XSource::kPrequant>(p, stream);
    }
  });
}

// ---- elementwise: quantize, decode, fake-quantize to f32 ----------------------------------------------------------

constexpr int kEwThreads = 256;

int ew_blocks(int64_t work) {
  return static_cast<int>(std::clamp<int64_t>((work + kEwThreads - 1) / kEwThreads, 1, int64_t{8} * sm_count()));
}

// q[i] = e4m3(x[i] / scale). kVec: 8 elements per access over the first n / 8 groups (x 16-byte, q 8-byte
// aligned), then the tail one element at a time.
template <typename T, bool kVec>
__global__ void __launch_bounds__(kEwThreads) quantize_kernel(const T* x, uint8_t* q, int64_t n, float scale) {
  pdl_wait();
  pdl_trigger();
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t done = 0;
  if constexpr (kVec) {
    const int64_t groups = n / 8;
    for (int64_t g = tid; g < groups; g += stride) {
      float v[8];
      load_f32<T, 8, false>(x + g * 8, v);
      fp8::store_quantized<8>(q + g * 8, v, scale);
    }
    done = groups * 8;
  }
  for (int64_t i = done + tid; i < n; i += stride) {
    const float v[1] = {to_float(x[i])};
    fp8::store_quantized<1>(q + i, v, scale);
  }
}

// out[i] = value(q[i]) * scale (F32); with scale_ptr (a device scalar: a dynamic scale), * *scale_ptr instead.
__global__ void __launch_bounds__(kEwThreads) decode_kernel(const uint8_t* q, float* out, int64_t n, float scale,
                                                            const float* scale_ptr) {
  pdl_wait();
  pdl_trigger();
  if (scale_ptr != nullptr) scale = *scale_ptr;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    out[i] = fp8::decode2(q[i]).x * scale;
  }
}

// out[i] = x'[i] in F32: value(e4m3(x / scale)) * scale (kQuant) or x (not kQuant).
template <typename T, bool kQuant>
__global__ void __launch_bounds__(kEwThreads) act_f32_kernel(const T* x, float* out, int64_t n, float scale) {
  pdl_wait();
  pdl_trigger();
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float v = to_float(x[i]);
    out[i] = kQuant ? fp8::decode2(fp8::quantize2(v, 0.0f, scale)).x * scale : v;
  }
}

void launch_quantize(const void* x, DType act, uint8_t* q, int64_t n, float scale, cudaStream_t stream) {
  const char* op = "cuda::quantize_fp8";
  if (n == 0) return;
  const bool vec = vec_aligned({x}) && reinterpret_cast<uintptr_t>(q) % 8 == 0;
  CHIMERA_DISPATCH_FLOAT(act, str_cat(op, " x"), T, {
    const int blocks = ew_blocks(vec ? n / 8 + 1 : n);
    if (vec) {
      CHIMERA_CUDA_CHECK(launch(quantize_kernel<T, true>, dim3(blocks), dim3(kEwThreads), 0, stream,
                                static_cast<const T*>(x), q, n, scale),
                         op);
    } else {
      CHIMERA_CUDA_CHECK(launch(quantize_kernel<T, false>, dim3(blocks), dim3(kEwThreads), 0, stream,
                                static_cast<const T*>(x), q, n, scale),
                         op);
    }
  });
}

// ---- dynamic per-tensor quantization (ActQuant::kDynamic at prefill sizes) ----------------------------------------
//
// Kernel 1: block b writes partial[b] = max |x| over its grid-stride share of x. Kernel 2: every block reduces the
// kDynamicBlocks maxima to s = max / 448 (1 for zeros; block_dynamic_scale's rule), block 0 stores s at *scale_out,
// and all quantize their share of x / s into q. No atomics: max is exact, so s and the codes are the same bits on
// every run and every grid.
constexpr int kDynamicBlocks = 512;

template <typename T>
__global__ void __launch_bounds__(kEwThreads) amax_partial_kernel(const T* x, int64_t n, float* partial) {
  pdl_wait();
  pdl_trigger();
  float m = 0.0f;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    m = fmaxf(m, fabsf(to_float(x[i])));
  }
  m = fp8::block_max<kEwThreads>(m);
  if (threadIdx.x == 0) partial[blockIdx.x] = m;
}

template <typename T>
__global__ void __launch_bounds__(kEwThreads) quantize_dynamic_kernel(const T* x, uint8_t* q, int64_t n,
                                                                      const float* partial, float* scale_out,
                                                                      int n_scale_out) {
  pdl_wait();
  pdl_trigger();
  float m = 0.0f;
  for (int i = static_cast<int>(threadIdx.x); i < kDynamicBlocks; i += kEwThreads) m = fmaxf(m, partial[i]);
  const float scale = fp8::scale_for_amax(fp8::block_max<kEwThreads>(m));
  if (blockIdx.x == 0) {
    for (int i = static_cast<int>(threadIdx.x); i < n_scale_out; i += kEwThreads) scale_out[i] = scale;
  }
  if (q == nullptr) return;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float v[1] = {to_float(x[i])};
    fp8::store_quantized<1>(q + i, v, scale);
  }
}

// q = e4m3(x / s) with s the dynamic per-tensor scale of x [n], stored in scale_out[0 .. n_scale_out) (device F32);
// q == nullptr: the scale only.
void launch_quantize_dynamic(const void* x, DType act, uint8_t* q, int64_t n, float* scale_out, cudaStream_t stream,
                             int n_scale_out = 1) {
  const char* op = "cuda::fp8_linear (dynamic quantization)";
  const Tensor partial = device::empty(Device::kCuda, DType::kF32, {kDynamicBlocks});
  CHIMERA_DISPATCH_FLOAT(act, str_cat(op, " x"), T, {
    CHIMERA_CUDA_CHECK(launch(amax_partial_kernel<T>, dim3(kDynamicBlocks), dim3(kEwThreads), 0, stream,
                              static_cast<const T*>(x), n, partial.data_as<float>()),
                       op);
    CHIMERA_CUDA_CHECK(launch(quantize_dynamic_kernel<T>, dim3(q != nullptr ? ew_blocks(n) : 1), dim3(kEwThreads), 0,
                              stream, static_cast<const T*>(x), q, n,
                              static_cast<const float*>(partial.data_as<float>()), scale_out, n_scale_out),
                       op);
  });
}

// ---- cuBLASLt FP8 GEMM --------------------------------------------------------------------------------------------

#define CHIMERA_FP8_CUBLAS_CHECK(expr, op)                                                                            \
  do {                                                                                                                \
    const cublasStatus_t chimera_st_ = (expr);                                                                        \
    if (chimera_st_ != CUBLAS_STATUS_SUCCESS) {                                                                       \
      ::chimera::throw_runtime(::chimera::str_cat((op), ": ", #expr, " failed: ", cublasLtGetStatusName(chimera_st_), \
                                                  " (", cublasLtGetStatusString(chimera_st_), ")"));                  \
    }                                                                                                                 \
  } while (0)

constexpr size_t kWorkspaceBytes = size_t{32} << 20;
constexpr const char* kGemmOp = "cuda::fp8_linear (cuBLASLt FP8)";

uint32_t alignment(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  if (a == 0) return 256;
  uint32_t al = 1;
  while (al < 256 && a % (al * 2) == 0) al *= 2;
  return al;
}

struct PlanKey {
  int64_t tokens, in, out;
  DType dtype;
  bool bias, fast_accum, x_scale_ptr;  // x_scale_ptr: x's scale is a device scalar (B_SCALE_POINTER)
  uint32_t align_w, align_x, align_y, align_b;
  bool operator==(const PlanKey&) const = default;
};

struct PlanKeyHash {
  size_t operator()(const PlanKey& k) const {
    size_t h = 1469598103934665603ull;
    auto mix = [&h](uint64_t v) { h = (h ^ v) * 1099511628211ull; };
    mix(static_cast<uint64_t>(k.tokens));
    mix(static_cast<uint64_t>(k.in));
    mix(static_cast<uint64_t>(k.out));
    mix(static_cast<uint64_t>(k.dtype) | (uint64_t{k.bias} << 8) | (uint64_t{k.fast_accum} << 9) |
        (uint64_t{k.x_scale_ptr} << 10));
    mix((uint64_t{k.align_w} << 32) | k.align_x);
    mix((uint64_t{k.align_y} << 32) | k.align_b);
    return h;
  }
};

struct Plan {
  bool ok = false;  // false: cuBLASLt has no algorithm for the key (cached, so the query runs once)
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t w = nullptr, x = nullptr, y = nullptr;
  cublasLtMatmulAlgo_t algo{};
};

// Per-thread state (handles and descriptors are not shared across threads); never destroyed (thread-exit
// destructors may run after the CUDA context is gone).
struct LtState {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  std::unordered_map<PlanKey, Plan, PlanKeyHash> plans;
};

LtState& lt_state() {
  thread_local LtState* s = [] {
    auto* st = new LtState();
    CHIMERA_FP8_CUBLAS_CHECK(cublasLtCreate(&st->handle), kGemmOp);
    CHIMERA_CUDA_CHECK(cudaMalloc(&st->workspace, kWorkspaceBytes), "cuda::fp8_linear workspace");
    return st;
  }();
  return *s;
}

cudaDataType_t out_type(DType d) {
  return d == DType::kBF16 ? CUDA_R_16BF : CUDA_R_16F;
}

const Plan& get_plan(LtState& st, const PlanKey& k, const void* bias, const float* x_scale) {
  auto it = st.plans.find(k);
  if (it != st.plans.end()) return it->second;
  const char* op = kGemmOp;
  Plan p;
  CHIMERA_FP8_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), op);
  const cublasOperation_t trans_w = CUBLAS_OP_T, trans_x = CUBLAS_OP_N;
  CHIMERA_FP8_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &trans_w, sizeof(trans_w)), op);
  CHIMERA_FP8_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &trans_x, sizeof(trans_x)), op);
  const int8_t fast = k.fast_accum ? 1 : 0;
  CHIMERA_FP8_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)),
                           op);
  if (k.bias) {
    const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
    CHIMERA_FP8_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)),
                             op);
    const cudaDataType_t bt = out_type(k.dtype);
    CHIMERA_FP8_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof(bt)), op);
    CHIMERA_FP8_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)), op);
  }
  if (k.x_scale_ptr) {
    CHIMERA_FP8_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &x_scale, sizeof(x_scale)), op);
  }
  const auto u = [](int64_t v) { return static_cast<uint64_t>(v); };
  CHIMERA_FP8_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.w, CUDA_R_8F_E4M3, u(k.in), u(k.out), k.in), op);
  CHIMERA_FP8_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.x, CUDA_R_8F_E4M3, u(k.in), u(k.tokens), k.in), op);
  CHIMERA_FP8_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.y, out_type(k.dtype), u(k.out), u(k.tokens), k.out), op);

  cublasLtMatmulPreference_t pref = nullptr;
  CHIMERA_FP8_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref), op);
  const size_t ws = kWorkspaceBytes;
  CHIMERA_FP8_CUBLAS_CHECK(
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)), op);
  const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> aligns[] = {
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, k.align_w},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, k.align_x},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, k.align_y},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, k.align_y}};
  for (const auto& [attr, value] : aligns) {
    CHIMERA_FP8_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof(value)), op);
  }
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t st_h =
      cublasLtMatmulAlgoGetHeuristic(st.handle, p.desc, p.w, p.x, p.y, p.y, pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  p.ok = st_h == CUBLAS_STATUS_SUCCESS && found > 0;
  if (p.ok) p.algo = result.algo;
  return st.plans.emplace(k, p).first->second;
}

// The shape rules of cuBLASLt's FP8 GEMM as this file uses it: 16-bit output, K a multiple of 16 (the FP8
// operands' leading dimension in bytes), N a multiple of 16 (D's leading dimension in 16-byte units, and the
// weight's other dimension: torch._scaled_mm asks the same of both FP8 operands), 16-byte aligned operands and bias.
// Every projection of Nano and Super has N % 16 == 0.
bool gemm_shape_ok(const Tensor& out, const Tensor& xq_or_x, const ops::LinearWeight& w, const Tensor& bias) {
  const int64_t K = w.in_features(), N = w.out_features();
  return (out.dtype() == DType::kBF16 || out.dtype() == DType::kF16) && K % 16 == 0 && N % 16 == 0 &&
         vec_aligned({out.data(), xq_or_x.data(), w.weight.data(), bias ? bias.data() : nullptr});
}

// y = alpha * (x_scale ? *x_scale : 1) * xq @ W^T (+ bias) through cuBLASLt (x_scale: a device scalar); false when
// cuBLASLt has no algorithm for the shape.
bool run_gemm(const ops::Context& ctx, const Tensor& out, const Tensor& xq, const ops::LinearWeight& w,
              const Tensor& bias, float alpha, bool fast_accum, const float* x_scale = nullptr) {
  LtState& st = lt_state();
  const PlanKey key{xq.dim(0),
                    w.in_features(),
                    w.out_features(),
                    out.dtype(),
                    static_cast<bool>(bias),
                    fast_accum,
                    x_scale != nullptr,
                    alignment(w.weight.data()),
                    alignment(xq.data()),
                    alignment(out.data()),
                    bias ? alignment(bias.data()) : 256u};
  const Plan& plan = get_plan(st, key, bias ? bias.data() : nullptr, x_scale);
  if (!plan.ok) return false;
  if (x_scale != nullptr) {
    CHIMERA_FP8_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &x_scale, sizeof(x_scale)),
        kGemmOp);
  }
  if (bias) {
    const void* b = bias.data();
    CHIMERA_FP8_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &b, sizeof(b)), kGemmOp);
  }
  const float beta = 0.0f;
  CHIMERA_FP8_CUBLAS_CHECK(
      cublasLtMatmul(st.handle, plan.desc, &alpha, w.weight.data(), plan.w, xq.data(), plan.x, &beta, out.data(),
                     plan.y, out.data(), plan.y, &plan.algo, st.workspace, kWorkspaceBytes, as_stream(ctx.stream)),
      kGemmOp);
  return true;
}

// ---- the paths ----------------------------------------------------------------------------------------------------

// kDynamic: the kernels multiply in their own s.
float out_scale(const ops::LinearWeight& w) {
  return w.act == ops::ActQuant::kStatic ? w.input_scale * w.scale : w.scale;
}

XSource x_source(const ops::LinearWeight& w, bool prequant) {
  if (prequant) return XSource::kPrequant;
  switch (w.act) {
    case ops::ActQuant::kStatic: return XSource::kQuant;
    case ops::ActQuant::kDynamic: return XSource::kDynamic;
    case ops::ActQuant::kNone: break;
  }
  return XSource::kRaw;
}

bool gemv_ok(const Tensor& out, const Tensor& x, const ops::LinearWeight& w, XSource src) {
  const int64_t T = x.dim(0), K = w.in_features(), N = w.out_features();
  if (T < 1 || T > kFp8GemvMaxTokens || K < 16 || K % 16 != 0 || N < 1) return false;
  if (!vec_aligned({x.data(), w.weight.data()})) return false;
  const int64_t smem = static_cast<int64_t>(staged_bytes(src, out.dtype(), T)) * gemv_mt(T) * K;
  return smem <= kGemvMaxSmemBytes && N < (int64_t{1} << 31) / K;
}

bool gemv_mma_ok(const Tensor& x, const ops::LinearWeight& w) {
  const int64_t T = x.dim(0), K = w.in_features(), N = w.out_features();
  if (T < 1 || T > kFp8GemvMaxTokens || K < 16 || K % 16 != 0 || N < 1) return false;
  if (!vec_aligned({x.data(), w.weight.data()})) return false;
  return 8 * mma_x_stride(K) <= kGemvMaxSmemBytes && N < (int64_t{1} << 31) / K;
}

void run_gemv(const ops::Context& ctx, const Tensor& out, const Tensor& x, const ops::LinearWeight& w,
              const Tensor& bias, XSource src, bool mma) {
  Fp8GemvParams p;
  p.x = x.data();
  p.w = static_cast<const uint4*>(w.weight.data());
  p.bias = bias ? bias.data() : nullptr;
  p.y = out.data();
  p.T = static_cast<int>(x.dim(0));
  p.K = static_cast<int>(w.in_features());
  p.N = static_cast<int>(w.out_features());
  p.x_scale = w.input_scale;
  p.out_scale = out_scale(w);
  if (mma) {
    launch_fp8_gemv_mma(p, out.dtype(), src, as_stream(ctx.stream));
  } else {
    launch_fp8_gemv(p, out.dtype(), src, as_stream(ctx.stream));
  }
}

// The dequantized fallback: W and x' in F32, the fp32 cuBLASLt GEMM, then the output dtype. xq: x is F8_E4M3 codes.
// x_scale: with xq, the codes' dynamic scale (a device scalar) in place of w.input_scale.
void run_dequant(const ops::Context& ctx, const Tensor& out, const Tensor& x, const ops::LinearWeight& w,
                 const Tensor& bias, bool xq, const float* x_scale = nullptr) {
  const cudaStream_t stream = as_stream(ctx.stream);
  const int64_t T = x.dim(0), K = w.in_features(), N = w.out_features();
  const char* op = "cuda::fp8_linear (dequantized)";
  const Tensor w32 = device::empty(Device::kCuda, DType::kF32, {N, K});
  CHIMERA_CUDA_CHECK(launch(decode_kernel, dim3(ew_blocks(N * K)), dim3(kEwThreads), 0, stream,
                            static_cast<const uint8_t*>(w.weight.data()), w32.f32(), N * K, w.scale,
                            static_cast<const float*>(nullptr)),
                     op);
  const Tensor x32 = device::empty(Device::kCuda, DType::kF32, {T, K});
  if (xq || w.act == ops::ActQuant::kDynamic) {
    // Codes given (xq: with the static input_scale, or with the dynamic scale at *x_scale) or made here (kDynamic).
    Tensor codes = x, scale;
    if (!xq) {
      codes = device::empty(Device::kCuda, DType::kF8E4M3, {T, K});
      scale = device::empty(Device::kCuda, DType::kF32, {1});
      launch_quantize_dynamic(x.data(), x.dtype(), static_cast<uint8_t*>(codes.data()), T * K, scale.data_as<float>(),
                              stream);
      x_scale = scale.data_as<float>();
    }
    CHIMERA_CUDA_CHECK(launch(decode_kernel, dim3(ew_blocks(T * K)), dim3(kEwThreads), 0, stream,
                              static_cast<const uint8_t*>(codes.data()), x32.f32(), T * K, w.input_scale, x_scale),
                       op);
  } else {
    const bool quant = w.act == ops::ActQuant::kStatic;
    CHIMERA_DISPATCH_FLOAT(x.dtype(), str_cat(op, " x"), T_, {
      auto* kernel = quant ? act_f32_kernel<T_, true> : act_f32_kernel<T_, false>;
      CHIMERA_CUDA_CHECK(launch(kernel, dim3(ew_blocks(T * K)), dim3(kEwThreads), 0, stream,
                                static_cast<const T_*>(x.data()), x32.f32(), T * K, w.input_scale),
                         op);
    });
  }
  Tensor b32;
  if (bias) {
    b32 = device::empty(Device::kCuda, DType::kF32, {N});
    cuda::convert(ctx, b32.reshape({1, N}), bias.reshape({1, N}));
  }
  if (out.dtype() == DType::kF32) {
    cuda::linear(ctx, out, x32, w32, b32);
    return;
  }
  const Tensor y32 = device::empty(Device::kCuda, DType::kF32, {T, N});
  cuda::linear(ctx, y32, x32, w32, b32);
  cuda::convert(ctx, out, y32);
}

// Caller errors: the weight's format, the tensors' dtypes, devices and shapes.
void check_args(const char* op, const Tensor& out, const Tensor& x, const ops::LinearWeight& w, const Tensor& bias,
                bool prequant) {
  if (w.format != ops::WeightFormat::kFp8 || !w.weight || w.weight.dtype() != DType::kF8E4M3 || w.weight.ndim() != 2 ||
      w.weight.device() != Device::kCuda) {
    throw_runtime(str_cat(op, ": ", w.name, ": weight ", w.weight ? w.weight.describe() : std::string("(undefined)"),
                          " (", ops::weight_format_name(w.format), ") must be an FP8 F8_E4M3 [N, K] CUDA tensor"));
  }
  const int64_t K = w.in_features(), N = w.out_features();
  const auto bad = [&](const char* what, const Tensor& t, const std::string& want) {
    throw_runtime(str_cat(op, ": ", w.name, ": ", what, " ", t ? t.describe() : std::string("(undefined)"), " must be ",
                          want, " (weight ", w.weight.describe(), ")"));
  };
  const bool float_act =
      out && (out.dtype() == DType::kBF16 || out.dtype() == DType::kF16 || out.dtype() == DType::kF32);
  if (!float_act || out.ndim() != 2 || out.dim(1) != N || out.device() != Device::kCuda) {
    bad("out", out, "a BF16 / F16 / F32 CUDA [T, N]");
  }
  const int64_t T = out.dim(0);
  if (prequant) {
    if (!x || x.dtype() != DType::kF8E4M3 || x.shape() != Shape{T, K} || x.device() != Device::kCuda) {
      bad("xq", x, str_cat("F8_E4M3 [", T, ", ", K, "] on CUDA"));
    }
    if (w.act != ops::ActQuant::kStatic) {
      throw_runtime(str_cat(op, ": ", w.name, ": a prequantized x needs ActQuant::kStatic (the layer's input_scale)"));
    }
  } else if (!x || x.dtype() != out.dtype() || x.shape() != Shape{T, K} || x.device() != Device::kCuda) {
    bad("x", x, str_cat(dtype_name(out.dtype()), " [", T, ", ", K, "] on CUDA (out's dtype)"));
  }
  if (bias && (bias.dtype() != out.dtype() || bias.shape() != Shape{N} || bias.device() != Device::kCuda)) {
    bad("bias", bias, str_cat(dtype_name(out.dtype()), " [", N, "] on CUDA"));
  }
  if (!(w.scale > 0.0f) || (w.act == ops::ActQuant::kStatic && !(w.input_scale > 0.0f))) {
    throw_runtime(str_cat(op, ": ", w.name, ": scale ", w.scale, " / input_scale ", w.input_scale,
                          " must be positive (input_scale with ActQuant::kStatic)"));
  }
}

Fp8LinearPath choose(const Tensor& out, const Tensor& x, const ops::LinearWeight& w, const Tensor& bias,
                     bool prequant) {
  const XSource src = x_source(w, prequant);
  if (src != XSource::kRaw && x.dim(0) >= kFp8GemvMmaMinTokens && gemv_mma_ok(x, w)) return Fp8LinearPath::kGemvMma;
  if (gemv_ok(out, x, w, src)) return Fp8LinearPath::kGemv;
  if (src != XSource::kRaw && gemm_shape_ok(out, x, w, bias)) return Fp8LinearPath::kGemm;
  return Fp8LinearPath::kDequant;
}

void run(const ops::Context& ctx, const Tensor& out, const Tensor& x, const ops::LinearWeight& w, const Tensor& bias,
         Fp8LinearPath path, bool fast_accum, bool prequant) {
  const char* op = prequant ? "cuda::fp8_linear_prequant" : "cuda::fp8_linear";
  check_args(op, out, x, w, bias, prequant);
  const device::LaunchScope launch_scope(ctx.kernels.pdl);
  if (out.dim(0) == 0 || w.out_features() == 0) return;
  if (w.in_features() == 0) throw_runtime(str_cat(op, ": ", w.name, ": in_features 0 is not supported on CUDA"));
  const bool auto_path = path == Fp8LinearPath::kAuto;
  if (auto_path) path = choose(out, x, w, bias, prequant);
  const XSource src = x_source(w, prequant);
  switch (path) {
    case Fp8LinearPath::kGemv:
      if (!gemv_ok(out, x, w, src)) {
        throw_runtime(str_cat(op, ": ", w.name, ": the FP8 GEMV does not take x ", x.describe(), " @ weight ",
                              w.weight.describe(), " (1 <= T <= ", kFp8GemvMaxTokens,
                              ", K % 16 == 0, 16-byte aligned x and weight, x staged in <= ", kGemvMaxSmemBytes,
                              " bytes)"));
      }
      run_gemv(ctx, out, x, w, bias, src, false);
      return;
    case Fp8LinearPath::kGemvMma:
      if (src == XSource::kRaw || !gemv_mma_ok(x, w)) {
        throw_runtime(
            str_cat(op, ": ", w.name, ": the tensor-core FP8 GEMV does not take x ", x.describe(), " @ weight ",
                    w.weight.describe(), " (ActQuant::kStatic / kDynamic or a prequantized x, 1 <= T <= ", kFp8GemvMaxTokens,
                    ", K % 16 == 0, 16-byte aligned x and weight, x staged in <= ", kGemvMaxSmemBytes, " bytes)"));
      }
      run_gemv(ctx, out, x, w, bias, src, true);
      return;
    case Fp8LinearPath::kGemm: {
      if (src == XSource::kRaw || !gemm_shape_ok(out, x, w, bias)) {
        throw_runtime(str_cat(op, ": ", w.name, ": the FP8 GEMM does not take x ", x.describe(), " @ weight ",
                              w.weight.describe(), " -> ", out.describe(),
                              " (ActQuant::kStatic / kDynamic, BF16 / F16 out, K % 16 == 0, N % 16 == 0, 16-byte "
                              "aligned)"));
      }
      Tensor xq = x, x_scale;
      if (src == XSource::kQuant) {
        xq = device::empty(Device::kCuda, DType::kF8E4M3, x.shape());
        launch_quantize(x.data(), x.dtype(), static_cast<uint8_t*>(xq.data()), x.numel(), w.input_scale,
                        as_stream(ctx.stream));
      } else if (src == XSource::kDynamic) {
        xq = device::empty(Device::kCuda, DType::kF8E4M3, x.shape());
        x_scale = device::empty(Device::kCuda, DType::kF32, {1});
        launch_quantize_dynamic(x.data(), x.dtype(), static_cast<uint8_t*>(xq.data()), x.numel(),
                                x_scale.data_as<float>(), as_stream(ctx.stream));
      }
      const bool dynamic = src == XSource::kDynamic;
      const float* xs = dynamic ? x_scale.data_as<float>() : nullptr;
      if (run_gemm(ctx, out, xq, w, bias, dynamic ? w.scale : w.input_scale * w.scale, fast_accum, xs)) return;
      if (!auto_path) {
        throw_runtime(str_cat(op, ": ", w.name, ": cuBLASLt has no FP8 algorithm for xq [", x.dim(0), ", ",
                              w.in_features(), "] @ weight^T ", w.weight.describe(), " -> ", out.describe()));
      }
      run_dequant(ctx, out, xq, w, bias, true, xs);  // the codes are computed: reuse them
      return;
    }
    case Fp8LinearPath::kDequant:
    case Fp8LinearPath::kAuto: run_dequant(ctx, out, x, w, bias, prequant); return;
  }
}

}  // namespace

const char* fp8_linear_path_name(Fp8LinearPath p) {
  switch (p) {
    case Fp8LinearPath::kAuto: return "auto";
    case Fp8LinearPath::kGemv: return "gemv";
    case Fp8LinearPath::kGemvMma: return "gemv_mma";
    case Fp8LinearPath::kGemm: return "gemm";
    case Fp8LinearPath::kDequant: return "dequant";
  }
  return "?";
}

Fp8LinearPath fp8_linear_path(const Tensor& out, const Tensor& x, const ops::LinearWeight& w, const Tensor& bias) {
  return choose(out, x, w, bias, x.dtype() == DType::kF8E4M3);
}

void fp8_linear(const ops::Context& ctx, const Tensor& out, const Tensor& x, const ops::LinearWeight& w,
                const Tensor& bias) {
  run(ctx, out, x, w, bias, Fp8LinearPath::kAuto, false, false);
}

void fp8_linear_prequant(const ops::Context& ctx, const Tensor& out, const Tensor& xq, const ops::LinearWeight& w,
                         const Tensor& bias) {
  run(ctx, out, xq, w, bias, Fp8LinearPath::kAuto, false, true);
}

void fp8_linear_with_path(const ops::Context& ctx, const Tensor& out, const Tensor& x, const ops::LinearWeight& w,
                          const Tensor& bias, Fp8LinearPath path, bool fast_accum) {
  run(ctx, out, x, w, bias, path, fast_accum, false);
}

void fp8_linear_prequant_with_path(const ops::Context& ctx, const Tensor& out, const Tensor& xq,
                                   const ops::LinearWeight& w, const Tensor& bias, Fp8LinearPath path,
                                   bool fast_accum) {
  run(ctx, out, xq, w, bias, path, fast_accum, true);
}

void quantize_fp8_dynamic(const ops::Context& ctx, const Tensor& out_q, const Tensor& x, const Tensor& scale_out) {
  const char* op = "cuda::quantize_fp8_dynamic";
  if (!x || x.device() != Device::kCuda) {
    throw_runtime(str_cat(op, ": x ", x ? x.describe() : std::string("(undefined)"), " must be a CUDA tensor"));
  }
  if (out_q && (!(out_q.dtype() == DType::kF8E4M3 || out_q.dtype() == DType::kU8) || out_q.numel() != x.numel() ||
                out_q.device() != Device::kCuda)) {
    throw_runtime(str_cat(op, ": out_q ", out_q.describe(), " must be F8_E4M3 (or U8) codes of x's size on CUDA (x ",
                          x.describe(), ")"));
  }
  if (!scale_out || scale_out.dtype() != DType::kF32 || scale_out.numel() < 1 || scale_out.device() != Device::kCuda ||
      scale_out.numel() > (int64_t{1} << 20)) {
    throw_runtime(str_cat(op, ": scale_out ", scale_out ? scale_out.describe() : std::string("(undefined)"),
                          " must be an F32 CUDA tensor of 1 .. 2^20 elements"));
  }
  const device::LaunchScope launch_scope(ctx.kernels.pdl);
  launch_quantize_dynamic(x.data(), x.dtype(), out_q ? static_cast<uint8_t*>(out_q.data()) : nullptr, x.numel(),
                          scale_out.data_as<float>(), as_stream(ctx.stream), static_cast<int>(scale_out.numel()));
}

void quantize_fp8(const ops::Context& ctx, const Tensor& out_q, const Tensor& x, float input_scale) {
  const char* op = "cuda::quantize_fp8";
  if (!x || !out_q || out_q.dtype() != DType::kF8E4M3 || out_q.shape() != x.shape() || x.device() != Device::kCuda ||
      out_q.device() != Device::kCuda) {
    throw_runtime(str_cat(op, ": out_q ", out_q ? out_q.describe() : std::string("(undefined)"),
                          " must be an F8_E4M3 CUDA tensor of x's shape (x ",
                          x ? x.describe() : std::string("(undefined)"), ")"));
  }
  if (!(input_scale > 0.0f)) throw_runtime(str_cat(op, ": input_scale ", input_scale, " must be positive"));
  const device::LaunchScope launch_scope(ctx.kernels.pdl);
  launch_quantize(x.data(), x.dtype(), static_cast<uint8_t*>(out_q.data()), x.numel(), input_scale,
                  as_stream(ctx.stream));
}

}  // namespace chimera::cuda
