// Fused DeepSeek-V3 "noaux_tc" sigmoid router (docs/model.md 6.1) in one launch: sigmoid, + correction bias for
// selection only, optional group-limited masking, top-k on the biased scores (ties toward the lower expert
// index), gather of the unbiased scores, w / (sum + 1e-20) when norm_topk_prob, times routed_scaling_factor.
// Output sorted by descending biased score, exactly like the CPU reference (backends/cpu/moe.cpp).
//
// Two kernels, the same results bit for bit (choices and weights):
// - one block per token (n_group == 1, T <= 1024; described above router_topk_block_kernel below): latency
//   bound, the per-token work spread over E threads, selection by a radix select of barrier counts;
// - one warp per token (group-limited routing, and large T where throughput matters more than latency).
//
// Warp design (TensorRT-LLM's fused router, adapted): one warp per token, 4 tokens per 128-thread block. Each lane
// holds E/32 candidates (16 for the 512-expert Super router) as 64-bit keys: the biased score made
// integer-orderable (CUB's TwiddleIn) in the high word, 0xFFFF - expert in the low word, so a larger key is
// "higher score, then lower index". A lane sorts its candidates once (register bitonic network); each of the
// k rounds then takes the warp maximum with two 32-bit redux.sync.max (sm_80+; the value word, then the index
// word among the lanes that hold that value) and the winning lane shifts its sorted list by one. TensorRT-LLM's
// block-per-token layout (16 warps loading, 4 warps reducing 128 experts each, one warp merging 88
// candidates) needs two k-round phases on the critical path; one warp with 16 sorted candidates per lane
// needs one, and the whole block of 4 tokens stays in registers. E = 512 / k = 22 is its own template
// instance (fully unrolled rounds), as TensorRT-LLM specialises it.
//
// Bit-exactness with the CPU: the CPU computes 1 / (1 + std::exp(-x)) in float (glibc expf, < 0.51 ulp). CUDA's
// expf is up to 2 ulp off, which would break exact ties and near-ties; exp is therefore taken in double and
// rounded (the correctly rounded expf except for inputs within 2^-28 ulp of a rounding boundary), then the
// same IEEE add and divide (nvcc's default -prec-div=true).
#include <cooperative_groups.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <type_traits>
#include <utility>

#include "backends/cuda/cuda_common.cuh"
#include "backends/cuda/cuda_ops.h"
#include "backends/cuda/launch.cuh"
#include "backends/cuda/moe/experts.h"
#include "backends/cuda/moe/moe_kernels.h"
#include "backends/device_api.h"

