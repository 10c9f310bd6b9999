// The portable attention pieces: the paged KV-cache append, and a simple attention kernel for any head_dim
// and dtype (the F32 path; the BF16 / F16 fallback for head dims the tensor-core kernels do not cover).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cmath>
#include <type_traits>

#include "backends/cuda/attention/attention_kernels.cuh"
#include "backends/cuda/cuda_common.cuh"
#include "backends/cuda/launch.cuh"

namespace chimera::cuda::attn {
namespace {

// The sequence owning query row t: the last sequence whose q_start <= t (idle sequences, n_new == 0,
// share their q_start with the next one, so the last such index is the one with rows).
__device__ __forceinline__ int find_seq(const AttentionParams& p, int t) {
  int lo = 0, hi = p.num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (load_q_start(p, mid) <= t) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// Element offset of (position pos, kv head kvh) in a cache [num_blocks, block_size, KVh, hd].
__device__ __forceinline__ int64_t cache_offset(const AttentionParams& p, int seq, int pos, int kvh) {
  const int blk = p.block_tables[static_cast<int64_t>(seq) * p.max_blocks + pos / p.block_size];
  const int64_t row = static_cast<int64_t>(blk) * p.block_size + pos % p.block_size;
  return (row * p.num_kv_heads + kvh) * p.head_dim;
}

// ---- append -------------------------------------------------------------------------------------
// One warp per token row: copies its KVh * hd keys and values into the cache, in units of V (16, 4 or
// 2 bytes, the widest that divides the row).
template <typename V>
__global__ void append_kv_kernel(AttentionParams p, int elem_bytes) {
  const int t = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  pdl_wait();  // PDL: k / v are step data; the cache rows may still be read by the previous step
  pdl_trigger();
  if (t >= p.num_tokens) return;
  const int s = find_seq(p, t);
  const AttnSeq sq = load_seq(p, s);
  const int pos = sq.ctx_len + (t - sq.q_start);
  const int blk = p.block_tables[static_cast<int64_t>(s) * p.max_blocks + pos / p.block_size];
  const int64_t row = static_cast<int64_t>(blk) * p.block_size + pos % p.block_size;
  const int row_units = p.num_kv_heads * p.head_dim * elem_bytes / static_cast<int>(sizeof(V));
  const V* ks = static_cast<const V*>(p.k_new) + static_cast<int64_t>(t) * row_units;
  const V* vs = static_cast<const V*>(p.v_new) + static_cast<int64_t>(t) * row_units;
  V* kd = static_cast<V*>(p.k_cache) + row * row_units;
  V* vd = static_cast<V*>(p.v_cache) + row * row_units;
  for (int i = lane; i < row_units; i += 32) {
    kd[i] = ks[i];
    vd[i] = vs[i];
  }
}

// ---- FP8 E4M3 cache -------------------------------------------------------------------------------
__device__ __forceinline__ uint8_t e4m3_of(float x) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
}

// One warp per token row, element by element: e4m3(k / k_scale), e4m3(v / v_scale).
template <typename T>
__global__ void append_kv_fp8_kernel(AttentionParams p) {
  const int t = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  pdl_wait();  // PDL: as append_kv_kernel
  pdl_trigger();
  if (t >= p.num_tokens) return;
  const int s = find_seq(p, t);
  const AttnSeq sq = load_seq(p, s);
  const int pos = sq.ctx_len + (t - sq.q_start);
  const int blk = p.block_tables[static_cast<int64_t>(s) * p.max_blocks + pos / p.block_size];
  const int64_t row = static_cast<int64_t>(blk) * p.block_size + pos % p.block_size;
  const int n = p.num_kv_heads * p.head_dim;
  const T* ks = static_cast<const T*>(p.k_new) + static_cast<int64_t>(t) * n;
  const T* vs = static_cast<const T*>(p.v_new) + static_cast<int64_t>(t) * n;
  uint8_t* kd = static_cast<uint8_t*>(p.k_cache) + row * n;
  uint8_t* vd = static_cast<uint8_t*>(p.v_cache) + row * n;
  for (int i = lane; i < n; i += 32) {
    kd[i] = e4m3_of(to_float(ks[i]) / p.k_scale);
    vd[i] = e4m3_of(to_float(vs[i]) / p.v_scale);
  }
}

// A cache element as fp32: C is the activation type (the value itself) or uint8_t (an E4M3 byte times scale).
template <typename C>
__device__ __forceinline__ float cache_value(const C* c, int64_t i, float scale) {
  if constexpr (std::is_same_v<C, uint8_t>) {
    __nv_fp8_e4m3 v;
    v.__x = c[i];
    return static_cast<float>(v) * scale;
  } else {
    (void)scale;
    return to_float(c[i]);
  }
}

// ---- generic attention ----------------------------------------------------------------------------
// One warp per (query row, q head); lane l holds elements d = l + 32 j (j < VPL) of q and of the output
// accumulator. Keys stream four at a time: four partial dot products, one interleaved warp reduction,
// then one online-softmax update (fp32, exp2 with the scale folded into q).
// C: the cache element (T, or uint8_t for an FP8 cache, cache_value above).
template <typename T, typename C, int VPL>
__global__ void __launch_bounds__(128) attention_generic_kernel(AttentionParams p) {
  const int64_t wid = static_cast<int64_t>(blockIdx.x) * 4 + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  pdl_wait();  // PDL: q and the cache are earlier kernels' outputs
  pdl_trigger();
  if (wid >= static_cast<int64_t>(p.num_tokens) * p.num_q_heads) return;
  const int t = static_cast<int>(wid / p.num_q_heads), head = static_cast<int>(wid % p.num_q_heads);
  const int kvh = head / (p.num_q_heads / p.num_kv_heads);
  const int hd = p.head_dim;
  const int s = find_seq(p, t);
  const AttnSeq sq = load_seq(p, s);
  const int last = sq.ctx_len + (t - sq.q_start);  // attends to positions [0, last]

  const T* qr = static_cast<const T*>(p.q) + wid * hd;
  const C* kc = static_cast<const C*>(p.k_cache);
  const C* vc = static_cast<const C*>(p.v_cache);
  float qv[VPL], acc[VPL];
#pragma unroll
  for (int j = 0; j < VPL; ++j) {
    const int d = lane + 32 * j;
    qv[j] = d < hd ? to_float(qr[d]) * p.scale_log2 : 0.0f;
    acc[j] = 0.0f;
  }
  float m = -INFINITY, l = 0.0f;
  for (int u0 = 0; u0 <= last; u0 += 4) {
    float sc[4];
    int64_t off[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int u = u0 + i;
      off[i] = u <= last ? cache_offset(p, s, u, kvh) : -1;
      float dot = 0.0f;
      if (off[i] >= 0) {
#pragma unroll
        for (int j = 0; j < VPL; ++j) {
          const int d = lane + 32 * j;
          if (d < hd) dot += qv[j] * cache_value(kc, off[i] + d, p.k_scale);
        }
      }
      sc[i] = dot;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
      for (int i = 0; i < 4; ++i) sc[i] += __shfl_xor_sync(0xffffffffu, sc[i], o);
    }
    float mx = m;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (off[i] < 0) sc[i] = -INFINITY;
      mx = fmaxf(mx, sc[i]);
    }
    const float alpha = exp2f(m - mx);  // m = -inf on the first step: 0; mx is finite (key u0 is valid)
    float pr[4], psum = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      pr[i] = exp2f(sc[i] - mx);
      psum += pr[i];
    }
    l = l * alpha + psum;
    m = mx;
#pragma unroll
    for (int j = 0; j < VPL; ++j) {
      const int d = lane + 32 * j;
      float a = acc[j] * alpha;
      if (d < hd) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          if (off[i] >= 0) a += pr[i] * cache_value(vc, off[i] + d, p.v_scale);
        }
      }
      acc[j] = a;
    }
  }
  const float inv = 1.0f / l;
  T* orow = static_cast<T*>(p.out) + wid * hd;
