// The RMSNorm family as one row-normalisation kernel (docs/model.md 2.2 and 3.3):
//   kPlain: out = w * x * rsqrt(mean(x^2) + eps)
//   kAdd:   residual += x (stored in the activation dtype), out = rms_norm(residual as stored); ONE pass:
//           x and residual are read once, residual and out written once, the row held in fp32 registers.
//   kAdd2:  kAdd with x = round(x + z): the MoE layer's shared and routed outputs (x, z) summed and rounded to
//           the activation dtype first, then added to the residual and rounded again, the exact roundings of
//           add() followed by kAdd (bit-identical), without the round trip of the sum through memory.
//   kGated: u = y * silu(z) (gate first, norm_before_gate = false), then RMSNorm of each group of
//           D / n_groups channels: a "row" here is one (token, group) pair, weight row = group.
// Rounding: fp32 math in registers and one rounding at each store (vLLM / TRT-LLM fused kernels). HF rounds
// the normalised value to bf16 before the weight multiply; the difference is within a bf16 ulp.
//
// Layout: a row is row_len contiguous elements; blockDim.x threads share a row (a power of two <= 32 with
// blockDim.y rows per block, or a multiple of 32 with one row per block); each thread holds up to kVecs
// groups of N elements (16-byte accesses when N = 16 / sizeof(T)). kVecs == 0: rows too long for the register
// cache: the second pass re-reads (L2-resident) inputs instead.
#pragma once

#include <algorithm>

#include "backends/cuda/cuda_common.cuh"
#include "backends/cuda/cuda_vec.cuh"
#include "backends/cuda/launch.cuh"