namespace chimera::cuda {
namespace moe {
namespace {

namespace cg = cooperative_groups;

constexpr int kWarpsPerBlock = 4;
constexpr unsigned kFull = 0xffffffffu;

// v[s] = row[s * 32 + lane] as fp32 (0 past E). One dtype branch around the whole row, so that the sigmoid
// below exists once per slot: with the dtype switch inside each element load the compiler duplicated the
// sigmoid into every (logits dtype x bias dtype) path, a 9x larger kernel whose instruction fetches dominated
// the single-warp latency.
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
__device__ void mask_groups(const RouterParams& p, float (&choice)[NPER], float* s_choice, float* s_group,
                            int* s_keep, int lane) {
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

// One warp per token, kWarpsPerBlock tokens per block.
template <int NPER, int KFIX, bool kGroups>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) router_topk_kernel(const RouterParams p) {
  extern __shared__ float router_smem[];
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int t = static_cast<int>(blockIdx.x) * kWarpsPerBlock + warp;
  pdl_wait();  // PDL: the logits are the previous kernel's output
  pdl_trigger();
  if (t >= p.T) return;  // whole warps only
  route_token_warp<NPER, KFIX, kGroups>(p, t, lane, router_smem + warp * (p.E + 2 * p.n_group));
}

template <int NPER, int KFIX, bool kGroups>
void launch_router(const RouterParams& p, cudaStream_t stream) {
  const int blocks = ceil_div(p.T, kWarpsPerBlock);
  const size_t smem = kGroups ? sizeof(float) * kWarpsPerBlock * (p.E + 2 * p.n_group) : 0;
  launch(router_topk_kernel<NPER, KFIX, kGroups>, dim3(static_cast<unsigned>(blocks)), dim3(kWarpsPerBlock * 32), smem,
         stream, p);
  CHIMERA_LAUNCH_CHECK("ops::router_topk");
}

// Runtime E -> the experts-per-lane template argument NPER (1, 2, 4, 8 or 16: E <= 32 * NPER) of both routers'
// launchers: f(std::integral_constant<int, NPER>{}).
template <typename F>
void with_nper(int E, F&& f) {
  const int nper = (E + 31) / 32;
  if (nper <= 1) return f(std::integral_constant<int, 1>{});
  if (nper <= 2) return f(std::integral_constant<int, 2>{});
  if (nper <= 4) return f(std::integral_constant<int, 4>{});
  if (nper <= 8) return f(std::integral_constant<int, 8>{});
  return f(std::integral_constant<int, 16>{});
}

template <int NPER>
void launch_router_nper(const RouterParams& p, cudaStream_t stream) {
  if (p.n_group > 1) {
    launch_router<NPER, 0, true>(p, stream);
  } else {
    launch_router<NPER, 0, false>(p, stream);
  }
}

// ---- one block per token (n_group == 1) ------------------------------------------------------------------
// The warp kernel above runs ~4k dependent instructions per token in ONE warp (16 sigmoids, a 16-key sort,
// k arg-max rounds): at small T that single warp's latency is the whole kernel (E = 512 / k = 22 takes well over
// E = 128 / k = 6). Here a block of 32 * ceil(E / 32) threads
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
constexpr int kBlockMaxTokens = 1024;  // above: the warp kernel (throughput, not latency, bounds the call)

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

__global__ void __launch_bounds__(kBlockMaxThreads) router_topk_block_kernel(const RouterParams p) {
  pdl_wait();  // PDL: the logits are the previous kernel's output
  pdl_trigger();
  route_token_block(p, static_cast<int>(blockIdx.x));
}

void launch_router_block(const RouterParams& p, cudaStream_t stream) {
  const int threads = ceil_div(p.E, 32) * 32;
  launch(router_topk_block_kernel, dim3(static_cast<unsigned>(p.T)), dim3(static_cast<unsigned>(threads)), 0, stream,
         p);
  CHIMERA_LAUNCH_CHECK("ops::router_topk");
}

// ---- router gate + top-k in one launch (moe_kernels.h has the design) -----------------------------------------
constexpr int kGateThreads = kGateWarps * 32;
static_assert(kGateThreads == kBlockMaxThreads, "the block select needs one thread per expert, up to 512");
static_assert(kGateMaxTokens <= kGateWarps, "one selection warp per token");
constexpr int kTicketSlots = 64;
__device__ unsigned int g_gate_tickets[kTicketSlots];  // zero at module load; every launch leaves its word at zero

struct GateLaunch {
  GateTopkParams g;
  int ticket_slot;
  bool vec4;  // 16-byte gate loads: D % 4 == 0 and an aligned gate
};

// Phase 1 of warp `e`'s expert over columns [d0, d0 + len) of every token: the partial dot products, warp-reduced,
// stored to partial[split, t, e]. Lane l takes columns l*4 + 128 j (vec4) or l + 32 j: in the vec4 path the gate
// values first (all of them into registers: constant weights, no dependence on x), then x straight from global
// memory (L1: every warp of the block reads the same chunk), so the gate and x loads are in flight together and no
// shared-memory staging barrier sits on the chain. The fmaf order per lane (columns ascending) and the butterfly
// are the same as with the former shared-memory staging: bit-identical partials. Registers: 64 per thread (40 to
// 64 before), still two 512-thread blocks per SM, except the group-limited 512-expert instance (96: one per SM).
template <typename XT>
__device__ __forceinline__ void gate_partial(const GateLaunch& L, int split, int d0, int len, int e, int lane) {
  const GateTopkParams& g = L.g;
  const int T = g.route.T, E = g.route.E;
  const XT* x = static_cast<const XT*>(g.x);
  const float* w = g.gate + static_cast<int64_t>(e) * g.D + d0;
  float acc[kGateMaxTokens];
#pragma unroll
  for (int t = 0; t < kGateMaxTokens; ++t) acc[t] = 0.0f;
  if (L.vec4) {  // chunk and d0 are multiples of 4: 16-byte aligned gate rows
    constexpr int kSteps = kGateMaxChunk / 128;
    float4 wv[kSteps];
#pragma unroll
    for (int j = 0; j < kSteps; ++j) {
      const int d = lane * 4 + 128 * j;
      wv[j] = d < len ? __ldg(reinterpret_cast<const float4*>(w + d)) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
#pragma unroll
    for (int j = 0; j < kSteps; ++j) {
      const int d = lane * 4 + 128 * j;
      if (d < len) {
#pragma unroll
        for (int t = 0; t < kGateMaxTokens; ++t) {
          if (t < T) {
            const XT* xr = x + static_cast<int64_t>(t) * g.D + d0 + d;
            acc[t] = fmaf(wv[j].x, to_float<XT>(xr[0]), acc[t]);
            acc[t] = fmaf(wv[j].y, to_float<XT>(xr[1]), acc[t]);
            acc[t] = fmaf(wv[j].z, to_float<XT>(xr[2]), acc[t]);
            acc[t] = fmaf(wv[j].w, to_float<XT>(xr[3]), acc[t]);
          }
        }
      }
    }
  } else {  // D % 4 != 0 (no model shape): streamed, one column per lane and step
    for (int d = lane; d < len; d += 32) {
      const float wv = __ldg(w + d);
#pragma unroll
      for (int t = 0; t < kGateMaxTokens; ++t) {
        if (t < T) acc[t] = fmaf(wv, to_float<XT>(x[static_cast<int64_t>(t) * g.D + d0 + d]), acc[t]);
      }
    }
  }
#pragma unroll
  for (int t = 0; t < kGateMaxTokens; ++t) {
    if (t < T) {
      float v = acc[t];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
      if (lane == 0) g.partial[(static_cast<int64_t>(split) * T + t) * E + e] = v;
    }
  }
}

// Phase 2's selection, shared by both router_gate_topk kernels, over rp.logits [T][E] f32 already in shared memory.
// The block select for one token of a wide router only: at Nano's 128 experts one warp's select is short enough to
// beat the block's barriers at T = 1 too (moe_router_gate_nano); 512 experts keep the block select at T = 1. Otherwise
// warp t routes token t with scratch + t * (E + 2 n_group) floats (the group-limited warps' scratch). Whole block.
template <int NPER, bool kGroups>
__device__ __forceinline__ void select_tokens(const RouterParams& rp, int select, int warp, int lane, float* scratch) {
  const int T = rp.T, E = rp.E;
  const bool block_select = !kGroups && (select == 2 || (select == 0 && T == 1 && E > 256));
  if (block_select) {
    for (int t = 0; t < T; ++t) {
      route_token_block(rp, t);
      __syncthreads();
    }
  } else if (warp < T) {
    route_token_warp<NPER, 0, kGroups>(rp, warp, lane, scratch + warp * (E + 2 * rp.n_group));
  }
}

template <int NPER, bool kGroups>
__global__ void __launch_bounds__(kGateThreads) router_gate_topk_kernel(const GateLaunch L) {
  // Phase 2: logits [T][E], then (kGroups) each warp's E + 2 n_group floats.
  extern __shared__ float4 gate_smem4[];
  float* smem = reinterpret_cast<float*>(gate_smem4);
  __shared__ bool s_last;
  const GateTopkParams& g = L.g;
  const int T = g.route.T, E = g.route.E, chunk = g.split.chunk;
  const int split = static_cast<int>(blockIdx.x);
  const int d0 = split * chunk, len = min(chunk, g.D - d0);  // len > 0: n_split = ceil(D / chunk)
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int e = static_cast<int>(blockIdx.y) * kGateWarps + warp;

  // PDL prologue: pull this warp's slice of the (constant) gate row into L2 while the previous kernel drains;
  // x, the partials and the ticket word are step data, touched only after the wait.
  if (e < E) {
    for (int d = lane * kL2LineFloats; d < len; d += 32 * kL2LineFloats) {
      prefetch_l2(g.gate + static_cast<int64_t>(e) * g.D + d0 + d);
    }
  }
  pdl_wait();
  pdl_trigger();

  if (e < E) {
    if (g.x_dtype == DType::kBF16) {
      gate_partial<__nv_bfloat16>(L, split, d0, len, e, lane);
    } else if (g.x_dtype == DType::kF16) {
      gate_partial<__half>(L, split, d0, len, e, lane);
    } else {
      gate_partial<float>(L, split, d0, len, e, lane);
    }
  }

  // The last block to arrive routes. Writers fence before the ticket; atomicInc wraps the word back to zero.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned int n_blocks = gridDim.x * gridDim.y;
    s_last = atomicInc(&g_gate_tickets[L.ticket_slot], n_blocks - 1) == n_blocks - 1;
  }
  __syncthreads();
  if (!s_last) return;
  __threadfence();

  // Phase 2: logits = the partials summed in split order (L2 reads: other SMs wrote them).
  // Eight independent L2 loads in flight per step, added in split order (the same sums as one at a time).
  float* s_logits = smem;
  const int n_split = g.split.n_split;
  for (int i = static_cast<int>(threadIdx.x); i < T * E; i += kGateThreads) {
    const float* src = g.partial + i;
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
    s_logits[i] = v;
  }
  __syncthreads();
  RouterParams rp = g.route;
  rp.logits = s_logits;
  rp.logits_dtype = DType::kF32;
  select_tokens<NPER, kGroups>(rp, g.select, warp, lane, s_logits + T * E);
}

// Phase 2's logits (and the group-limited warps' scratch); phase 1 needs no shared memory.
size_t gate_smem_bytes(int T, int E, int n_group, int /*chunk*/) {
  size_t phase2 = sizeof(float) * static_cast<size_t>(T) * static_cast<size_t>(E);
  if (n_group > 1) phase2 += sizeof(float) * static_cast<size_t>(T) * static_cast<size_t>(E + 2 * n_group);
  return phase2;
}

template <int NPER, bool kGroups>
void launch_gate(const GateLaunch& L, cudaStream_t stream) {
  const size_t smem = gate_smem_bytes(L.g.route.T, L.g.route.E, L.g.route.n_group, L.g.split.chunk);
  if (smem > 48 * 1024) {
    set_max_dynamic_smem(router_gate_topk_kernel<NPER, kGroups>, smem, "ops::router_gate_topk");
  }
  const dim3 grid(static_cast<unsigned>(L.g.split.n_split), static_cast<unsigned>(ceil_div(L.g.route.E, kGateWarps)));
  launch(router_gate_topk_kernel<NPER, kGroups>, grid, dim3(kGateThreads), smem, stream, L);
  CHIMERA_LAUNCH_CHECK("ops::router_gate_topk");
}

template <int NPER>
void launch_gate_nper(const GateLaunch& L, cudaStream_t stream) {
  if (L.g.route.n_group > 1) {
    launch_gate<NPER, true>(L, stream);
  } else {
    launch_gate<NPER, false>(L, stream);
  }
}

int ticket_slot() {
  static std::atomic<int> next{0};
  thread_local const int slot = next.fetch_add(1) % kTicketSlots;
  return slot;
}

// ---- router gate + top-k in one cluster (small T; moe_kernels.h has the design) --------------------------------
constexpr int kClusterThreads = kGateThreads;  // 16 warps for the GEMV; also the block select's width (E <= 512)
constexpr int kClusterWarps = kClusterThreads / 32;
constexpr int kClusterSizes[] = {16, 8};  // preferred first; 16 is non-portable

struct ClusterLaunch {
  GateTopkParams g;
  int epc;        // experts (gate rows) per CTA
  int slices;     // column slices per row: the (row, slice) tasks spread over the 16 warps
  int slice_len;  // columns per slice (a multiple of 4)
  bool bulk;      // the gate slice by cp.async.bulk: D % 4 == 0 and a 16-byte aligned gate
  bool vec4;      // D % 4 == 0: 16-byte gate reads from shared memory
  bool x_vec;     // x copied in 16-byte pieces: T * D * sizeof(x) % 16 == 0 and a 16-byte aligned x
  // Byte offsets into the dynamic shared memory (each 16-byte aligned), the same in every CTA (DSMEM addresses):
  // gate [epc, D] f32 at 0, then x [T, D] x_dtype, partial dots [epc, slices, T] f32, logits [T, E] f32 (CTA 0's
  // are the cluster's), bias [E] f32 (CTA 0), the group-limited warps' scratch [T, E + 2 n_group] f32.
  unsigned off_x, off_part, off_logits, off_bias, off_scratch;
};

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
  // Make the initialised barrier visible to the async proxy (the bulk copy's complete_tx).
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
// Until the phase of parity `phase` has completed; traps after kMaxSpins try_waits (a byte count the copies never
// complete) so a test or a captured step fails with a launch error instead of hanging the device.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t phase) {
  constexpr uint32_t kMaxSpins = 1u << 26;
  uint32_t done = 0;
  for (uint32_t spins = 0; done == 0; ++spins) {
    if (spins == kMaxSpins) __trap();
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(phase)
        : "memory");
  }
}
// 1-D TMA bulk copy global -> this CTA's shared memory, completing `bytes` on `bar` (bytes % 16 == 0, both
// addresses 16-byte aligned).
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_u32(dst)),
               "l"(src), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
}