#pragma unroll
  for (int j = 0; j < VPL; ++j) {
    const int d = lane + 32 * j;
    if (d < hd) orow[d] = from_float<T>(acc[j] * inv);
  }
}

}  // namespace

template <typename T>
void launch_append_kv(const AttentionParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return;
  const int elem = static_cast<int>(sizeof(T));
  const int row_bytes = p.num_kv_heads * p.head_dim * elem;
  const dim3 block(256), grid(ceil_div(p.num_tokens, 8));
  // Rows start at multiples of row_bytes from their bases: the widest unit dividing row_bytes and every
  // base address is aligned everywhere.
  uintptr_t bases = reinterpret_cast<uintptr_t>(p.k_new) | reinterpret_cast<uintptr_t>(p.v_new) |
                    reinterpret_cast<uintptr_t>(p.k_cache) | reinterpret_cast<uintptr_t>(p.v_cache);
  bases |= static_cast<uintptr_t>(row_bytes);
  if (bases % 16 == 0) {
    launch(append_kv_kernel<uint4>, grid, block, 0, stream, p, elem);
  } else if (bases % 4 == 0) {
    launch(append_kv_kernel<uint32_t>, grid, block, 0, stream, p, elem);
  } else {
    launch(append_kv_kernel<uint16_t>, grid, block, 0, stream, p, elem);
  }
  CHIMERA_LAUNCH_CHECK("ops::attention (append_kv)");
}

