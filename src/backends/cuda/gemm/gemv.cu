// Decode-size dense layers: y[T, N] = x[T, K] @ W[N, K]^T (+ b) (+ relu^2) for T <= kGemvMaxTokens tokens and
// 16-bit weights, as a weight-streaming GEMV.
//
// Why not cuBLASLt here: at T = 1..8 every dense layer of a decode step is a pure weight stream (x is a few KB),
// and cuBLASLt's heuristic picks split-K kernels for most of these shapes plus a separate split-K reduce kernel
// (ncu on the H200, one Nano batch-1 decode step: 93 reduce kernels among the 116 dense layers; in a CUDA graph
// cuBLASLt reaches 0.79 of the weight floor on the Nano in_proj but 0.49 on its out_proj). This kernel reads each
// weight byte once with 16-byte loads, keeps x in shared memory, and writes y directly (no workspace, no second
// kernel). cuda::linear times it against cuBLASLt once per shape up to kLinearGemvAutoMaxTokens tokens (linear.h).
//
// Work split: a block is 8 warps; a row of W (one output feature) is shared by `warps_per_row` warps (1, 2, 4 or 8,
// chosen so that small-N layers still put every SM to work), each taking a contiguous range of the row's 16-byte
// vectors; lanes stride the range by 32 vectors, kUnroll independent loads in flight per lane. Blocks loop over
// groups of 8 / warps_per_row rows: the grid is what fits on the GPU at once (occupancy query), with the groups
// spread evenly over it so that no last partial round leaves SMs idle; x is staged once per block.
// x stays in its 16-bit dtype in shared memory: lane l reads the 16 bytes at vector v + l, so a warp's read is 512
// contiguous bytes (4 wavefronts, no bank conflicts); staged as fp32 it would take twice the shared-memory reads
// per weight vector and make the T >= 2 cases shared-memory bound instead of bandwidth bound.
//
// PDL (launch.cuh): the first kUnroll weight vectors of the block's first row group are loaded before pdl_wait()
// (weights are constant during a step), so the weight stream starts while the previous kernel drains.
//
// Residual norm (GemvParams::norm, ops::residual_norm_linear): x is not read but computed by every block from the
// residual and the layer output(s) before it, as the add + RMSNorm kernel would have written it (same per-thread
// vectors, same butterfly, same roundings: bit-identical); block 0 also writes the new residual. Redundant work per
// block (a 2 x T x K element read from L2 and one block reduction) instead of a launch and a dependent round trip.
//
// Numerics: fp32 products and sums (the per-lane partial sums, then a warp butterfly, then the row's warps in part
// order), + bias in fp32, one rounding to T at the store. With relu2: the rounded value v, then fmaxf(v, 0)^2 in fp32
// rounded again: exactly linear() then relu2() of the unfused path (elementwise.cu).
#include "backends/cuda/gemm/gemv.h"

#include <algorithm>

#include "backends/cuda/cuda_common.cuh"
#include "backends/cuda/cuda_vec.cuh"
#include "backends/cuda/launch.cuh"

namespace chimera::cuda::gemm {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kUnroll = 8;  // 16-byte weight loads in flight per lane per step

// Launch row -> (part, row within the part). Selected, not indexed, so the parameter array stays in the constant
// bank (a dynamic index would copy it to local memory).
struct PartRow {
  GemvPart part;
  int row;
};
__device__ __forceinline__ PartRow part_row(const GemvParams& p, int row) {
  if (p.n_parts > 1 && row >= p.parts[0].N) {
    row -= p.parts[0].N;
    if (p.n_parts > 2 && row >= p.parts[1].N) return PartRow{p.parts[2], row - p.parts[1].N};
    return PartRow{p.parts[1], row};
  }
  return PartRow{p.parts[0], row};
}

// 8 fp32 values rounded to T and packed as one 16-byte vector.
template <typename T>
__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
  uint4 v;
  store_f32<T, 8>(reinterpret_cast<T*>(&v), f);
  return v;
}

