// MoE token permutation and combine (docs/model.md 6.2): the (token, choice) pairs sorted by expert, stably, as
// the GEMM work list; and the weighted expert outputs summed back to token order. Both deterministic: no
// global atomics, a fixed summation order.
#include <cstdint>

#include "backends/cuda/cuda_common.cuh"
#include "backends/cuda/launch.cuh"
#include "backends/cuda/moe/moe_kernels.h"

namespace chimera::cuda::moe {
namespace {

constexpr int kPermuteThreads = 1024;
constexpr int kPermuteWarps = kPermuteThreads / 32;

// Block-wide exclusive scan of one int per thread (1024 threads); returns the thread's prefix, *total the sum.
__device__ int block_exclusive_scan(int v, int* s_warp, int* total) {
  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
  int incl = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int n = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += n;
  }
  if (lane == 31) s_warp[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    int w = s_warp[lane];
    int wincl = w;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int n = __shfl_up_sync(0xffffffffu, wincl, o);
      if (lane >= o) wincl += n;
    }
    s_warp[lane] = wincl - w;
    if (lane == 31) *total = wincl;
  }
  __syncthreads();
  const int r = s_warp[warp] + incl - v;
  __syncthreads();  // s_warp may be reused by the caller
  return r;
}

// One block (1024 threads = 32 warps). Warp w owns the contiguous chunk [w * C, (w + 1) * C) of the pairs.
//   1. per-warp expert histograms hist[w][e] (shared-memory atomics: counts are order-free)
//   2. per expert: exclusive prefix over the warps, totals, block scan -> expert offsets and tile offsets
//   3. each warp walks its chunk in order, 32 pairs at a time; __match_any_sync ranks equal experts within the
//      step, so every pair lands at offset[e] + (pairs of e in earlier chunks) + (earlier pairs of e in this one)
//   4. the work items, expert-major.
// smem: hist [32][E] int + scan scratch [34] int.
__global__ void __launch_bounds__(kPermuteThreads) moe_permute_kernel(const PermuteParams p) {
  extern __shared__ int permute_smem[];
  int* hist = permute_smem;                      // [kPermuteWarps][E]
  int* s_scan = hist + kPermuteWarps * p.E;      // [32]
  int* s_totals = s_scan + 32;                   // [2]
  const int tid = static_cast<int>(threadIdx.x), lane = tid % 32, warp = tid / 32;
  const int chunk = (p.P + kPermuteWarps - 1) / kPermuteWarps;
  const int begin = min(p.P, warp * chunk), end = min(p.P, begin + chunk);

  for (int i = tid; i < kPermuteWarps * p.E; i += kPermuteThreads) hist[i] = 0;
  pdl_wait();  // PDL: topk_ids are the router's output; sorted_pair / items may still be read by a predecessor
  pdl_trigger();
  __syncthreads();
  for (int i = begin + lane; i < end; i += 32) {
    const int e = p.topk_ids[i];
    if (e >= 0 && e < p.E) atomicAdd(&hist[warp * p.E + e], 1);
  }
  __syncthreads();

  // Step 2. E <= 512 < 1024 threads: thread e owns expert e.
  const int e_own = tid;
  int count = 0;
  if (e_own < p.E) {
    for (int w = 0; w < kPermuteWarps; ++w) {
      const int c = hist[w * p.E + e_own];
      hist[w * p.E + e_own] = count;  // exclusive prefix over the earlier chunks
      count += c;
    }
  }
  const int tiles = (count + p.tile_rows - 1) / p.tile_rows;
  const int offset = block_exclusive_scan(count, s_scan, &s_totals[0]);
  const int tile_off = block_exclusive_scan(tiles, s_scan, &s_totals[1]);
  if (e_own < p.E) {
    for (int w = 0; w < kPermuteWarps; ++w) hist[w * p.E + e_own] += offset;
  }
  __syncthreads();

  // Step 3: stable scatter.
  const unsigned lt_mask = (1u << lane) - 1u;
  for (int base = begin; base < end; base += 32) {
    const int i = base + lane;
    const bool in = i < end;
    int e = in ? p.topk_ids[i] : -1;
    if (e >= p.E) e = -1;
    const unsigned active = __ballot_sync(0xffffffffu, in);
    const unsigned peers = __match_any_sync(0xffffffffu, e);
    if (in && e >= 0) {
      const int rank = __popc(peers & active & lt_mask);
      p.sorted_pair[hist[warp * p.E + e] + rank] = i;
    }
    __syncwarp();
    // The highest lane of each group advances the group's cursor.
    if (in && e >= 0 && (peers & active & ~lt_mask & ~(1u << lane)) == 0) {
      hist[warp * p.E + e] += __popc(peers & active);
    }
    __syncwarp();
  }

  // Step 4: work items, expert-major.
  if (e_own < p.E) {
    for (int m = 0; m * p.tile_rows < count; ++m) {
      const int r0 = offset + m * p.tile_rows;
      p.items[tile_off + m] = make_int4(e_own, r0, min(p.tile_rows, count - m * p.tile_rows), 0);
    }
  }
  if (tid == 0) *p.n_items = s_totals[1];
}