// Four consecutive x values (4-element aligned) from shared memory as fp32.
template <typename XT>
__device__ __forceinline__ float4 load_x4(const XT* p) {
  if constexpr (std::is_same_v<XT, float>) {
    return *reinterpret_cast<const float4*>(p);
  } else {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    XT v[4];
    static_assert(sizeof(v) == sizeof(u));
    memcpy(v, &u, sizeof(u));
    return make_float4(to_float<XT>(v[0]), to_float<XT>(v[1]), to_float<XT>(v[2]), to_float<XT>(v[3]));
  }
}

// Step 1 of the cluster kernel for this CTA's `rows` gate rows: x into shared memory, then the partial dot product
// of every (row, slice) task and token into s_part[(row * slices + slice) * T + t]. Per task: lane l takes columns
// slice * slice_len + l * 4 + 128 j (vec4) or + l + 32 j, columns ascending, then the butterfly: a fixed order.
template <typename XT>
__device__ __forceinline__ void cluster_dots(const ClusterLaunch& L, const float* s_gate, char* smem, float* s_part,
                                             int rows, uint64_t* gate_bar) {
  const GateTopkParams& g = L.g;
  const int T = g.route.T, D = g.D;
  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
  XT* s_x = reinterpret_cast<XT*>(smem + L.off_x);
  if (L.x_vec) {
    const int n = T * D * static_cast<int>(sizeof(XT)) / 16;
    const uint4* src = static_cast<const uint4*>(g.x);
    uint4* dst = reinterpret_cast<uint4*>(s_x);
    for (int i = tid; i < n; i += kClusterThreads) dst[i] = src[i];
  } else {
    const XT* src = static_cast<const XT*>(g.x);
    for (int i = tid; i < T * D; i += kClusterThreads) s_x[i] = src[i];
  }
  __syncthreads();
  if (L.bulk) mbar_wait(gate_bar, 0);  // the gate slice has landed (one phase: the barrier is used once)

  const int tasks = rows * L.slices;
  for (int task = warp; task < tasks; task += kClusterWarps) {
    const int r = task / L.slices, s = task % L.slices;
    const int c0 = s * L.slice_len, len = min(L.slice_len, D - c0);
    const float* w = s_gate + static_cast<int64_t>(r) * D + c0;
    float acc[kGateClusterMaxTokens];
#pragma unroll
    for (int t = 0; t < kGateClusterMaxTokens; ++t) acc[t] = 0.0f;
    if (L.vec4) {
      for (int d = lane * 4; d < len; d += 128) {
        const float4 wv = *reinterpret_cast<const float4*>(w + d);
#pragma unroll
        for (int t = 0; t < kGateClusterMaxTokens; ++t) {
          if (t < T) {
            const float4 xv = load_x4<XT>(s_x + static_cast<int64_t>(t) * D + c0 + d);
            acc[t] = fmaf(wv.x, xv.x, acc[t]);
            acc[t] = fmaf(wv.y, xv.y, acc[t]);
            acc[t] = fmaf(wv.z, xv.z, acc[t]);
            acc[t] = fmaf(wv.w, xv.w, acc[t]);
          }
        }
      }
    } else {
      for (int d = lane; d < len; d += 32) {
        const float wv = w[d];
#pragma unroll
        for (int t = 0; t < kGateClusterMaxTokens; ++t) {
          if (t < T) acc[t] = fmaf(wv, to_float<XT>(s_x[static_cast<int64_t>(t) * D + c0 + d]), acc[t]);
        }
      }
    }
#pragma unroll
    for (int t = 0; t < kGateClusterMaxTokens; ++t) {
      if (t < T) {
        float v = acc[t];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
        if (lane == 0) s_part[(r * L.slices + s) * T + t] = v;
      }
    }
  }
}