// GemvParams::norm: rows [0, MT) of xs = weight * rms_norm(residual + a (+ round(a + b))) for the T real tokens,
// zeros past them. Thread i < n.threads holds vectors i + k * n.threads (k < kGemvNormVecs) of the row, as the norm
// kernel's threads do; its sum of squares goes through a full-warp and then an 8-warp butterfly, where the
// norm kernel's shorter butterflies see the same non-zero terms in the same order (the extra terms are exact
// zeros). nw: this thread's weight vectors, loaded before the PDL wait. Ends with a barrier.
template <typename T, int MT>
__device__ __forceinline__ void stage_normed_x(const GemvParams& p, uint4* xs, const uint4 (&nw)[kGemvNormVecs]) {
  __shared__ float red[kWarps];
  const GemvResidualNorm& n = p.norm;
  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
  const int kv = p.K / 8;
#pragma unroll 1  // one token at a time (registers)
  for (int t = 0; t < MT; ++t) {
    if (t >= p.T) {
      for (int i = tid; i < kv; i += kThreads) xs[t * kv + i] = make_uint4(0, 0, 0, 0);
      continue;
    }
    const size_t row = static_cast<size_t>(t) * static_cast<size_t>(kv);
    uint4 rv[kGemvNormVecs] = {}, av[kGemvNormVecs] = {}, bv[kGemvNormVecs] = {};
#pragma unroll
    for (int k = 0; k < kGemvNormVecs; ++k) {
      const int i = tid + k * n.threads;
      if (tid < n.threads && i < kv) {
        rv[k] = static_cast<const uint4*>(n.residual)[row + i];
        av[k] = static_cast<const uint4*>(n.a)[row + i];
        if (n.b != nullptr) bv[k] = static_cast<const uint4*>(n.b)[row + i];
      }
    }
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < kGemvNormVecs; ++k) {
      const int i = tid + k * n.threads;
      if (tid < n.threads && i < kv) {
        float v[8], x[8];
        unpack8<T>(rv[k], v);
        unpack8<T>(av[k], x);
        if (n.b != nullptr) {
          float z[8];
          unpack8<T>(bv[k], z);
#pragma unroll
          for (int j = 0; j < 8; ++j) x[j] = round_to<T>(x[j] + z[j]);
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = round_to<T>(v[j] + x[j]);
#pragma unroll
        for (int j = 0; j < 8; ++j) ss += v[j] * v[j];
        rv[k] = pack8<T>(v);  // exact: v is already rounded to T
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xFFFFFFFFu, ss, o);
    if (lane == 0) red[warp] = ss;
    __syncthreads();
    float total = lane < kWarps ? red[lane] : 0.0f;  // every warp sums the same partials in the same order
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xFFFFFFFFu, total, o);
    const float inv = 1.0f / sqrtf(total / static_cast<float>(p.K) + n.eps);
#pragma unroll
    for (int k = 0; k < kGemvNormVecs; ++k) {
      const int i = tid + k * n.threads;
      if (tid < n.threads && i < kv) {
        float v[8], w[8], o[8];
        unpack8<T>(rv[k], v);
        unpack8<T>(nw[k], w);
#pragma unroll
        for (int j = 0; j < 8; ++j) o[j] = w[j] * (v[j] * inv);
        xs[t * kv + i] = pack8<T>(o);
        if (blockIdx.x == 0) static_cast<uint4*>(n.residual_out)[row + i] = rv[k];
      }
    }
    __syncthreads();  // red is reused by the next token
  }
}

