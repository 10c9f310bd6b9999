// Decode-size dense layer whose weights are copied into shared memory before the PDL wait (ops::linear_staged):
// y[T, N] = x[T, K] @ W[N, K]^T (+ b) for T <= 2 tokens and 16-bit weights.
//
// Why (issue 4, measured with bench/trace on the H200): at batch-1 decode a Mamba layer's out_proj (Nano: 2688 x
// 4096, 22 MB) follows the fused Mamba decode kernel, which runs ~10 us with little memory traffic (latency: the
// conv, the state update, the cluster's gated norm), and an attention layer's o_proj follows the split-KV decode and
// its combine. The plain GEMV (gemv.cu) can only request its first weight vectors before its wait, so the layer's
// weight stream starts when the previous kernel ends: out_proj cost ~9 us of critical path per layer (0.58 of its
// streaming floor). Here the grid is one block per SM and block b owns the contiguous rows [b N / G, (b+1) N / G),
// which must fit its shared memory (Nano out_proj: 21 rows x 8 KB = 168 KB): one thread copies them global ->
// shared with 1-D bulk copies (bulk_copy.cuh) before pdl_wait(), so the whole weight streams while the previous
// kernel still runs (PDL lets this grid start once that kernel has passed its own wait). After the wait only x is
// read from global memory; the products come from shared memory.
//
// Work split after the wait: warp w takes the w-th eighth of each row's 16-byte vectors; each lane keeps its x
// vectors (at most kXVecs per token, K <= 8192) in registers and walks the block's rows, one fp32 partial per row and
// token, reduced over the warp's lanes by a butterfly and over the 8 warps in warp order through shared memory. The
// summation order is fixed (deterministic, independent of the grid) but not the plain GEMV's: results agree with it
// to fp32 rounding, not bit for bit.
#include <algorithm>

#include "backends/cuda/bulk_copy.cuh"
#include "backends/cuda/cuda_common.cuh"
#include "backends/cuda/cuda_vec.cuh"
#include "backends/cuda/gemm/gemv.h"
#include "backends/cuda/launch.cuh"

namespace chimera::cuda::gemm {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kXVecs = 4;            // x vectors per lane and token: a warp's eighth of a row <= 128 vectors
constexpr int kMaxRows = 64;         // rows per block (the partials' static shared memory)
constexpr uint32_t kChunk = 32768;   // bytes per bulk copy (several in flight through the TMA engine)

template <typename T, int MT>
__global__ void __launch_bounds__(kThreads, 1) gemv_staged_kernel(const GemvStagedParams p) {
  extern __shared__ __align__(128) uint4 staged_smem[];  // [rows][K / 8] weight vectors
  __shared__ __align__(8) uint64_t bar;
  __shared__ float partial[kWarps][kMaxRows][MT];
  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
  const int G = static_cast<int>(gridDim.x), b = static_cast<int>(blockIdx.x);
  const int r0 = static_cast<int>(static_cast<int64_t>(b) * p.N / G);
  const int rows = static_cast<int>(static_cast<int64_t>(b + 1) * p.N / G) - r0;
  const int kv = p.K / 8;

  // Before the wait: the block's rows (constant weights) into shared memory.
  if (tid == 0) {
    mbar_init(&bar, 1);
    const uint32_t bytes = static_cast<uint32_t>(rows) * static_cast<uint32_t>(kv) * 16u;
    mbar_arrive_expect_tx(&bar, bytes);
    const auto* src = reinterpret_cast<const unsigned char*>(p.w) + static_cast<int64_t>(r0) * kv * 16;
    auto* dst = reinterpret_cast<unsigned char*>(staged_smem);
    for (uint32_t off = 0; off < bytes; off += kChunk) bulk_copy_g2s(dst + off, src + off, min(kChunk, bytes - off), &bar);
  }
  pdl_wait();
  pdl_trigger();

  // This lane's x vectors: v = v0 + lane + 32 j of each token (zeros past K and past T).
  const int per = (kv + kWarps - 1) / kWarps;
  const int v0 = warp * per, v1 = min(kv, v0 + per);
  const uint4* xg = static_cast<const uint4*>(p.x);
  uint4 xv[MT][kXVecs];
#pragma unroll
  for (int t = 0; t < MT; ++t) {
#pragma unroll
    for (int j = 0; j < kXVecs; ++j) {
      const int v = v0 + lane + 32 * j;
      xv[t][j] = t < p.T && v < v1 ? xg[static_cast<int64_t>(t) * kv + v] : make_uint4(0, 0, 0, 0);
    }
  }
  __syncthreads();  // the barrier's initialisation is visible to every waiting thread
  mbar_wait(&bar, 0);

  for (int r = 0; r < rows; ++r) {
    const uint4* wr = staged_smem + static_cast<int64_t>(r) * kv;
    float acc[MT];
#pragma unroll
    for (int t = 0; t < MT; ++t) acc[t] = 0.0f;
#pragma unroll
    for (int j = 0; j < kXVecs; ++j) {
      const int v = v0 + lane + 32 * j;
      if (v < v1) {
        float wf[8];
        unpack8<T>(wr[v], wf);
#pragma unroll
        for (int t = 0; t < MT; ++t) {
          float xf[8];
          unpack8<T>(xv[t][j], xf);
          float s = acc[t];
#pragma unroll
          for (int e = 0; e < 8; ++e) s = fmaf(wf[e], xf[e], s);
          acc[t] = s;
        }
      }
    }
#pragma unroll
    for (int t = 0; t < MT; ++t) {
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) acc[t] += __shfl_xor_sync(0xFFFFFFFFu, acc[t], o);
    }
    if (lane == 0) {
#pragma unroll
      for (int t = 0; t < MT; ++t) partial[warp][r][t] = acc[t];
    }
  }
  __syncthreads();
  for (int i = tid; i < rows * p.T; i += kThreads) {
    const int r = i / p.T, t = i - r * p.T;
    float s = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) s += partial[w][r][t];
    if (p.bias != nullptr) s += to_float(static_cast<const T*>(p.bias)[r0 + r]);
    static_cast<T*>(p.y)[static_cast<int64_t>(t) * p.N + r0 + r] = from_float<T>(s);
  }
}