template <int NPER, bool kGroups>
__global__ void __launch_bounds__(kClusterThreads, 1) router_gate_cluster_kernel(const ClusterLaunch L) {
  extern __shared__ float4 cluster_smem4[];
  __shared__ uint64_t s_gate_bar;
  char* smem = reinterpret_cast<char*>(cluster_smem4);
  const cg::cluster_group cluster = cg::this_cluster();
  const GateTopkParams& g = L.g;
  const int T = g.route.T, E = g.route.E, D = g.D;
  const int rank = static_cast<int>(cluster.block_rank());
  const int e0 = rank * L.epc;
  const int rows = max(0, min(L.epc, E - e0));  // the last CTAs may own fewer rows, or none
  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
  float* s_gate = reinterpret_cast<float*>(smem);
  float* s_part = reinterpret_cast<float*>(smem + L.off_part);
  float* s_logits = reinterpret_cast<float*>(smem + L.off_logits);
  float* s_bias = reinterpret_cast<float*>(smem + L.off_bias);

  // Cluster barrier phase 1, arrive now, wait before the first remote store: CTA 0 has started (its shared memory
  // exists) before anyone writes into it. Off the critical path: every CTA arrives at its start.
  cluster_arrive_relaxed();

  // PDL prologue: constants only (the gate slice, CTA 0's bias). x is the previous kernel's output; no global write.
  const float* gate = g.gate + static_cast<int64_t>(e0) * D;
  if (rows > 0) {
    if (L.bulk) {
      if (tid == 0) {
        mbar_init(&s_gate_bar, 1);
        mbar_expect_tx(&s_gate_bar, static_cast<uint32_t>(rows) * static_cast<uint32_t>(D) * 4u);
        // One copy per gate row (each D * 4 bytes, a multiple of 16).
        for (int r = 0; r < rows; ++r) {
          bulk_g2s(s_gate + static_cast<int64_t>(r) * D, gate + static_cast<int64_t>(r) * D,
                   static_cast<uint32_t>(D) * 4u, &s_gate_bar);
        }
      }
    } else {
      for (int i = tid; i < rows * D; i += kClusterThreads) s_gate[i] = __ldg(gate + i);
    }
  }
  if (rank == 0 && tid < E) s_bias[tid] = load_elem(g.route.bias, g.route.bias_dtype, tid);
  pdl_wait();
  pdl_trigger();

  if (rows > 0) {  // (mbar_init is published by cluster_dots' __syncthreads before anyone waits on the barrier)
    if (g.x_dtype == DType::kBF16) {
      cluster_dots<__nv_bfloat16>(L, s_gate, smem, s_part, rows, &s_gate_bar);
    } else if (g.x_dtype == DType::kF16) {
      cluster_dots<__half>(L, s_gate, smem, s_part, rows, &s_gate_bar);
    } else {
      cluster_dots<float>(L, s_gate, smem, s_part, rows, &s_gate_bar);
    }
  }
  __syncthreads();  // s_part complete (and CTA 0's s_bias written)

  // Step 2: logits[t, e0 + r] = the row's slices summed in slice order, stored into CTA 0's shared memory.
  cluster_wait_acquire();  // phase 1
  if (tid < rows * T) {
    const int r = tid / T, t = tid % T;
    float v = 0.0f;
    for (int s = 0; s < L.slices; ++s) v += s_part[(r * L.slices + s) * T + t];
    *cluster.map_shared_rank(s_logits + t * E + e0 + r, 0u) = v;
  }
  // Phase 2: the release orders this CTA's remote stores before CTA 0's acquire. Only CTA 0's shared memory is read
  // across CTAs, so the others may leave right after arriving (the wait counts non-exited threads only).
  cluster_arrive_release();
  if (rank != 0) return;
  cluster_wait_acquire();

  // Step 3: CTA 0 routes, as router_gate_topk_kernel's phase 2.
  RouterParams rp = g.route;
  rp.logits = s_logits;
  rp.logits_dtype = DType::kF32;
  rp.bias = s_bias;
  rp.bias_dtype = DType::kF32;
  select_tokens<NPER, kGroups>(rp, g.select, warp, lane, reinterpret_cast<float*>(smem + L.off_scratch));
}

