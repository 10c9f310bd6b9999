// The decode chain's residual step (residual + a (+ round(a + b)), then RMSNorm) recomputed inside the kernel that
// consumes its output, instead of a launch of its own (ops::residual_norm_linear's GEMV, ops::router_gate_topk with
// a step, the MoE up GEMV's early shared-expert units): every block computes the normed rows it needs.
//
// Bit-identity with the norm kernel (row_norm.cuh, NormMode::kAdd / kAdd2): thread i < args.threads holds the
// row's 8-element vectors i + k * args.threads (k < kResidualRowVecs), exactly the vectors the norm kernel's thread
// i holds at its default layout (default_vecs_per_thread = 2, threads_per_row), and rounds them the same way; the
// sum of squares then goes through a full-warp butterfly and a butterfly over the block's warp partials. The norm
// kernel's shorter butterflies (fewer threads per row) see the same non-zero terms in the same order: every extra
// term here is an exact zero. So x and the new residual are the same bits as the norm kernel's outputs.
#pragma once

#include "backends/cuda/cuda_common.cuh"
#include "backends/cuda/cuda_vec.cuh"
#include "backends/cuda/norm/residual_row.h"

namespace chimera::cuda::norm {

// 8 fp32 values rounded to T and packed as one 16-byte vector.
template <typename T>
__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
  uint4 v;
  store_f32<T, 8>(reinterpret_cast<T*>(&v), f);
  return v;
}

// This thread's vectors of the norm weight (a constant: may be loaded before pdl_wait()).
__device__ __forceinline__ void residual_row_weight(const ResidualRowArgs& n, int K,
                                                    uint4 (&nw)[kResidualRowVecs]) {
  const int tid = static_cast<int>(threadIdx.x), kv = K / 8;
#pragma unroll
  for (int k = 0; k < kResidualRowVecs; ++k) {
    const int i = tid + k * n.threads;
    nw[k] = tid < n.threads && i < kv ? __ldg(static_cast<const uint4*>(n.weight) + i) : make_uint4(0, 0, 0, 0);
  }
}

// Rows [0, T) of x = weight * rms_norm(residual + a (+ round(a + b))) into xs[t * K / 8 + i] (16-byte vectors;
// shared or global memory). write_residual: the new residual to n.residual_out; kXOut: x also to x_out (global)
// unless it is null.
// T_rows <= kMaxRows (a compile-time bound: ptxas allocates the one-token case better). Every thread of the block
// (kThreads, a multiple of 32, >= n.threads) must call it; ends with a barrier.
template <typename T, int kThreads, bool kXOut, int kMaxRows>
__device__ __forceinline__ void residual_rows(const ResidualRowArgs& n, int T_rows, int K,
                                              const uint4 (&nw)[kResidualRowVecs], uint4* xs, bool write_residual,
                                              uint4* x_out) {
  constexpr int kWarps = kThreads / 32;
  static_assert(kThreads % 32 == 0 && kWarps <= 32, "whole warps, at most 32");
  __shared__ float red[kWarps];
  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
  const int kv = K / 8;
#pragma unroll 1  // one token at a time (registers)
  for (int t = 0; t < kMaxRows; ++t) {
    if (t >= T_rows) break;
    const size_t row = static_cast<size_t>(t) * static_cast<size_t>(kv);
    uint4 rv[kResidualRowVecs] = {}, av[kResidualRowVecs] = {}, bv[kResidualRowVecs] = {};
#pragma unroll
    for (int k = 0; k < kResidualRowVecs; ++k) {
      const int i = tid + k * n.threads;
      if (tid < n.threads && i < kv) {
        rv[k] = static_cast<const uint4*>(n.residual)[row + i];
        av[k] = static_cast<const uint4*>(n.a)[row + i];
        if (n.b != nullptr) bv[k] = static_cast<const uint4*>(n.b)[row + i];
      }
    }
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < kResidualRowVecs; ++k) {
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
    const float inv = 1.0f / sqrtf(total / static_cast<float>(K) + n.eps);
#pragma unroll
    for (int k = 0; k < kResidualRowVecs; ++k) {
      const int i = tid + k * n.threads;
      if (tid < n.threads && i < kv) {
        float v[8], w[8], o[8];
        unpack8<T>(rv[k], v);
        unpack8<T>(nw[k], w);
#pragma unroll
        for (int j = 0; j < 8; ++j) o[j] = w[j] * (v[j] * inv);
        const uint4 xo = pack8<T>(o);
        xs[row + i] = xo;
        if constexpr (kXOut) {
          if (x_out != nullptr) x_out[row + i] = xo;
        }
        if (write_residual) static_cast<uint4*>(n.residual_out)[row + i] = rv[k];
      }
    }
    __syncthreads();  // red is reused by the next token; xs is complete
  }
}

}  // namespace chimera::cuda::norm
