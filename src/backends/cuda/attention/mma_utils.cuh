// What the attention prefill and decode kernels share beyond the tensor-core wrappers of mma_sync.cuh
// (cp.async, ldmatrix, mma.sync m16n8k16, pack2): the swizzled shared-memory layout of [rows, HD] tiles, the
// gather of K / V tiles from the paged cache and the quad reductions of the online softmax.
// Two adjacent C tiles (n 0..15) converted to 16-bit pairs are exactly one A fragment over k 0..15: the
// softmax probabilities P go from the S accumulators straight into P @ V without shared memory.
#pragma once

#include <cstdint>

#include "backends/cuda/attention/attention_kernels.cuh"
#include "backends/cuda/mma_sync.cuh"

namespace chimera::cuda::attn {

// Element offset of 16-byte chunk `chunk` of row `row` in a [rows, HD] 16-bit tile. The chunk index is
// XORed with the row's low 3 bits, so the 8 rows one ldmatrix phase reads fall in 8 different bank groups
// (rows are 128 or 256 bytes: unswizzled they would all hit the same banks).
template <int HD>
__device__ __forceinline__ int swz(int row, int chunk) {
  return row * HD + ((chunk ^ (row & 7)) << 3);
}

// cp.async of keys / values at positions [first, first + kRows) of kv head kvh of one sequence (block table row
// `table`) from the paged cache into stage `buf` of the swizzled [stages][kRows, HD] tiles sK, sV; positions >= end
// are zero-filled. The calling thread copies 16-byte chunk my_ch of tile rows my_r0 + i * kRowsPerPass (kThreads
// threads, HD / 8 chunks a row). kc, vc: p.k_cache, p.v_cache as T; kv_heads: p.num_kv_heads (by value: read
// through p here, it renumbered the decode kernel's PTX registers). The caller commits.
// kNewRow (the decode kernel's folded append), new_pos >= 0: the row of position new_pos (< end) is taken from this
// step's k / v row of kv head kvh, p.k_new / p.v_new + new_off ([HD], not yet in the cache), instead of the cache.
// A template flag: the run-time test alone costs the prefill kernel 4 registers.
template <typename T, int HD, int kRows, int kThreads, bool kNewRow = false>
__device__ __forceinline__ void load_kv_tile(T* sK, T* sV, int buf, const T* kc, const T* vc, const AttentionParams& p,
                                             int kv_heads, const int32_t* table, int kvh, int first, int end,
                                             int my_r0, int my_ch, int new_pos = -1, int64_t new_off = 0) {
  constexpr int kRowsPerPass = kThreads / (HD / 8);
#pragma unroll
  for (int i = 0; i < kRows / kRowsPerPass; ++i) {
    const int r = my_r0 + i * kRowsPerPass, pos = first + r;
    const bool ok = pos < end;
    const T* ks = kc;
    const T* vs = vc;
    if (kNewRow && pos == new_pos) {
      ks = static_cast<const T*>(p.k_new) + new_off + my_ch * 8;
      vs = static_cast<const T*>(p.v_new) + new_off + my_ch * 8;
    } else if (ok) {
      const int blk = table[pos / p.block_size];
      const int64_t off =
          ((static_cast<int64_t>(blk) * p.block_size + pos % p.block_size) * kv_heads + kvh) * HD + my_ch * 8;
      ks = kc + off;
      vs = vc + off;
    }
    cp_async_16(sK + buf * kRows * HD + swz<HD>(r, my_ch), ks, ok);
    cp_async_16(sV + buf * kRows * HD + swz<HD>(r, my_ch), vs, ok);
  }
}

// Quad (4 lanes sharing one accumulator row) reductions.
__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// One online-softmax step (flash attention) for accumulator row half h (0: row g, 1: row g + 8 of the warp's
// 16-row tile), given this thread's max over its NT score pairs of that row: the row max over the quad, the new
// running max m_run, P = exp2(S - m_run) in place in s, the running sum l_run, and O rescaled by
// exp2(m_old - m_new). Scores are already scaled by softmax_scale * log2(e) and masked to -inf.
template <int NT, int HD>
__device__ __forceinline__ void online_softmax_step(float (&s)[NT][4], float (&o)[HD / 8][4], float& m_run,
                                                    float& l_run, int h, float thread_max) {
  const float m_new = fmaxf(m_run, quad_max(thread_max));
  const float alpha = exp2f(m_run - m_new);
  m_run = m_new;
  float sum = 0.0f;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    s[nt][2 * h] = exp2f(s[nt][2 * h] - m_new);
    s[nt][2 * h + 1] = exp2f(s[nt][2 * h + 1] - m_new);
    sum += s[nt][2 * h] + s[nt][2 * h + 1];
  }
  l_run = l_run * alpha + sum;
#pragma unroll
  for (int i = 0; i < HD / 8; ++i) {
    o[i][2 * h] *= alpha;
    o[i][2 * h + 1] *= alpha;
  }
}

}  // namespace chimera::cuda::attn