size_t align16(size_t n) { return (n + 15) / 16 * 16; }

// Fills the layout of L for cluster size cs; returns the dynamic shared memory bytes.
size_t cluster_layout(ClusterLaunch& L, int cs) {
  const GateTopkParams& g = L.g;
  const size_t T = static_cast<size_t>(g.route.T), E = static_cast<size_t>(g.route.E), D = static_cast<size_t>(g.D);
  L.epc = ceil_div(g.route.E, cs);
  L.slices = std::max(1, kClusterWarps / L.epc);
  L.slice_len = ceil_div(ceil_div(g.D, L.slices), 4) * 4;
  L.slices = ceil_div(g.D, L.slice_len);
  size_t off = align16(sizeof(float) * static_cast<size_t>(L.epc) * D);
  L.off_x = static_cast<unsigned>(off);
  off += align16(static_cast<size_t>(dtype_size(g.x_dtype)) * T * D);
  L.off_part = static_cast<unsigned>(off);
  off += align16(sizeof(float) * static_cast<size_t>(L.epc * L.slices) * T);
  L.off_logits = static_cast<unsigned>(off);
  off += align16(sizeof(float) * T * E);
  L.off_bias = static_cast<unsigned>(off);
  off += align16(sizeof(float) * E);
  L.off_scratch = static_cast<unsigned>(off);
  if (g.route.n_group > 1) off += align16(sizeof(float) * T * (E + 2 * static_cast<size_t>(g.route.n_group)));
  return off;
}