namespace chimera::cuda::norm {

enum class NormMode { kPlain, kAdd, kAdd2, kGated };

inline constexpr int kMaxThreads = 1024;  // threads per block (one long row)

struct RowNormParams {
  void* out;           // [rows, row_len] T
  const void* x;       // [rows, row_len] T: x (kPlain, kAdd) or y (kGated)
  const void* z;       // [rows, row_len] T: the gate (kGated) or the second addend (kAdd2), else null
  void* residual;      // [rows, row_len] T, updated in place (kAdd, kAdd2), else null
  const void* weight;  // [weight_rows, row_len] W; row r uses weight row r % weight_rows
  int64_t rows;
  int row_len;
  int weight_rows;  // 1, or n_groups (kGated)
  float eps;
  // kAdd, kAdd2: where the new residual goes; null: in place. Must not overlap residual, x or z otherwise
  // (ops::residual_norm_linear's residual ping-pong).
  void* residual_out = nullptr;
};

__device__ __forceinline__ void* residual_dst(const RowNormParams& p) {
  return p.residual_out != nullptr ? p.residual_out : p.residual;
}

__device__ __forceinline__ float silu_f32(float v) {
  return v / (1.0f + expf(-v));
}

// Sum over the blockDim.x threads of one row; every thread of the block must call it.
__device__ __forceinline__ float row_sum(float v) {
  if (blockDim.x <= 32) {
    for (int off = static_cast<int>(blockDim.x) / 2; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
  }
  __shared__ float partial[32];
  __shared__ float total;
  for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const int n_warps = static_cast<int>(blockDim.x) / 32;
    float s = lane < n_warps ? partial[lane] : 0.0f;
    for (int off = 16; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffffu, s, off);
    if (lane == 0) total = s;
  }
  __syncthreads();
  return total;
}

// The pre-norm value of elements [e, e + N) of a row: x (kPlain), residual + x rounded to T and written back
// (kAdd, when `first`; afterwards re-read from residual), y * silu(z) (kGated).
template <NormMode kMode, typename T, int N>
__device__ __forceinline__ void row_value(const RowNormParams& p, size_t e, bool first, float (&v)[N]) {
  if constexpr (kMode == NormMode::kPlain) {
    load_f32<T, N>(static_cast<const T*>(p.x) + e, v);
  } else if constexpr (kMode == NormMode::kAdd || kMode == NormMode::kAdd2) {
    T* res = static_cast<T*>(residual_dst(p)) + e;
    load_f32<T, N, false>(first ? static_cast<const T*>(p.residual) + e : res, v);
    if (first) {
      float xv[N];
      load_f32<T, N>(static_cast<const T*>(p.x) + e, xv);
      if constexpr (kMode == NormMode::kAdd2) {
        float zv[N];
        load_f32<T, N>(static_cast<const T*>(p.z) + e, zv);
#pragma unroll
        for (int j = 0; j < N; ++j) xv[j] = round_to<T>(xv[j] + zv[j]);
      }
#pragma unroll
      for (int j = 0; j < N; ++j) v[j] = round_to<T>(v[j] + xv[j]);
      store_f32<T, N>(res, v);
    }
  } else {
    float zv[N];
    load_f32<T, N>(static_cast<const T*>(p.x) + e, v);
    load_f32<T, N>(static_cast<const T*>(p.z) + e, zv);
#pragma unroll
    for (int j = 0; j < N; ++j) v[j] *= silu_f32(zv[j]);
  }
}

template <typename T, typename W, int N>
__device__ __forceinline__ void row_store(const RowNormParams& p, size_t e, size_t w_off, float inv,
                                          const float (&v)[N]) {
  float w[N], o[N];
  load_f32<W, N>(static_cast<const W*>(p.weight) + w_off, w);
#pragma unroll
  for (int j = 0; j < N; ++j) o[j] = w[j] * (v[j] * inv);
  store_f32<T, N>(static_cast<T*>(p.out) + e, o);
}

// The register-cached path in two halves, so that every load of a thread's slice of the row is in flight
// before the first store or dependent use: ptxas does not move a load above a store to the same array
// (residual), so the one-step row_value above serialised a DRAM round trip per vector group (seen in the PTX:
// the second group's loads after the first group's residual store). The loaded groups stay packed in the
// storage dtype until used (4 registers per 16-byte group instead of 8 floats: 37 registers for bf16 rows of
// 2 groups per thread, as before, instead of 61 with float staging, which cost a third of the occupancy).
template <typename U, int N>
struct RawVec {
  static constexpr int kBytes = N * static_cast<int>(sizeof(U));
  static constexpr int kChunkBytes = detail::chunk_bytes(kBytes);
  using C = typename detail::Chunk<kChunkBytes>::type;
  C c[kBytes / kChunkBytes];
};

template <typename U, int N, bool kReadOnly = true>
__device__ __forceinline__ void load_raw(const U* p, RawVec<U, N>& r) {
  using C = typename RawVec<U, N>::C;
  const C* src = reinterpret_cast<const C*>(p);
#pragma unroll
  for (int c = 0; c < RawVec<U, N>::kBytes / RawVec<U, N>::kChunkBytes; ++c) {
    if constexpr (kReadOnly) {
      r.c[c] = __ldg(src + c);
    } else {
      r.c[c] = src[c];
    }
  }
}

template <typename U, int N>
__device__ __forceinline__ void raw_to_f32(const RawVec<U, N>& r, float (&v)[N]) {
  alignas(16) U tmp[N];
  memcpy(tmp, r.c, sizeof(tmp));
#pragma unroll
  for (int j = 0; j < N; ++j) v[j] = to_float<U>(tmp[j]);
}

// row_load: a = x (kPlain) / residual (kAdd, kAdd2) / y (kGated); b = x (kAdd, kAdd2) / z (kGated);
// c = z (kAdd2 only).
template <NormMode kMode, typename T, int N>
__device__ __forceinline__ void row_load(const RowNormParams& p, size_t e, RawVec<T, N>& a, RawVec<T, N>& b,
                                         RawVec<T, N>& c) {
  if constexpr (kMode == NormMode::kPlain) {
    load_raw<T, N>(static_cast<const T*>(p.x) + e, a);
  } else if constexpr (kMode == NormMode::kAdd || kMode == NormMode::kAdd2) {
    load_raw<T, N, false>(static_cast<const T*>(p.residual) + e, a);
    load_raw<T, N>(static_cast<const T*>(p.x) + e, b);
    if constexpr (kMode == NormMode::kAdd2) load_raw<T, N>(static_cast<const T*>(p.z) + e, c);
  } else {
    load_raw<T, N>(static_cast<const T*>(p.x) + e, a);
    load_raw<T, N>(static_cast<const T*>(p.z) + e, b);
  }
}

template <typename U, int N>
__device__ __forceinline__ void f32_to_raw(const float (&v)[N], RawVec<U, N>& r) {
  alignas(16) U tmp[N];
#pragma unroll
  for (int j = 0; j < N; ++j) tmp[j] = from_float<U>(v[j]);
  memcpy(r.c, tmp, sizeof(tmp));
}

template <typename U, int N>
__device__ __forceinline__ void store_raw(U* p, const RawVec<U, N>& r) {
  using C = typename RawVec<U, N>::C;
  C* dst = reinterpret_cast<C*>(p);
#pragma unroll
  for (int c = 0; c < RawVec<U, N>::kBytes / RawVec<U, N>::kChunkBytes; ++c) dst[c] = r.c[c];
}

// row_combine: the pre-norm value v, as row_value with first = true. kAdd rounds residual + x to T, keeps it
// packed in a (the value is exactly representable, so a holds it until the output pass) and writes the
// residual (kAdd2: x = round(x + z) first); kPlain's value is a itself; kGated's is not representable in T (the
// caller keeps v).
template <NormMode kMode, typename T, int N>
__device__ __forceinline__ void row_combine(const RowNormParams& p, size_t e, RawVec<T, N>& a,
                                            const RawVec<T, N>& b, const RawVec<T, N>& c, float (&v)[N]) {
  raw_to_f32<T, N>(a, v);
  if constexpr (kMode == NormMode::kAdd || kMode == NormMode::kAdd2) {
    float xv[N];
    raw_to_f32<T, N>(b, xv);
    if constexpr (kMode == NormMode::kAdd2) {
      float zv[N];
      raw_to_f32<T, N>(c, zv);
#pragma unroll
      for (int j = 0; j < N; ++j) xv[j] = round_to<T>(xv[j] + zv[j]);
    }
#pragma unroll
    for (int j = 0; j < N; ++j) v[j] += xv[j];
    f32_to_raw<T, N>(v, a);
    raw_to_f32<T, N>(a, v);
    store_raw<T, N>(static_cast<T*>(residual_dst(p)) + e, a);
  } else if constexpr (kMode == NormMode::kGated) {
    float zv[N];
    raw_to_f32<T, N>(b, zv);
#pragma unroll
    for (int j = 0; j < N; ++j) v[j] *= silu_f32(zv[j]);
  }
}

template <NormMode kMode, typename T, typename W, int N, int kVecs>
__global__ void __launch_bounds__(kMaxThreads) row_norm_kernel(const RowNormParams p) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool active = row < p.rows;
  const int n_vec = p.row_len / N;
  const size_t base = static_cast<size_t>(active ? row : 0) * static_cast<size_t>(p.row_len);
  const size_t w_base = static_cast<size_t>(active ? row % p.weight_rows : 0) * static_cast<size_t>(p.row_len);
  // PDL: x, z and residual are the previous kernels' outputs, and residual/out may still be read by them. The
  // weight (constant) is only needed after the reduction, where it is an L2 hit, so nothing is hoisted above.
  pdl_wait();
  pdl_trigger();
  float ss = 0.0f;
  if constexpr (kVecs > 0) {
    // All loads first (activations, then the L2-resident weights, which are not needed until after the
    // reduction but would otherwise be a dependent round trip behind it), then the combine, the residual
    // stores and the sum of squares.
    RawVec<T, N> ra[kVecs], rb[kVecs], rc[kVecs];  // rc: kAdd2's second addend (unused, so dropped, otherwise)
    RawVec<W, N> rw[kVecs];
    constexpr bool kKeepF32 = kMode == NormMode::kGated;  // else ra holds the pre-norm value exactly
    float gv[kKeepF32 ? kVecs : 1][N];
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int i = static_cast<int>(threadIdx.x) + k * static_cast<int>(blockDim.x);
      if (active && i < n_vec) row_load<kMode, T, N>(p, base + static_cast<size_t>(i) * N, ra[k], rb[k], rc[k]);
    }
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int i = static_cast<int>(threadIdx.x) + k * static_cast<int>(blockDim.x);
      if (active && i < n_vec) {
        float v[N];
        row_combine<kMode, T, N>(p, base + static_cast<size_t>(i) * N, ra[k], rb[k], rc[k], v);
#pragma unroll
        for (int j = 0; j < N; ++j) ss += v[j] * v[j];
        if constexpr (kKeepF32) {
#pragma unroll
          for (int j = 0; j < N; ++j) gv[k][j] = v[j];
        }
      }
    }
    const float inv = 1.0f / sqrtf(row_sum(ss) / static_cast<float>(p.row_len) + p.eps);
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int i = static_cast<int>(threadIdx.x) + k * static_cast<int>(blockDim.x);
      if (active && i < n_vec) {
        load_raw<W, N>(static_cast<const W*>(p.weight) + w_base + static_cast<size_t>(i) * N, rw[k]);
      }
    }
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int i = static_cast<int>(threadIdx.x) + k * static_cast<int>(blockDim.x);
      if (active && i < n_vec) {
        float v[N], w[N], o[N];
        if constexpr (kKeepF32) {
#pragma unroll
          for (int j = 0; j < N; ++j) v[j] = gv[k][j];
        } else {
          raw_to_f32<T, N>(ra[k], v);
        }
        raw_to_f32<W, N>(rw[k], w);
#pragma unroll
        for (int j = 0; j < N; ++j) o[j] = w[j] * (v[j] * inv);
        store_f32<T, N>(static_cast<T*>(p.out) + base + static_cast<size_t>(i) * N, o);
      }
    }
  } else {
    for (int i = static_cast<int>(threadIdx.x); active && i < n_vec; i += static_cast<int>(blockDim.x)) {
      float v[N];
      row_value<kMode, T, N>(p, base + static_cast<size_t>(i) * N, true, v);
#pragma unroll
      for (int j = 0; j < N; ++j) ss += v[j] * v[j];
    }
    const float inv = 1.0f / sqrtf(row_sum(ss) / static_cast<float>(p.row_len) + p.eps);
    // Each thread re-reads only the elements it wrote itself (kAdd), so no barrier is needed.
    for (int i = static_cast<int>(threadIdx.x); active && i < n_vec; i += static_cast<int>(blockDim.x)) {
      float v[N];
      row_value<kMode, T, N>(p, base + static_cast<size_t>(i) * N, false, v);
      row_store<T, W, N>(p, base + static_cast<size_t>(i) * N, w_base + static_cast<size_t>(i) * N, inv, v);
    }
  }
}