// Dynamic shared memory of the launch: the largest block's rows.
size_t staged_smem_bytes(int64_t N, int64_t K) {
  const int64_t G = sm_count();
  return static_cast<size_t>((N + G - 1) / G) * static_cast<size_t>(K) * 2;
}

int max_dynamic_smem() {
  static const int bytes = [] {
    int dev = 0, v = 0;
    CHIMERA_CUDA_CHECK(cudaGetDevice(&dev), "ops::linear_staged");
    CHIMERA_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev), "ops::linear_staged");
    return v;
  }();
  return bytes;
}

template <typename T, int MT>
void launch_staged(const GemvStagedParams& p, cudaStream_t stream) {
  const size_t smem = staged_smem_bytes(p.N, p.K);
  auto* kernel = gemv_staged_kernel<T, MT>;
  CHIMERA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)),
                     "ops::linear_staged");
  CHIMERA_CUDA_CHECK(launch(kernel, dim3(static_cast<unsigned>(sm_count())), dim3(kThreads), smem, stream, p),
                     "ops::linear_staged");
}

}  // namespace

bool gemv_staged_supported(int64_t T, int64_t K, int64_t N, DType dtype, const void* x, const void* w) {
  if (T < 1 || T > 2 || N < 1 || K < 8 || K % 8 != 0 || K > int64_t{8} * kWarps * 32 * kXVecs) return false;
  if (dtype != DType::kBF16 && dtype != DType::kF16) return false;
  const auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  if (!aligned(x) || !aligned(w)) return false;
  const int64_t G = sm_count();
  if ((N + G - 1) / G > kMaxRows) return false;
  // The static part (the partials, the barrier) and some slack beside the rows.
  return staged_smem_bytes(N, K) + sizeof(float) * kWarps * kMaxRows * 2 + 1024 <= static_cast<size_t>(max_dynamic_smem());
}

void launch_gemv_staged(const GemvStagedParams& p, DType dtype, cudaStream_t stream) {
  if (!gemv_staged_supported(p.T, p.K, p.N, dtype, p.x, p.w)) {
    throw_runtime(str_cat("ops::linear_staged: T = ", p.T, ", K = ", p.K, ", N = ", p.N, " ", dtype_name(dtype),
                          " is not supported (T <= 2, 16-bit, K % 8 == 0, K <= 8192, 16-byte aligned x and w, each "
                          "SM's rows in its shared memory)"));
  }
  switch (dtype) {
    case DType::kBF16:
      return p.T <= 1 ? launch_staged<__nv_bfloat16, 1>(p, stream) : launch_staged<__nv_bfloat16, 2>(p, stream);
    default:
      return p.T <= 1 ? launch_staged<__half, 1>(p, stream) : launch_staged<__half, 2>(p, stream);
  }
}

}  // namespace chimera::cuda::gemm