// Whether `cs` CTAs of this instance with `smem` bytes can be co-scheduled (cached per instance: the occupancy query
// is not free and its answer does not change within a process). The attributes are set once per instance, the
// dynamic shared memory limit to its maximum, so any launch up to kGateClusterMaxSmemBytes is allowed afterwards.
template <int NPER, bool kGroups>
bool cluster_fits(int cs, size_t smem) {
  static std::mutex mu;
  static std::map<std::pair<int, size_t>, bool> cache;
  static bool attrs_ok = false, attrs_set = false;
  const std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_pair(cs, smem);
  if (auto it = cache.find(key); it != cache.end()) return it->second;
  auto* kernel = router_gate_cluster_kernel<NPER, kGroups>;
  if (!attrs_set) {
    attrs_set = true;
    attrs_ok = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) == cudaSuccess &&
               cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(kGateClusterMaxSmemBytes)) == cudaSuccess;
  }
  const bool ok =
      attrs_ok && cluster_fits_once(kernel, static_cast<unsigned>(cs), static_cast<unsigned>(kClusterThreads), smem);
  (void)cudaGetLastError();  // a refused attribute is an answer, not a sticky error
  cache.emplace(key, ok);
  return ok;
}

template <int NPER, bool kGroups>
int launch_cluster_instance(ClusterLaunch L, cudaStream_t stream) {
  for (const int cs : kClusterSizes) {
    const size_t smem = cluster_layout(L, cs);
    if (smem > kGateClusterMaxSmemBytes || !cluster_fits<NPER, kGroups>(cs, smem)) continue;
    CHIMERA_CUDA_CHECK(launch_cluster(router_gate_cluster_kernel<NPER, kGroups>, dim3(static_cast<unsigned>(cs)),
                                      dim3(kClusterThreads), smem, stream, static_cast<unsigned>(cs), L),
                       "ops::router_gate_topk");
    return cs;
  }
  return 0;
}