inline constexpr int kSmallRowBlock = 128;  // threads per block when several rows share a block

// Vector groups per thread for a row of n_vec groups when the caller does not choose (launch_row_norm_n).
inline int default_vecs_per_thread(int n_vec) { return n_vec <= 2 * kMaxThreads ? 2 : 4; }

// Threads per row for n_vec vector groups held `vecs` per thread: a power of two up to a warp, else a
// multiple of 32 (0: too long for the register cache).
inline int threads_per_row(int n_vec, int vecs) {
  const int need = std::max(1, ceil_div(n_vec, vecs));
  if (need <= 32) {
    int t = 1;
    while (t < need) t *= 2;
    return t;
  }
  const int t = ceil_div(need, 32) * 32;
  return t <= kMaxThreads ? t : 0;
}

template <NormMode kMode, typename T, typename W, int N, int kVecs>
void launch_cached(const RowNormParams& p, int tpr, cudaStream_t stream) {
  const int rpb = tpr <= 32 ? kSmallRowBlock / tpr : 1;
  const dim3 block(static_cast<unsigned>(tpr), static_cast<unsigned>(rpb));
  launch(row_norm_kernel<kMode, T, W, N, kVecs>, dim3(static_cast<unsigned>(ceil_div(p.rows, rpb))), block, 0, stream,
         p);
}

