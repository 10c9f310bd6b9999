// Grouped expert GEMM, fp32 SIMT path: fp32 activations (the fp32 tolerance rows demand fp32 products) or any
// dtype mix the tensor-core path does not take (odd K / N, mixed activation and weight dtypes, f32 weights).
// Same work list and output contract as the tensor-core path (moe_kernels.h); h stays fp32 here.
//
// Block tile: BN = 64 weight rows x BT = 16 permuted rows (tokens), BK = 32; 256 threads, each 2 rows x 2 tokens.
// Tiles go through shared memory transposed to [k][row]; the next tile is prefetched into registers while the
// current one is multiplied.
#include <cstdint>

#include "backends/cuda/cuda_common.cuh"
#include "backends/cuda/moe/moe_kernels.h"

namespace chimera::cuda::moe {
namespace {

constexpr int kBN = 64, kBT = kSimtTileRows, kBK = 32, kThreads = 256;
constexpr int kWPerThread = kBN * kBK / kThreads;  // 8
constexpr int kXPerThread = kBT * kBK / kThreads;  // 2

template <typename TX, typename TW, bool kUp>
__global__ void __launch_bounds__(kThreads) moe_gemm_simt_kernel(const GemmParams p) {
  __shared__ float sW[kBK][kBN + 1];
  __shared__ float sX[kBK][kBT + 1];
  const int item_id = static_cast<int>(blockIdx.x) / p.n_tiles, n_tile = static_cast<int>(blockIdx.x) % p.n_tiles;
  if (item_id >= *p.n_items) return;
  const int4 item = p.items[item_id];
  const int r0 = item.y, rows = item.z, n0 = n_tile * kBN;
  const TW* W = static_cast<const TW*>(p.weights[item.x]);
  const TX* X = static_cast<const TX*>(p.x);
  const int tid = static_cast<int>(threadIdx.x);

  // Loader assignment: element idx = tid + i * 256 of the [rows][BK] tile -> (row = idx / BK, k = idx % BK).
  const TX* x_row[kXPerThread];
#pragma unroll
  for (int i = 0; i < kXPerThread; ++i) {
    const int r = (tid + i * kThreads) / kBK;
    x_row[i] = nullptr;
    if (r < rows) {
      const int64_t src = kUp ? p.sorted_pair[r0 + r] / p.top_k : r0 + r;
      x_row[i] = X + src * p.K;
    }
  }
  float wv[kWPerThread], xv[kXPerThread];
  auto load = [&](int k0) {
#pragma unroll
    for (int i = 0; i < kWPerThread; ++i) {
      const int idx = tid + i * kThreads, r = idx / kBK, k = k0 + idx % kBK;
      wv[i] = (n0 + r < p.N && k < p.K) ? to_float(W[static_cast<int64_t>(n0 + r) * p.K + k]) : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < kXPerThread; ++i) {
      const int k = k0 + (tid + i * kThreads) % kBK;
      xv[i] = (x_row[i] != nullptr && k < p.K) ? to_float(x_row[i][k]) : 0.0f;
    }
  };

  const int tn = tid % 32, tm = tid / 32;  // rows tn, tn + 32; tokens 2 * tm, 2 * tm + 1
  float acc[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};
  load(0);
  for (int k0 = 0; k0 < p.K; k0 += kBK) {
#pragma unroll
    for (int i = 0; i < kWPerThread; ++i) {
      const int idx = tid + i * kThreads;
      sW[idx % kBK][idx / kBK] = wv[i];
    }
#pragma unroll
    for (int i = 0; i < kXPerThread; ++i) {
      const int idx = tid + i * kThreads;
      sX[idx % kBK][idx / kBK] = xv[i];
    }
    __syncthreads();
    if (k0 + kBK < p.K) load(k0 + kBK);
#pragma unroll 8
    for (int kk = 0; kk < kBK; ++kk) {
      const float a0 = sW[kk][tn], a1 = sW[kk][tn + 32];
      const float b0 = sX[kk][2 * tm], b1 = sX[kk][2 * tm + 1];
      acc[0][0] = fmaf(a0, b0, acc[0][0]);
      acc[0][1] = fmaf(a0, b1, acc[0][1]);
      acc[1][0] = fmaf(a1, b0, acc[1][0]);
      acc[1][1] = fmaf(a1, b1, acc[1][1]);
    }
    __syncthreads();
  }

#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int m = 2 * tm + j;
    if (m >= rows) continue;
    if constexpr (kUp) {
      float* h = static_cast<float*>(p.out) + static_cast<int64_t>(r0 + m) * p.N;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int n = n0 + tn + 32 * i;
        const float v = fmaxf(acc[i][j], 0.0f);
        if (n < p.N) h[n] = v * v;
      }
    } else {
      const int pair = p.sorted_pair[r0 + m];
      const float w = p.topk_weights[pair];
      float* y = static_cast<float*>(p.out) + static_cast<int64_t>(pair) * p.N;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int n = n0 + tn + 32 * i;
        if (n < p.N) y[n] = acc[i][j] * w;
      }
    }
  }
}

template <typename TX, typename TW, bool kUp>
void launch(GemmParams p, cudaStream_t stream) {
  p.n_tiles = ceil_div(p.N, kBN);
  const int64_t blocks = static_cast<int64_t>(p.n_tiles) * p.max_items;
  if (blocks == 0) return;
  if (blocks > 0x7fffffff) throw_runtime(str_cat("ops::moe_experts: ", blocks, " GEMM blocks is too many"));
  moe_gemm_simt_kernel<TX, TW, kUp><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
  CHIMERA_LAUNCH_CHECK("ops::moe_experts");
}

}  // namespace

void launch_moe_gemm_simt(GemmParams p, DType x_dtype, DType w_dtype, bool up, cudaStream_t stream) {
  CHIMERA_DISPATCH_FLOAT(w_dtype, "ops::moe_experts expert weights", TW, {
    if (up) {
      CHIMERA_DISPATCH_FLOAT(x_dtype, "ops::moe_experts x", TX, { launch<TX, TW, true>(p, stream); });
    } else {
      launch<float, TW, false>(p, stream);  // h is fp32 on this path
    }
  });
}

}  // namespace chimera::cuda::moe