// Which kernel the calling host thread's last ops::router_gate_topk used (tests).
thread_local int t_last_router_cluster = 0;

}  // namespace

void launch_router_topk(const RouterParams& p, cudaStream_t stream) {
  if (p.T == 0) return;
  if (p.E < 1 || p.E > 512 || p.k < 1 || p.k > 32 || p.k > p.E) {
    throw_runtime(str_cat("ops::router_topk: ", p.E, " experts / top-", p.k,
                          " is not supported on CUDA (supported: E <= 512, k <= min(32, E))"));
  }
  // One block per token where latency bounds the call (and for kernel == 2); the warp kernel otherwise.
  const bool block = p.n_group == 1 && (p.kernel == 2 || (p.kernel == 0 && p.T <= kBlockMaxTokens));
  if (block) return launch_router_block(p, stream);
  // The Nemotron 3 Super router: 512 experts, top-22, one group.
  if (p.E == 512 && p.k == 22 && p.n_group == 1) return launch_router<16, 22, false>(p, stream);
  with_nper(p.E, [&](auto nper) { launch_router_nper<decltype(nper)::value>(p, stream); });
}

GateSplit gate_topk_split(int E, int D) {
  const int expert_blocks = ceil_div(E, kGateWarps);
  int n_split = std::max(ceil_div(D, kGateMaxChunk), ceil_div(kGateTargetBlocks, expert_blocks));
  n_split = std::max(1, std::min(n_split, ceil_div(D, 32)));  // chunks of at least ~32 columns
  const int chunk = ceil_div(ceil_div(D, n_split), 4) * 4;
  return {ceil_div(D, chunk), chunk};
}

bool gate_topk_supported(int T, int E, int k, int n_group, int D) {
  if (T < 1 || T > kGateMaxTokens || E < 1 || E > 512 || k < 1 || k > 32 || k > E || D < 1) return false;
  return gate_smem_bytes(T, E, n_group, gate_topk_split(E, D).chunk) <= kGateMaxSmemBytes;
}

void launch_router_gate_topk(const GateTopkParams& p, cudaStream_t stream) {
  const RouterParams& r = p.route;
  if (!gate_topk_supported(r.T, r.E, r.k, r.n_group, p.D)) {
    throw_runtime(str_cat("ops::router_gate_topk: T = ", r.T, ", ", r.E, " experts / top-", r.k, ", ", r.n_group,
                          " groups, D = ", p.D, " is not supported by the fused kernel (supported: T <= ",
                          kGateMaxTokens, ", E <= 512, k <= min(32, E), shared memory <= ", kGateMaxSmemBytes, ")"));
  }
  GateLaunch L{p, ticket_slot(), p.D % 4 == 0 && reinterpret_cast<uintptr_t>(p.gate) % 16 == 0};
  with_nper(r.E, [&](auto nper) { launch_gate_nper<decltype(nper)::value>(L, stream); });
}

int launch_router_gate_cluster(const GateTopkParams& p, cudaStream_t stream) {
  const RouterParams& r = p.route;
  if (r.T < 1 || r.T > kGateClusterMaxTokens || !gate_topk_supported(r.T, r.E, r.k, r.n_group, p.D)) return 0;
  if (p.x_dtype != DType::kF32 && p.x_dtype != DType::kBF16 && p.x_dtype != DType::kF16) return 0;
  ClusterLaunch L{};
  L.g = p;
  L.vec4 = p.D % 4 == 0;
  L.bulk = L.vec4 && reinterpret_cast<uintptr_t>(p.gate) % 16 == 0;
  const int64_t x_bytes = static_cast<int64_t>(r.T) * p.D * static_cast<int64_t>(dtype_size(p.x_dtype));
  L.x_vec = x_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(p.x) % 16 == 0;
  int cs = 0;
  with_nper(r.E, [&](auto nper) {
    constexpr int kNper = decltype(nper)::value;
    cs = r.n_group > 1 ? launch_cluster_instance<kNper, true>(L, stream) : launch_cluster_instance<kNper, false>(L, stream);
  });
  return cs;
}