// vecs_per_thread: 2 or 4 vector groups cached per thread, 0 = automatic. Two (twice the threads per row,
// half the registers) is the default for rows of up to 2048 groups (hidden 16384 in bf16): full occupancy
// and more, shorter blocks, which keeps the last wave of a mid-sized batch from running a third empty.
// Single-element accesses (odd sizes) always cache four.
template <NormMode kMode, typename T, typename W, int N>
void launch_row_norm_n(const RowNormParams& p, int vecs_per_thread, cudaStream_t stream, const char* op) {
  const int n_vec = p.row_len / N;
  int vecs = vecs_per_thread != 0 ? vecs_per_thread : default_vecs_per_thread(n_vec);
  if (N == 1 || (vecs != 2 && vecs != 4)) vecs = 4;
  const int tpr = threads_per_row(n_vec, vecs);
  if (tpr == 0) {
    launch(row_norm_kernel<kMode, T, W, N, 0>, dim3(static_cast<unsigned>(p.rows)), dim3(kMaxThreads), 0, stream, p);
  } else if constexpr (N > 1) {
    if (vecs == 2) {
      launch_cached<kMode, T, W, N, 2>(p, tpr, stream);
    } else {
      launch_cached<kMode, T, W, N, 4>(p, tpr, stream);
    }
  } else {
    launch_cached<kMode, T, W, N, 4>(p, tpr, stream);
  }
  CHIMERA_LAUNCH_CHECK(op);
}