// x: [T, K] T, w_i: [N_i, K] T, bias_i: [N_i] T or null, y_i: [T, N_i] T. Dynamic shared memory: x, [MT][K] T
// (zero rows past T). kNorm: x computed from GemvParams::norm (stage_normed_x) instead of read.
// kMinBlocks: __launch_bounds__'s blocks per SM (launch_mt: 3 for the norm variant at T <= 2, else unbounded).
template <typename T, int MT, bool kRelu2, bool kNorm, int kMinBlocks>
__global__ void __launch_bounds__(kThreads, kMinBlocks) gemv_kernel(const GemvParams p) {
  extern __shared__ uint4 gemv_smem[];
  uint4* xs = gemv_smem;  // [MT][K / 8] vectors of 8 elements
  __shared__ float partial[kWarps][MT];

  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int wpr = p.warps_per_row, rows_per_group = kWarps / wpr;
  const int part = warp % wpr;
  const int kv = p.K / 8;  // 16-byte vectors per row
  const int per_part = (kv + wpr - 1) / wpr;
  const int v0 = part * per_part, v1 = min(kv, v0 + per_part);
  const int n_groups = (p.N + rows_per_group - 1) / rows_per_group;

  // Prologue before the grid dependency: this warp's first weight vectors of its first row.
  uint4 wv[kUnroll];
  int row = static_cast<int>(blockIdx.x) * rows_per_group + warp / wpr;
  {
    const PartRow pr = part_row(p, min(row, p.N - 1));
    const uint4* wrow = static_cast<const uint4*>(pr.part.w) + static_cast<int64_t>(pr.row) * kv;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int v = v0 + lane + u * 32;
      wv[u] = row < p.N && v < v1 ? ld_stream(wrow + v) : make_uint4(0, 0, 0, 0);
    }
  }
  [[maybe_unused]] uint4 nw[kGemvNormVecs] = {};  // the norm weight (constant) of this thread's vectors
  if constexpr (kNorm) {
    const int tid = static_cast<int>(threadIdx.x);
#pragma unroll
    for (int k = 0; k < kGemvNormVecs; ++k) {
      const int i = tid + k * p.norm.threads;
      if (tid < p.norm.threads && i < kv) nw[k] = __ldg(static_cast<const uint4*>(p.norm.weight) + i);
    }
  }
  pdl_wait();
  pdl_trigger();

  // x -> shared memory (T * K / 8 vectors; the padding tokens up to MT are zeros).
  if constexpr (kNorm) {
    stage_normed_x<T, MT>(p, xs, nw);
  } else {
    const uint4* xg = static_cast<const uint4*>(p.x);
    for (int i = static_cast<int>(threadIdx.x); i < MT * kv; i += kThreads) {
      xs[i] = i < p.T * kv ? xg[i] : make_uint4(0, 0, 0, 0);
    }
  }
  __syncthreads();

  bool preloaded = true;
  for (int g = static_cast<int>(blockIdx.x); g < n_groups; g += static_cast<int>(gridDim.x)) {
    row = g * rows_per_group + warp / wpr;
    const bool active = row < p.N;
    const PartRow pr = part_row(p, min(row, p.N - 1));
    const uint4* wrow = static_cast<const uint4*>(pr.part.w) + static_cast<int64_t>(pr.row) * kv;
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
            float wf[8];
            unpack8<T>(wv[u], wf);
#pragma unroll
            for (int t = 0; t < MT; ++t) {
              float xf[8];
              unpack8<T>(xs[t * kv + vu], xf);
              float s = acc[t];
#pragma unroll
              for (int j = 0; j < 8; ++j) s = fmaf(wf[j], xf[j], s);
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
      if (pr.part.bias != nullptr) s += to_float(static_cast<const T*>(pr.part.bias)[pr.row]);
      T v = from_float<T>(s);
      if constexpr (kRelu2) {
        const float r = fmaxf(to_float(v), 0.0f);
        v = from_float<T>(r * r);
      }
      static_cast<T*>(pr.part.y)[static_cast<int64_t>(lane) * pr.part.N + pr.row] = v;
    }
  }
}

// Warps per row: enough warps for every SM to hold ~16 of them streaming (split rows when N alone is too few);
// then, while the GPU still holds all the warps at once, split further until a warp's share of a row is ONE load
// step (kUnroll x 32 vectors): the whole weight is then requested in the first round trip, part of it before the
// PDL wait, instead of a second step waiting for the first (the Nano out_proj, 4096 columns = 512 vectors per row:
// 2 steps at one warp per row, 1 step at two).
int auto_warps_per_row(int64_t N, int64_t K, int64_t resident_warps) {
  const int64_t vectors = K / 8;
  int wpr = 1;
  while (wpr < kWarps && N * wpr < static_cast<int64_t>(sm_count()) * 16) wpr *= 2;
  while (wpr < kWarps && (vectors + wpr - 1) / wpr > kUnroll * 32 && N * wpr * 2 <= resident_warps) wpr *= 2;
  return wpr;
}

