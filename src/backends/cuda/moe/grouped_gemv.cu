// Grouped expert GEMV for decode (few tokens per active expert): the same work list and output contract as the
// grouped GEMMs (moe_kernels.h), but shaped to stream each active expert's weights once at close to the full HBM
// bandwidth instead of filling MMA tiles:
//   up:   h[r, n] = relu(sum_k x[token(r), k] * W_e[n, k])^2, rounded to the activation dtype (as HF) -> h [P, I]
//   down: y[pair(r), n] = w[pair(r)] * sum_k h[r, k] * W_e[n, k] in fp32 -> y [P, D], row = pair id
//
// Why: at T = 1 (Nano: 6 experts x [1856, 2688] up + [2688, 1856] down, 120 MB) the mma kernel's 64-row tiles give
// 174-252 blocks of ~340 KB each for 132 SMs, so 1.3-1.9 "waves" of big blocks and a long tail; here a block is 16
// rows (~86 KB at K = 2688), there are 700-1000 of them, and every lane keeps 8 x 16-byte weight loads in flight.
//
// Block: 256 threads = 8 warps; warp w owns kRows = 2 (K > 1024) or 4 (K <= 1024) consecutive weight rows and all
// the item's tokens (at most NT = the permutation's tile_rows). The item's token rows (x gathered by token for up, h
// rows for down) are staged in shared memory, [NT][K] in the activation dtype. Lane l reads the 16-byte chunks
// c = l, l + 32, ... of its rows (kUnroll chunks per row per step, loads of the next step issued before the FMAs of
// this one), converts to fp32, multiplies with the same chunk of each token, accumulates in fp32 and the warp
// reduces with shuffles at the end: a fixed order, so the results are deterministic. Grid = ceil(N / 16) x
// max_items (an upper bound of the work items); blocks of items past *n_items exit at once, so no host sync and
// the launch can be captured in a CUDA graph.
#include <cstdint>

#include "backends/cuda/cuda_common.cuh"
#include "backends/cuda/moe/moe_kernels.h"

namespace chimera::cuda::moe {
namespace {

constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr int kUnroll = 4;                 // 16-byte chunks per row and lane per step
constexpr int kStepChunks = 32 * kUnroll;  // chunks of a row one step covers (1024 16-bit elements)

// Two shapes. Long rows (K > 1024: Nano's 2688 and 1856, Super's down 2688): 2 rows per warp, several steps per
// row, the next step's 8 loads per lane issued before this step's FMAs (register double buffer). Short rows
// (K <= 1024: Super's latent 1024 up): one step covers the row, so there is nothing to prefetch within it; 4 rows
// per warp instead keep 16 loads per lane (8 KB per warp) in flight and the block's bytes near the long shape's.
template <bool kShortK>
struct GemvShape {
  static constexpr int kRows = kShortK ? 4 : 2;         // weight rows per warp (share the token chunks from smem)
  static constexpr int kRowsPerBlock = kWarps * kRows;  // 32 or 16
};

// Weight stream: read once, never written while the kernel runs: the non-coherent path, no L1 allocation.
// volatile keeps the loads where they are written (issued before the staging barrier and before the FMAs of the
// previous step); the registers are waited for only where they are used.
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// 8 packed 16-bit values -> fp32.
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

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// NT: the most tokens an item holds (the permutation's tile_rows); the item's actual count nt <= NT is uniform
// over the block, so the `t < nt` tests below are uniform branches.
template <typename T, int NT, bool kUp, bool kShortK>
__global__ void __launch_bounds__(kThreads, 2) moe_gemv_kernel(const GemmParams p) {
  constexpr int kRows = GemvShape<kShortK>::kRows, kRowsPerBlock = GemvShape<kShortK>::kRowsPerBlock;
  extern __shared__ __align__(16) unsigned char gemv_smem[];
  uint4* xs = reinterpret_cast<uint4*>(gemv_smem);  // [NT][K / 8] chunks of the item's token rows

  const int item_id = static_cast<int>(blockIdx.x) / p.n_tiles, n_tile = static_cast<int>(blockIdx.x) % p.n_tiles;
  // Both loads at once (items[] is allocated up to max_items; an entry past *n_items is never used): one L2 round
  // trip before the expert's pointer, then the weight stream.
  const int n_items = *p.n_items;
  const int4 item = p.items[item_id];
  if (item_id >= n_items) return;
  const int r0 = item.y, nt = item.z;
  const int tid = static_cast<int>(threadIdx.x), lane = tid % 32, warp = tid / 32;
  const int KC = kShortK ? min(p.K / 8, kStepChunks) : p.K / 8;  // 16-byte chunks per row (K % 8 == 0 here)
  const int row0 = n_tile * kRowsPerBlock + warp * kRows;
  const bool active = row0 < p.N;

  // Rows past N (the last block of an N that is no multiple of the block's rows) read row N - 1, store nothing.
  const T* W = static_cast<const T*>(p.weights[item.x]);
  const uint4* wrow[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r)
    wrow[r] = reinterpret_cast<const uint4*>(W + static_cast<int64_t>(min(row0 + r, p.N - 1)) * p.K);
  uint4 wnext[kRows][kUnroll];
  auto load_step = [&](int c0) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = c0 + u * 32 + lane;
#pragma unroll
      for (int r = 0; r < kRows; ++r) wnext[r][u] = c < KC ? ld_stream(wrow[r] + c) : make_uint4(0, 0, 0, 0);
    }
  };
  // The first step's weight loads go out before the staging barrier: they overlap the token rows' trip.
  if (active) load_step(0);