// Picks the element and weight types and the vector width (16-byte accesses when the row length and every
// pointer allow them, else one element per access).
template <NormMode kMode>
void launch_row_norm(const RowNormParams& p, DType act, DType weight, cudaStream_t stream, const char* op,
                     int vecs_per_thread) {
  if (p.rows == 0 || p.row_len == 0) return;
  if (p.rows > 0x7fffffffLL) throw_runtime(str_cat(op, ": ", p.rows, " rows exceed one launch"));
  const bool aligned = vec_aligned({p.out, p.x, p.z, p.residual, p.weight, p.residual_out});
  CHIMERA_DISPATCH_FLOAT(act, str_cat(op, " activations"), T, {
    CHIMERA_DISPATCH_FLOAT(weight, str_cat(op, " weight"), W, {
      constexpr int kN = vec_width<T>();
      if (aligned && p.row_len % kN == 0) {
        launch_row_norm_n<kMode, T, W, kN>(p, vecs_per_thread, stream, op);
      } else {
        launch_row_norm_n<kMode, T, W, 1>(p, vecs_per_thread, stream, op);
      }
    });
  });
}

// Explicit instances live in rms_norm.cu, add_rms_norm.cu, add2_rms_norm.cu and gated_rms_norm.cu so the build
// parallelises.
// vecs_per_thread (0: automatic) is exposed for the benchmarks.
void launch_rms_norm(const RowNormParams& p, DType act, DType weight, cudaStream_t stream, int vecs_per_thread = 0);
void launch_add_rms_norm(const RowNormParams& p, DType act, DType weight, cudaStream_t stream, int vecs_per_thread = 0);
void launch_add2_rms_norm(const RowNormParams& p, DType act, DType weight, cudaStream_t stream,
                          int vecs_per_thread = 0);
void launch_gated_rms_norm(const RowNormParams& p, DType act, DType weight, cudaStream_t stream,
                           int vecs_per_thread = 0);

}  // namespace chimera::cuda::norm