// Blocks (token, column chunk of kCombineCols): the token's pairs ranked by (expert, choice index), then each thread
// sums its columns over the pairs in that order (the CPU reference's expert order), in fp32. Several blocks per
// token so that a decode step's handful of tokens still spreads over SMs (with one block per token, each thread
// would walk several column groups one after another).
constexpr int kCombineCols = 1024;  // columns per block: 256 threads x 4

// kPermuted (the CUTLASS path): y is in permuted order and unscaled; pair q's row is pair_row[q] and its term
// y * topk_weights[q] is rounded before the sum (__fmul_rn: no fma contraction), as the mma path's epilogue does.
template <typename TO, int VEC, bool kPermuted>
__global__ void __launch_bounds__(256) moe_combine_kernel(const CombineParams p) {
  __shared__ int s_order[32];
  __shared__ int s_n;
  __shared__ int s_row[32];  // kPermuted: y row of the r-th pair in expert order
  __shared__ float s_w[32];  // kPermuted: its routing weight
  const int t = static_cast<int>(blockIdx.x);
  pdl_wait();  // PDL: ids and the expert outputs y are earlier kernels' outputs
  pdl_trigger();
  const int32_t* ids = p.topk_ids + static_cast<int64_t>(t) * p.k;
  if (threadIdx.x < 32) {
    const int j = static_cast<int>(threadIdx.x);
    const int e = j < p.k ? ids[j] : -1;
    const bool valid = j < p.k && e >= 0 && e < p.E;
    int rank = 0;
    for (int o = 0; o < p.k; ++o) {
      const int eo = ids[o];
      const bool vo = eo >= 0 && eo < p.E;
      rank += (vo && (eo < e || (eo == e && o < j))) ? 1 : 0;
    }
    if (valid) s_order[rank] = j;
    const unsigned nvalid = __ballot_sync(0xffffffffu, valid);
    if (j == 0) s_n = __popc(nvalid);
  }
  __syncthreads();
  const int n = s_n;
  if constexpr (kPermuted) {
    if (static_cast<int>(threadIdx.x) < n) {
      const int q = t * p.k + s_order[threadIdx.x];
      s_row[threadIdx.x] = p.pair_row[q];
      s_w[threadIdx.x] = p.topk_weights[q];
    }
    __syncthreads();
  }
  const float* y = p.y + static_cast<int64_t>(t) * p.k * p.D;
  TO* out = static_cast<TO*>(p.out) + static_cast<int64_t>(t) * p.D;
  const int c_end = min(p.D, (static_cast<int>(blockIdx.y) + 1) * kCombineCols);
  for (int c = static_cast<int>(blockIdx.y) * kCombineCols + static_cast<int>(threadIdx.x) * VEC; c < c_end;
       c += static_cast<int>(blockDim.x) * VEC) {
    float acc[VEC];
#pragma unroll
    for (int v = 0; v < VEC; ++v) acc[v] = 0.0f;
    for (int r = 0; r < n; ++r) {
      if constexpr (kPermuted) {
        const float* yr = p.y + static_cast<int64_t>(s_row[r]) * p.D + c;
        const float w = s_w[r];
        if constexpr (VEC == 4) {
          const float4 q = *reinterpret_cast<const float4*>(yr);
          acc[0] += __fmul_rn(q.x, w);
          acc[1] += __fmul_rn(q.y, w);
          acc[2] += __fmul_rn(q.z, w);
          acc[3] += __fmul_rn(q.w, w);
        } else {
          acc[0] += __fmul_rn(yr[0], w);
        }
      } else {
        const float* yr = y + static_cast<int64_t>(s_order[r]) * p.D + c;
        if constexpr (VEC == 4) {
          const float4 q = *reinterpret_cast<const float4*>(yr);
          acc[0] += q.x;
          acc[1] += q.y;
          acc[2] += q.z;
          acc[3] += q.w;
        } else {
          acc[0] += yr[0];
        }
      }
    }
#pragma unroll
    for (int v = 0; v < VEC; ++v) out[c + v] = from_float<TO>(acc[v]);
  }
}