int router_gate_last_cluster() { return t_last_router_cluster; }

}  // namespace moe

void router_topk(const ops::Context& ctx, const Tensor& topk_ids, const Tensor& topk_weights, const Tensor& logits,
                 const Tensor& correction_bias, const ops::RouterParams& p) {
  if (topk_weights.dtype() != DType::kF32) {
    throw_runtime(str_cat("ops::router_topk: topk_weights ", topk_weights.describe(), " must be F32 on CUDA"));
  }
  moe::RouterParams k{};
  k.logits = logits.data();
  k.bias = correction_bias.data();
  k.topk_ids = topk_ids.data_as<int32_t>();
  k.topk_weights = topk_weights.data_as<float>();
  k.T = static_cast<int>(logits.dim(0));
  k.E = static_cast<int>(logits.dim(1));
  k.k = static_cast<int>(p.top_k);
  k.n_group = static_cast<int>(p.n_group);
  k.topk_group = static_cast<int>(p.topk_group);
  k.norm_topk_prob = p.norm_topk_prob;
  k.routed_scaling_factor = p.routed_scaling_factor;
  k.logits_dtype = logits.dtype();
  k.bias_dtype = correction_bias.dtype();
  moe::launch_router_topk(k, as_stream(ctx.stream));
}

// Decode sizes: one kernel, the cluster kernel where it applies (launch_router_gate_cluster: T <= 4 and a gate
// slice that fits a CTA's shared memory, e.g. Nano; not Super's 8 MiB gate), else the split-K kernel with its
// ticket. Otherwise (and for a 16-bit gate) the three ops it replaces: x -> fp32, cuBLASLt fp32 logits, router_topk.
void router_gate_topk(const ops::Context& ctx, const Tensor& topk_ids, const Tensor& topk_weights, const Tensor& x,
                      const Tensor& gate, const Tensor& correction_bias, const ops::RouterParams& p) {
  const char* op = "ops::router_gate_topk";
  if (topk_weights.dtype() != DType::kF32) {
    throw_runtime(str_cat(op, ": topk_weights ", topk_weights.describe(), " must be F32 on CUDA"));
  }
  const int64_t T = x.dim(0), E = gate.dim(0), D = x.dim(1);
  if (T == 0) return;
  const bool fused = gate.dtype() == DType::kF32 && D <= 0x7fffffffLL &&
                     moe::gate_topk_supported(static_cast<int>(T), static_cast<int>(E), static_cast<int>(p.top_k),
                                              static_cast<int>(p.n_group), static_cast<int>(D));
  moe::t_last_router_cluster = 0;
  if (!fused) {
    Tensor x_f32 = x;
    if (x.dtype() != DType::kF32) {
      x_f32 = device::empty(Device::kCuda, DType::kF32, x.shape());
      cuda::convert(ctx, x_f32, x);
    }
    const Tensor logits = device::empty(Device::kCuda, DType::kF32, {T, E});
    cuda::linear(ctx, logits, x_f32, gate, Tensor());
    cuda::router_topk(ctx, topk_ids, topk_weights, logits, correction_bias, p);
    return;
  }
  moe::GateTopkParams g{};
  g.route.bias = correction_bias.data();
  g.route.bias_dtype = correction_bias.dtype();
  g.route.topk_ids = topk_ids.data_as<int32_t>();
  g.route.topk_weights = topk_weights.data_as<float>();
  g.route.T = static_cast<int>(T);
  g.route.E = static_cast<int>(E);
  g.route.k = static_cast<int>(p.top_k);
  g.route.n_group = static_cast<int>(p.n_group);
  g.route.topk_group = static_cast<int>(p.topk_group);
  g.route.norm_topk_prob = p.norm_topk_prob;
  g.route.routed_scaling_factor = p.routed_scaling_factor;
  g.route.logits_dtype = DType::kF32;
  g.x = x.data();
  g.x_dtype = x.dtype();
  g.gate = gate.data_as<float>();
  g.D = static_cast<int>(D);
  const cudaStream_t stream = as_stream(ctx.stream);
  // Decode (T <= 4) with a gate slice that fits a cluster CTA (Nano): the cluster kernel, no workspace.
  if (ctx.kernels.router_cluster) {
    moe::t_last_router_cluster = moe::launch_router_gate_cluster(g, stream);
    if (moe::t_last_router_cluster > 0) return;
  }
  g.split = moe::gate_topk_split(g.route.E, g.D);
  const Tensor partial = device::empty(Device::kCuda, DType::kF32, {g.split.n_split, T, E});
  g.partial = partial.data_as<float>();
  moe::launch_router_gate_topk(g, stream);
}

}  // namespace chimera::cuda