  // Stage the item's token rows. up: x row of the pair's token; down: h row r0 + m (permuted order).
  const uint4* X = static_cast<const uint4*>(p.x);
  for (int i = tid; i < nt * KC; i += kThreads) {
    const int m = i / KC, c = i - m * KC;
    const int64_t src = kUp ? p.sorted_pair[r0 + m] / p.top_k : r0 + m;
    xs[m * KC + c] = X[src * KC + c];
  }
  __syncthreads();
  if (!active) return;

  float acc[kRows][NT];
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[r][t] = 0.0f;

  for (int c0 = 0; c0 < KC; c0 += kStepChunks) {
    uint4 wcur[kRows][kUnroll];
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) wcur[r][u] = wnext[r][u];
    if (!kShortK && c0 + kStepChunks < KC) load_step(c0 + kStepChunks);  // in flight during this step's FMAs
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = c0 + u * 32 + lane;
      if (c >= KC) break;  // chunks past the row: only in the row's last step
      float wf[kRows][8];
#pragma unroll
      for (int r = 0; r < kRows; ++r) unpack8<T>(wcur[r][u], wf[r]);
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        if (t >= nt) break;
        float xf[8];
        unpack8<T>(xs[t * KC + c], xf);
#pragma unroll
        for (int r = 0; r < kRows; ++r)
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[r][t] = fmaf(wf[r][j], xf[j], acc[r][t]);
      }
    }
  }

  // Reduce over the lanes; lane t stores token t's outputs (rows row0 .. row0 + kRows - 1).
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    if (t >= nt) break;
    float v[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) v[r] = warp_sum(acc[r][t]);
    if (lane != t) continue;
    if constexpr (kUp) {
      T* h = static_cast<T*>(p.out) + static_cast<int64_t>(r0 + t) * p.N;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float a = fmaxf(v[r], 0.0f);
        if (row0 + r < p.N) h[row0 + r] = from_float<T>(a * a);
      }
    } else {
      const int pair = p.sorted_pair[r0 + t];
      const float w = p.topk_weights[pair];
      float* y = static_cast<float*>(p.out) + static_cast<int64_t>(pair) * p.N;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        if (row0 + r < p.N) y[row0 + r] = v[r] * w;
      }
    }
  }
}

template <typename T, int NT, bool kUp, bool kShortK>
void launch(GemmParams p, cudaStream_t stream) {
  p.n_tiles = ceil_div(p.N, GemvShape<kShortK>::kRowsPerBlock);
  const int64_t blocks = static_cast<int64_t>(p.n_tiles) * p.max_items;
  if (blocks == 0) return;
  if (blocks > 0x7fffffff) throw_runtime(str_cat("ops::moe_experts: ", blocks, " GEMV blocks is too many"));
  const size_t smem = static_cast<size_t>(NT) * p.K * sizeof(T);
  static const bool configured = [] {
    CHIMERA_CUDA_CHECK(
        cudaFuncSetAttribute(moe_gemv_kernel<T, NT, kUp, kShortK>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(kGemvMaxSmemBytes)),
        "ops::moe_experts");
    return true;
  }();
  (void)configured;
  moe_gemv_kernel<T, NT, kUp, kShortK><<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(p);
  CHIMERA_LAUNCH_CHECK("ops::moe_experts");
}

template <typename T, int NT>
void launch_nt(const GemmParams& p, bool up, cudaStream_t stream) {
  if (p.K <= kStepChunks * 8) {
    up ? launch<T, NT, true, true>(p, stream) : launch<T, NT, false, true>(p, stream);
  } else {
    up ? launch<T, NT, true, false>(p, stream) : launch<T, NT, false, false>(p, stream);
  }
}

template <typename T>
void launch_dtype(const GemmParams& p, int tile_rows, bool up, cudaStream_t stream) {
  switch (tile_rows) {
    case 1: return launch_nt<T, 1>(p, up, stream);
    case 2: return launch_nt<T, 2>(p, up, stream);
    case 4: return launch_nt<T, 4>(p, up, stream);
    case 8: return launch_nt<T, 8>(p, up, stream);
    default: throw_runtime(str_cat("ops::moe_experts: GEMV tile of ", tile_rows, " tokens (supported: 1, 2, 4, 8)"));
  }
}

}  // namespace

int gemv_tile_rows(int64_t T) {
  return T <= 1 ? 1 : T <= 2 ? 2 : T <= 4 ? 4 : 8;
}

bool gemv_fits(int64_t T, int64_t K) {
  return T <= kGemvMaxTokens && K % 8 == 0 && static_cast<int64_t>(gemv_tile_rows(T)) * K * 2 <= kGemvMaxSmemBytes;
}

void launch_moe_gemv(GemmParams p, DType dtype, int tile_rows, bool up, cudaStream_t stream) {
  if (p.K % 8 != 0 || static_cast<int64_t>(tile_rows) * p.K * 2 > kGemvMaxSmemBytes) {
    throw_runtime(str_cat("ops::moe_experts: the GEMV path needs K % 8 == 0 and ", tile_rows,
                          " x K x 2 <= ", kGemvMaxSmemBytes, " bytes (K = ", p.K, ")"));
  }
  switch (dtype) {
    case DType::kBF16: return launch_dtype<__nv_bfloat16>(p, tile_rows, up, stream);
    case DType::kF16: return launch_dtype<__half>(p, tile_rows, up, stream);
    default: throw_runtime(str_cat("ops::moe_experts: the GEMV path takes BF16 or F16, not ", dtype_name(dtype)));
  }
}

}  // namespace chimera::cuda::moe