// One thread per (token, choice) pair: the whole model's expert id to the rank's (ops::local_expert_ids).
__global__ void local_expert_ids_kernel(int32_t* ids, int64_t n, int32_t first, int32_t count) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  pdl_wait();  // PDL: the ids are the router's output
  pdl_trigger();
  if (i >= n) return;
  const int32_t e = ids[i] - first;
  ids[i] = e >= 0 && e < count ? e : -1;
}

}  // namespace

void launch_local_expert_ids(int32_t* ids, int64_t n, int32_t first, int32_t count, cudaStream_t stream) {
  if (n == 0) return;
  constexpr int kThreads = 256;
  launch(local_expert_ids_kernel, dim3(static_cast<unsigned>((n + kThreads - 1) / kThreads)), dim3(kThreads), 0, stream,
         ids, n, first, count);
  CHIMERA_LAUNCH_CHECK("ops::local_expert_ids");
}

void launch_moe_permute(const PermuteParams& p, cudaStream_t stream) {
  if (p.E < 1 || p.E > kPermuteMaxExperts) {
    throw_runtime(str_cat("ops::moe_experts: ", p.E, " experts is not supported on CUDA (supported: 1..",
                          kPermuteMaxExperts, ")"));
  }
  const size_t smem = sizeof(int) * (static_cast<size_t>(kPermuteWarps) * p.E + 34);
  static const bool configured = [] {  // 32 x 512 ints = 64 KiB: above the default 48 KiB
    set_max_dynamic_smem(moe_permute_kernel, sizeof(int) * (kPermuteWarps * kPermuteMaxExperts + 34),
                         "ops::moe_experts");
    return true;
  }();
  (void)configured;
  launch(moe_permute_kernel, dim3(1), dim3(kPermuteThreads), smem, stream, p);
  CHIMERA_LAUNCH_CHECK("ops::moe_experts");
}

void launch_moe_combine(const CombineParams& p, cudaStream_t stream) {
  if (p.T == 0) return;
  if (p.k > 32) throw_runtime(str_cat("ops::moe_experts: top-", p.k, " is not supported on CUDA (k <= 32)"));
  CHIMERA_DISPATCH_FLOAT(p.out_dtype, "ops::moe_experts out", TO, {
    const dim3 grid(static_cast<unsigned>(p.T), static_cast<unsigned>((p.D + kCombineCols - 1) / kCombineCols));
    const bool y_aligned = p.D % 4 == 0 && (reinterpret_cast<uintptr_t>(p.y) & 15u) == 0;  // 16-byte loads of y
    if (p.pair_row != nullptr && y_aligned) {
      launch(moe_combine_kernel<TO, 4, true>, grid, dim3(256), 0, stream, p);
    } else if (p.pair_row != nullptr) {
      launch(moe_combine_kernel<TO, 1, true>, grid, dim3(256), 0, stream, p);
    } else if (y_aligned) {
      launch(moe_combine_kernel<TO, 4, false>, grid, dim3(256), 0, stream, p);
    } else {
      launch(moe_combine_kernel<TO, 1, false>, grid, dim3(256), 0, stream, p);
    }
  });
  CHIMERA_LAUNCH_CHECK("ops::moe_experts");
}

}  // namespace chimera::cuda::moe
