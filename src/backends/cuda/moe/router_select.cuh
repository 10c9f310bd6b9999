// The router's selection device code (model-spec 6.1; design in router.cu's header comment), shared by router.cu's
// kernels and the MoE up GEMV (grouped_gemv.cu), which routes decode tokens itself from the fused router's column
// partials (GemvFold::partial): one copy of the code, so the two give the same choices and weights bit for bit.
// Included by .cu files only.
#pragma once

#include <cstdint>

#include "backends/cuda/cuda_common.cuh"
#include "backends/cuda/moe/moe_kernels.h"

namespace chimera::cuda::moe::route {

constexpr unsigned kFull = 0xffffffffu;

// v[s] = row[s * 32 + lane] as fp32 (0 past E). One dtype branch around the whole row, so that the sigmoid
// below exists once per slot: with the dtype switch inside each element load the compiler duplicated the
// sigmoid into every (logits dtype x bias dtype) path, a 9x larger kernel whose instruction fetches dominated
// the single-warp latency (first H200 run: 17.6 us at E=512 / T=1 against 9.5 us at E=128).
template <int NPER>
__device__ __forceinline__ void load_row(const void* base, DType dt, int64_t offset, int lane, int E,
                                         float (&v)[NPER]) {
  if (dt == DType::kBF16) {
    const auto* q = static_cast<const __nv_bfloat16*>(base) + offset;
#pragma unroll
    for (int s = 0; s < NPER; ++s) v[s] = s * 32 + lane < E ? __bfloat162float(q[s * 32 + lane]) : 0.0f;
  } else if (dt == DType::kF16) {
    const auto* q = static_cast<const __half*>(base) + offset;
#pragma unroll
    for (int s = 0; s < NPER; ++s) v[s] = s * 32 + lane < E ? __half2float(q[s * 32 + lane]) : 0.0f;
  } else {
    const auto* q = static_cast<const float*>(base) + offset;
#pragma unroll
    for (int s = 0; s < NPER; ++s) v[s] = s * 32 + lane < E ? q[s * 32 + lane] : 0.0f;
  }
}

// 1 / (1 + exp(-x)) with exp correctly rounded to float (see the header comment).
__device__ __forceinline__ float sigmoid_ref(float x) {
  const float e = static_cast<float>(exp(-static_cast<double>(x)));
  return 1.0f / (1.0f + e);
}

// Float -> unsigned with the same order (CUB TwiddleIn); -0.0 is folded onto +0.0 because the CPU's float
// comparison treats them as equal (the tie then goes to the lower index, as the index word decides).
__device__ __forceinline__ uint32_t orderable(float v) {
  if (v == 0.0f) v = 0.0f;
  const uint32_t u = __float_as_uint(v);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ uint64_t make_key(float v, int e) {
  return (static_cast<uint64_t>(orderable(v)) << 32) | static_cast<uint32_t>(0xFFFF - e);
}

// Descending bitonic sort of N (a power of two) register keys; all indices are compile-time constants.
template <int N>
__device__ __forceinline__ void sort_desc(uint64_t (&key)[N]) {
#pragma unroll
  for (int size = 2; size <= N; size <<= 1) {
#pragma unroll
    for (int stride = size / 2; stride > 0; stride >>= 1) {
#pragma unroll
      for (int i = 0; i < N; ++i) {
        const int j = i ^ stride;
        if (j > i) {
          const bool desc = (i & size) == 0;
          const uint64_t a = key[i], b = key[j];
          const bool swap = desc ? a < b : a > b;
          key[i] = swap ? b : a;
          key[j] = swap ? a : b;
        }
      }
    }
  }
}

// Group-limited routing (HF: group score = sum of the top-2 biased scores of a group; keep the topk_group best
// groups, ties toward the lower group; mask the rest to -inf). Slow path: the warp's biased scores go through
// shared memory, one lane per group. smem: [E] scores, [n_group] group scores, [n_group] keep flags.
template <int NPER>
__device__ void mask_groups(const RouterParams& p, float (&choice)[NPER], float* s_choice, float* s_group, int* s_keep,
                            int lane) {
  const float kNegInf = -__int_as_float(0x7f800000);
  const int per_group = p.E / p.n_group;
#pragma unroll
  for (int s = 0; s < NPER; ++s) {
    const int e = s * 32 + lane;
    if (e < p.E) s_choice[e] = choice[s];
  }
  __syncwarp();
  for (int g = lane; g < p.n_group; g += 32) {
    float a = kNegInf, b = kNegInf;
    for (int e = g * per_group; e < (g + 1) * per_group; ++e) {
      const float c = s_choice[e];
      if (c > a) {
        b = a;
        a = c;
      } else if (c > b) {
        b = c;
      }
    }
    s_group[g] = per_group >= 2 ? a + b : a;
  }
  __syncwarp();
  for (int g = lane; g < p.n_group; g += 32) {
    const float mine = s_group[g];
    int rank = 0;
    for (int o = 0; o < p.n_group; ++o) {
      const float other = s_group[o];
      rank += (other > mine || (other == mine && o < g)) ? 1 : 0;
    }
    s_keep[g] = rank < p.topk_group ? 1 : 0;
  }
  __syncwarp();
#pragma unroll
  for (int s = 0; s < NPER; ++s) {
    const int e = s * 32 + lane;
    if (e < p.E && !s_keep[e / per_group]) choice[s] = kNegInf;
  }
}

// Routes token t with one warp (whole warps only; no block-wide barrier inside). NPER: candidates per lane
// (E <= 32 * NPER, a power of two); KFIX: the compile-time k (0 = runtime p.k); kGroups: the group-limited slow
// path, with `smem` this warp's E + 2 * n_group floats. Also the selection of the fused router_gate_topk kernel.
template <int NPER, int KFIX, bool kGroups>
__device__ __forceinline__ void route_token_warp(const RouterParams& p, int t, int lane, float* smem) {
  const int k = KFIX > 0 ? KFIX : p.k;
  const int64_t row = static_cast<int64_t>(t) * p.E;

  // Step 1: load, sigmoid, + bias (the bias only affects selection). Lane l holds experts s * 32 + l.
  float choice[NPER], bias[NPER];
  load_row<NPER>(p.logits, p.logits_dtype, row, lane, p.E, choice);
  load_row<NPER>(p.bias, p.bias_dtype, 0, lane, p.E, bias);
#pragma unroll
  for (int s = 0; s < NPER; ++s) choice[s] = s * 32 + lane < p.E ? sigmoid_ref(choice[s]) + bias[s] : 0.0f;
  if constexpr (kGroups) {
    float* s_choice = smem;
    float* s_group = s_choice + p.E;
    int* s_keep = reinterpret_cast<int*>(s_group + p.n_group);
    mask_groups<NPER>(p, choice, s_choice, s_group, s_keep, lane);
  }

  // Step 2: per-lane sorted keys; padding keys are 0, below every real key (even a masked -inf one).
  uint64_t key[NPER];
#pragma unroll
  for (int s = 0; s < NPER; ++s) {
    const int e = s * 32 + lane;
    key[s] = e < p.E ? make_key(choice[s], e) : 0ull;
  }
  sort_desc<NPER>(key);

  // Step 3: k rounds of warp arg-max; lane r keeps the r-th winner.
  int my_expert = -1;
#pragma unroll(KFIX > 0 ? KFIX : 1)
  for (int r = 0; r < k; ++r) {
    const uint32_t hi = static_cast<uint32_t>(key[0] >> 32), lo = static_cast<uint32_t>(key[0]);
    const uint32_t vmax = __reduce_max_sync(kFull, hi);
    const uint32_t lmax = __reduce_max_sync(kFull, hi == vmax ? lo : 0u);
    if (lane == r) my_expert = 0xFFFF - static_cast<int>(lmax);
    if (hi == vmax && lo == lmax) {
#pragma unroll
      for (int s = 0; s + 1 < NPER; ++s) key[s] = key[s + 1];
      key[NPER - 1] = 0ull;
    }
  }

  // Step 4: unbiased scores of the winners, normalise, scale, one coalesced store per output row.
  const float logit = lane < k ? load_elem(p.logits, p.logits_dtype, row + my_expert) : 0.0f;
  const float score = lane < k ? sigmoid_ref(logit) : 0.0f;
  float sum = score;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(kFull, sum, o);
  if (lane < k) {
    const float w = p.norm_topk_prob ? score / (sum + 1e-20f) : score;
    p.topk_ids[static_cast<int64_t>(t) * k + lane] = my_expert;
    p.topk_weights[static_cast<int64_t>(t) * k + lane] = w * p.routed_scaling_factor;
  }
}

// ---- one block per token (n_group == 1) ------------------------------------------------------------------
// The warp kernel above runs ~4k dependent instructions per token in ONE warp (16 sigmoids, a 16-key sort,
// k arg-max rounds): at small T that single warp's latency is the whole kernel (E=512/k=22: 12.5 us per
// call against 7.6 us for E=128/k=6 on the first H200 runs). Here a block of 32 * ceil(E / 32) threads
// takes one token, thread e = expert e, so the per-thread work is one load pair, one sigmoid and a short
// selection loop whose steps cost one barrier each:
//   1. choice = sigmoid(logit) + bias as an orderable u32 (`orderable`, the CPU's float order).
//   2. Radix select of the k-th largest u, most significant bit first: each step counts the experts at or
//      above a candidate prefix with one __syncthreads_count (bar.red.popc) and stops early when exactly k
//      are (usually after ~15-20 of the 32 bits for random scores).
//   3. Exact ties at the cut go to the lower expert index: the same select over q = 511 - e among the tied
//      experts (at most 9 more steps, only when ties reach the cut).
//   4. The k winners append (key, score) to shared memory; warp 0 ranks each by counting larger keys (keys are
//      unique: the index is in the low word), so the output is sorted by (score desc, index asc) as on the CPU,
//      and finishes exactly as the warp kernel (same lane order of the normalising sum: identical weights).
constexpr int kBlockMaxThreads = 512;

// Routes token t with the whole (1-D) block: thread e = expert e, E <= blockDim.x <= kBlockMaxThreads. Every
// thread of the block must call it (barriers); it returns with warp 0 possibly still storing, so a caller that
// routes another token next puts a __syncthreads() in between.
__device__ __forceinline__ void route_token_block(const RouterParams& p, int t) {
  __shared__ uint64_t s_key[32];  // winners' keys, in arrival order
  __shared__ float s_score[32];   // their unbiased scores
  __shared__ float s_rank_score[32];
  __shared__ int s_rank_id[32];
  __shared__ int s_count;
  const int e = static_cast<int>(threadIdx.x);
  const int k = p.k;
  const bool valid = e < p.E;
  float score = 0.0f, choice = 0.0f;
  if (valid) {
    const float logit = load_elem(p.logits, p.logits_dtype, static_cast<int64_t>(t) * p.E + e);
    const float bias = load_elem(p.bias, p.bias_dtype, e);
    score = sigmoid_ref(logit);
    choice = score + bias;
  }
  if (e == 0) s_count = 0;  // published by the first barrier of the select loop
  const uint32_t u = orderable(choice);

  // Step 2. Invariant: the k-th largest u is in [lo, lo + 2^(b+1)); `above` = #{u >= lo + 2^(b+1)}.
  uint32_t lo = 0;
  int above = 0;
  bool exact = false;
  for (int b = 31; b >= 0; --b) {
    const uint32_t c = lo | (1u << b);
    const int n = __syncthreads_count(valid && u >= c);
    if (n >= k) {
      lo = c;
      if (n == k) {
        exact = true;
        break;
      }
    } else {
      above = n;
    }
  }
  bool win = valid && u >= lo;
  if (!exact) {
    // Step 3. lo is the k-th largest score itself; `above` experts score higher, so the need = k - above
    // lowest-index experts among those equal to lo win. q is unique, so this select always ends exact.
    const int need = k - above;
    const bool tie = valid && u == lo;
    const uint32_t q = static_cast<uint32_t>(kBlockMaxThreads - 1 - e);
    uint32_t qlo = 0;
    for (int b = 8; b >= 0; --b) {
      const uint32_t c = qlo | (1u << b);
      const int n = __syncthreads_count(tie && q >= c);
      if (n >= need) {
        qlo = c;
        if (n == need) break;
      }
    }
    win = valid && (u > lo || (tie && q >= qlo));
  }

  // Step 4. Exactly k winners.
  if (win) {
    const int slot = atomicAdd(&s_count, 1);
    s_key[slot] = (static_cast<uint64_t>(u) << 32) | static_cast<uint32_t>(0xFFFF - e);
    s_score[slot] = score;
  }
  __syncthreads();
  if (e >= 32) return;
  const int lane = e;
  const uint64_t mine = lane < k ? s_key[lane] : 0ull;
  int rank = 0;
  for (int j = 0; j < k; ++j) rank += s_key[j] > mine ? 1 : 0;
  if (lane < k) {
    s_rank_score[rank] = s_score[lane];
    s_rank_id[rank] = 0xFFFF - static_cast<int>(static_cast<uint32_t>(mine));
  }
  __syncwarp();
  const float sc = lane < k ? s_rank_score[lane] : 0.0f;
  float sum = sc;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(kFull, sum, o);
  if (lane < k) {
    const float w = p.norm_topk_prob ? sc / (sum + 1e-20f) : sc;
    p.topk_ids[static_cast<int64_t>(t) * k + lane] = s_rank_id[lane];
    p.topk_weights[static_cast<int64_t>(t) * k + lane] = w * p.routed_scaling_factor;
  }
}

// The fused router's phase 2 input: logits[i] = sum over s of partial[s][i] for i < T * E (partial: [n_split][T][E]
// fp32, written by another grid), added in split order, eight independent L2 loads in flight per step (the same
// sums as one at a time). Thread `tid` of `nthreads` takes i = tid, tid + nthreads, ...
__device__ __forceinline__ void sum_gate_partials(const float* partial, int n_split, int T, int E, float* logits,
                                                  int tid, int nthreads) {
  for (int i = tid; i < T * E; i += nthreads) {
    const float* src = partial + i;
    const int64_t stride = static_cast<int64_t>(T) * E;
    float v = 0.0f;
    int s = 0;
    for (; s + 8 <= n_split; s += 8) {
      float q[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) q[j] = __ldcg(src + (s + j) * stride);
#pragma unroll
      for (int j = 0; j < 8; ++j) v += q[j];
    }
    for (; s < n_split; ++s) v += __ldcg(src + s * stride);
    logits[i] = v;
  }
}

}  // namespace chimera::cuda::moe::route