template <typename T, typename C>
void launch_generic(const AttentionParams& p, cudaStream_t stream) {
  const int64_t warps = static_cast<int64_t>(p.num_tokens) * p.num_q_heads;
  if (warps == 0) return;
  const dim3 block(128), grid(ceil_div(warps, 4));
  if (p.head_dim <= 32) {
    launch(attention_generic_kernel<T, C, 1>, grid, block, 0, stream, p);
  } else if (p.head_dim <= 64) {
    launch(attention_generic_kernel<T, C, 2>, grid, block, 0, stream, p);
  } else if (p.head_dim <= 128) {
    launch(attention_generic_kernel<T, C, 4>, grid, block, 0, stream, p);
  } else if (p.head_dim <= 256) {
    launch(attention_generic_kernel<T, C, 8>, grid, block, 0, stream, p);
  } else {
    throw_runtime(str_cat("ops::attention: head_dim ", p.head_dim, " is not supported on CUDA (at most 256)"));
  }
  CHIMERA_LAUNCH_CHECK("ops::attention (generic)");
}

template <typename T>
void launch_attention_generic(const AttentionParams& p, cudaStream_t stream) {
  launch_generic<T, T>(p, stream);
}

template <typename T>
void launch_attention_generic_fp8(const AttentionParams& p, cudaStream_t stream) {
  launch_generic<T, uint8_t>(p, stream);
}

template <typename T>
void launch_append_kv_fp8(const AttentionParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0) return;
  launch(append_kv_fp8_kernel<T>, dim3(ceil_div(p.num_tokens, 8)), dim3(256), 0, stream, p);
  CHIMERA_LAUNCH_CHECK("ops::attention (append_kv fp8)");
}

template void launch_append_kv<float>(const AttentionParams&, cudaStream_t);
template void launch_append_kv<__nv_bfloat16>(const AttentionParams&, cudaStream_t);
template void launch_append_kv<__half>(const AttentionParams&, cudaStream_t);
template void launch_attention_generic<float>(const AttentionParams&, cudaStream_t);
template void launch_attention_generic<__nv_bfloat16>(const AttentionParams&, cudaStream_t);
template void launch_attention_generic<__half>(const AttentionParams&, cudaStream_t);
template void launch_append_kv_fp8<float>(const AttentionParams&, cudaStream_t);
template void launch_append_kv_fp8<__nv_bfloat16>(const AttentionParams&, cudaStream_t);
template void launch_append_kv_fp8<__half>(const AttentionParams&, cudaStream_t);
template void launch_attention_generic_fp8<float>(const AttentionParams&, cudaStream_t);
template void launch_attention_generic_fp8<__nv_bfloat16>(const AttentionParams&, cudaStream_t);
template void launch_attention_generic_fp8<__half>(const AttentionParams&, cudaStream_t);

}  // namespace chimera::cuda::attn