template <typename T, int MT, bool kRelu2>
void launch_mt(const GemvParams& p, cudaStream_t stream) {
  const size_t smem = sizeof(T) * static_cast<size_t>(MT) * static_cast<size_t>(p.K);
  // The plain kernel unbounded (a 3-blocks-per-SM bound gained nothing in the engine); the norm variant at T <= 2
  // bounded to 3 blocks per SM, which keeps its register count low enough for three resident blocks.
  auto* kernel = gemv_kernel<T, MT, kRelu2, false, 1>;
  if (p.norm.residual != nullptr) kernel = gemv_kernel<T, MT, false, true, MT <= 2 ? 3 : 1>;
  if (smem > 48 * 1024) {  // the opt-in is per device, so set it on every such launch (a host-side call)
    CHIMERA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)),
                       "ops::linear (gemv)");
  }
  int per_sm = 0;
  CHIMERA_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem),
                     "ops::linear (gemv occupancy)");
  GemvParams q = p;
  if (q.warps_per_row == 0) q.warps_per_row = auto_warps_per_row(q.N, q.K, std::max(1, per_sm) * sm_count() * kWarps);
  const int rows_per_group = kWarps / q.warps_per_row;
  const int n_groups = (p.N + rows_per_group - 1) / rows_per_group;
  const int resident = std::max(1, per_sm) * sm_count();
  const int rounds = (n_groups + resident - 1) / resident;
  const int blocks = (n_groups + rounds - 1) / rounds;  // every block does `rounds` groups (the last maybe fewer)
  CHIMERA_CUDA_CHECK(launch(kernel, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), smem, stream, q),
                     "ops::linear (gemv)");
}

template <typename T, bool kRelu2>
void launch_t(const GemvParams& p, cudaStream_t stream) {
  if (p.T <= 1) return launch_mt<T, 1, kRelu2>(p, stream);
  if (p.T <= 2) return launch_mt<T, 2, kRelu2>(p, stream);
  if (p.T <= 4) return launch_mt<T, 4, kRelu2>(p, stream);
  return launch_mt<T, 8, kRelu2>(p, stream);
}

}  // namespace

bool gemv_supported(int64_t T, int64_t K, int64_t N, DType dtype, const void* x, const void* w, const void* y) {
  if (T < 1 || T > kGemvMaxTokens || N < 1 || K < 8 || K % 8 != 0) return false;
  if (dtype != DType::kBF16 && dtype != DType::kF16) return false;
  const auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  if (!aligned(x) || !aligned(w) || !aligned(y)) return false;
  const int64_t mt = T <= 1 ? 1 : T <= 2 ? 2 : T <= 4 ? 4 : 8;
  return int64_t{2} * mt * K <= kGemvMaxSmemBytes && N < (int64_t{1} << 31) / K;
}

void launch_gemv(const GemvParams& p, DType dtype, bool relu2, cudaStream_t stream) {
  if (p.warps_per_row < 0 || p.warps_per_row > kWarps || (p.warps_per_row > 0 && kWarps % p.warps_per_row != 0)) {
    throw_runtime(str_cat("ops::linear (gemv): warps_per_row ", p.warps_per_row, " must divide ", kWarps, " (or 0)"));
  }
  if (p.norm.residual != nullptr && (relu2 || p.norm.threads < 1 || p.norm.threads > kThreads ||
                                     p.norm.threads * kGemvNormVecs * 8 < p.K || p.norm.a == nullptr ||
                                     p.norm.residual_out == nullptr || p.norm.weight == nullptr)) {
    throw_runtime(str_cat("ops::linear (gemv): the residual norm needs a, residual_out, weight and 1..", kThreads,
                          " threads covering K = ", p.K, " (", p.norm.threads, " threads", relu2 ? ", relu2" : "",
                          ")"));
  }
  int64_t rows = 0;
  for (int i = 0; i < p.n_parts && i < kGemvMaxParts; ++i) rows += p.parts[i].N;
  if (p.n_parts < 1 || p.n_parts > kGemvMaxParts || rows != p.N || rows >= (int64_t{1} << 31) / p.K) {
    throw_runtime(str_cat("ops::linear (gemv): ", p.n_parts, " parts with ", rows, " rows for N = ", p.N,
                          " (1..", kGemvMaxParts, " parts whose rows add up to N)"));
  }
  switch (dtype) {
    case DType::kBF16:
      return relu2 ? launch_t<__nv_bfloat16, true>(p, stream) : launch_t<__nv_bfloat16, false>(p, stream);
    case DType::kF16:
      return relu2 ? launch_t<__half, true>(p, stream) : launch_t<__half, false>(p, stream);
    default:
      throw_runtime(str_cat("ops::linear (gemv): dtype ", dtype_name(dtype), " is not supported (BF16, F16)"));
  }
}

}  // namespace chimera::cuda::gemm
