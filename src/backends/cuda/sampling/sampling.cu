// Token sampling on the GPU, the same function as the CPU reference (backends/cpu/sampling.cpp):
// penalties, then greedy argmax (the first maximum, as std::max_element: ties -> lowest id, a NaN wins only at
// id 0), or temperature / min_p / top-k / top-p / inverse-CDF sampling in descending logit order (ties: lower id
// first) with the counter-based uniform of core/counter_rng.h; log-probabilities of the raw logits and a
// non-finite flag per row.
//
// Penalties: when a row has any, the op copies the logits and penalty_kernel rewrites, in the copy, the logit of
// each distinct token of the row's PenaltyToken list (one thread per token: no two threads touch one logit),
// with the reference's fp32 operations in its order (explicit _rn intrinsics: no contraction into an FMA).
// The sampler then reads the copy; logprobs and the non-finite flag read the raw logits.
//
// min_p: exp((l - max) / T) >= min_p is monotone in the logit, so it is a key threshold (the least key that
// passes, one block reduction); top-k, top-p and the sample then only look at keys at or above it.
//
// Logprobs: log-sum-exp of the raw row in double (its maximum, then one pass); the top-K raw tokens are K
// block-wide argmax passes, each over the elements ranked after the previous pick (K <= 20, only when asked).
//
// No sort. Each step of the reference is "the first element of the sorted order at which a running total
// reaches a target", so each is a radix select over the order-preserving 32-bit key of the logit, 8 bits per
// pass, with per-warp histograms of counts (and of softmax mass) per digit:
//   top-k:  the k-th element by count                        -> Z_k = mass of the first k (one more pass)
//   top-p:  the first element where the mass reaches top_p * Z_k -> Z_c = mass of the nucleus
//   sample: the first element where the mass exceeds u * Z_c      -> its id
// After top-k only elements at or above the k-th key take part. Elements with equal logits form a tie
// group ordered by id with equal masses, so the crossing inside a group is arithmetic, and only the final
// sample needs an id (a block scan in id order).
// Mass: e = exp((l - max) / T) in double as in the reference, held as 40-bit fixed point (e <= 1) and
// summed in 64-bit integers: sums are exact and independent of order (deterministic), so a draw can differ
// from the reference's only when u falls within ~1e-12 of a boundary. Lanes of a warp that hit one digit
// combine (match_any + reduce) before a single leader updates the warp's histogram: no atomic contention.
//
// One block of kThreads per row; greedy rows take one pass over the row, sampled rows about 14.
//
// Greedy with few rows (a decode step at batch 1..64, every row greedy): one block per row would leave one SM
// reading the whole 512 KB row (V = 131072). greedy_split_kernel instead cuts each row
// into up to 128 chunks of >= 1024 logits, one block each; a block folds its chunk into one 64-bit key
// (order-preserving logit in the high word, ~id in the low word, so the maximum key is "largest logit, then
// lowest id") and atomicMax-es it into the row's word; the last block of the grid (ticket) turns the words
// into ids and resets them, so the scratch is zero again for the next launch or graph replay.
#include <algorithm>
#include <atomic>
#include <cmath>

#include "backends/cuda/cuda_common.cuh"
#include "backends/device_api.h"
#include "backends/cuda/cuda_ops.h"
#include "backends/cuda/launch.cuh"
#include "core/counter_rng.h"

namespace chimera::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kBuckets = 256;
constexpr int kRowsScratchSlot = 1;
constexpr int kPenaltyScratchSlot = 2;
constexpr double kFixedOne = 1099511627776.0;  // 2^40: the fixed-point scale of a mass in [0, 1]

struct SampleParams {
  int32_t* out_ids;              // [R]
  const float* logits;           // [R, V] what the sampler samples: the penalised copy, or the raw logits
  const float* raw;              // [R, V] the raw logits (logprobs, the non-finite flag)
  const ops::SamplingRow* rows;  // [R] device copy of the host parameters, or null: every row greedy
  int vocab;
  float* logprobs;               // [R] or null
  int32_t* top_ids;              // [R, top_k_stride] or null
  float* top_logprobs;           // [R, top_k_stride] or null
  int top_stride;
  int32_t* nonfinite;            // [R] or null
};

// Order-preserving key: a < b as floats <=> key(a) < key(b) as unsigned; -0 and +0 are one key (the
// reference compares with >, so they tie).
__device__ __forceinline__ uint32_t key_of(float f) {
  uint32_t u = __float_as_uint(f);
  if (u == 0x80000000u) u = 0;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float float_of(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// The key of logit v at id i: the maximum key is the reference's std::max_element, the first maximum.
// max_element compares with <, so a NaN never replaces a maximum found earlier and nothing replaces a NaN at
// id 0: NaN at id 0 -> ~0 (wins), NaN elsewhere -> 0 (loses to every number). -0 and +0 share a key (tie).
__device__ __forceinline__ unsigned long long greedy_key(float v, int i) {
  if (isnan(v)) return i == 0 ? ~0ull : 0ull;
  return (static_cast<unsigned long long>(key_of(v)) << 32) | (0xffffffffu - static_cast<uint32_t>(i));
}
__device__ __forceinline__ int greedy_id(unsigned long long k) {
  return static_cast<int>(0xffffffffu - static_cast<uint32_t>(k));
}

__device__ __forceinline__ unsigned long long warp_max_u64(unsigned long long k) {
  for (int off = 16; off > 0; off /= 2) k = max(k, __shfl_xor_sync(0xffffffffu, k, off));
  return k;
}

// Softmax numerator exp((l - max) / T) in double (as the reference), as 40-bit fixed point.
__device__ __forceinline__ uint64_t mass_of(float l, float mx, float t) {
  const double e = exp((static_cast<double>(l) - static_cast<double>(mx)) / static_cast<double>(t));
  return __double2ull_rn(e * kFixedOne);
}

struct Shared {
  unsigned long long mass[kWarps][kBuckets];
  int count[kWarps][kBuckets];
  unsigned long long bucket_mass[kBuckets];
  int bucket_count[kBuckets];
  unsigned long long red_u[kWarps];
  double red_d[kWarps];
  int scan[kThreads];
  int chosen;
  unsigned long long mass_above;
  long long count_above;
  int found;
};

__device__ uint64_t block_sum(uint64_t v, Shared& sh) {
  for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();
  if (lane == 0) sh.red_u[warp] = v;
  __syncthreads();
  uint64_t s = 0;
  for (int w = 0; w < kWarps; ++w) s += sh.red_u[w];
  return s;
}

__device__ double block_sum_double(double v, Shared& sh) {
  for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();
  if (lane == 0) sh.red_d[warp] = v;
  __syncthreads();
  double s = 0.0;
  for (int w = 0; w < kWarps; ++w) s += sh.red_d[w];
  return s;
}

// The block's maximum greedy_key (every thread gets it).
__device__ unsigned long long block_max_key(unsigned long long k, Shared& sh) {
  k = warp_max_u64(k);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();
  if (lane == 0) sh.red_u[warp] = k;
  __syncthreads();
  for (int w = 0; w < kWarps; ++w) k = max(k, sh.red_u[w]);
  return k;
}

// Calls f(value, index, valid) for the row in steps of four consecutive elements per thread (one 16-byte load when
// the row allows it), with a trip count that is the same for every thread of the block.
template <typename F>
__device__ __forceinline__ void for_each4(const float* l, int V, F&& f) {
  const bool vec = V % 4 == 0 && reinterpret_cast<uintptr_t>(l) % 16 == 0;
  for (int base = 0; base < V; base += 4 * kThreads) {
    const int i = base + 4 * static_cast<int>(threadIdx.x);
    float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (vec && i < V) {
      const float4 q = __ldg(reinterpret_cast<const float4*>(l + i));
      v[0] = q.x;
      v[1] = q.y;
      v[2] = q.z;
      v[3] = q.w;
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) v[e] = i + e < V ? l[i + e] : 0.0f;
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) f(v[e], i + e, i + e < V);
  }
}

enum class Crit { kCountAtLeast, kMassAtLeast, kMassAbove };

struct Selection {
  uint32_t key;          // logit key of the selected element
  long long tie_index;   // its position among the elements with that key, in id order
  uint64_t mass_before;  // fixed-point mass of every element ranked before it (mass selections)
  uint64_t w;            // its own fixed-point mass (mass selections)
};

// The first element of the order (descending key, ascending id) among those with key >= min_key at which
// the running count / mass reaches (kCountAtLeast, kMassAtLeast: >=) or exceeds (kMassAbove: >) target;
// the last such element if none does (rounding of a target at the very end).
template <Crit kCrit>
__device__ Selection select(const float* l, int V, float mx, float t, uint32_t min_key, double target, Shared& sh) {
  constexpr bool kMass = kCrit != Crit::kCountAtLeast;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  uint32_t prefix = 0, mask = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = tid; i < kWarps * kBuckets; i += kThreads) {
      (&sh.mass[0][0])[i] = 0;
      (&sh.count[0][0])[i] = 0;
    }
    __syncthreads();
    // One element per lane and step, every lane of the warp at every step (the warp intrinsics need them).
    auto visit = [&](float v, int, bool valid) {
      int d = kBuckets;  // not taking part
      const uint32_t key = key_of(v);
      if (valid && (key & mask) == prefix && key >= min_key) d = static_cast<int>((key >> shift) & 0xffu);
      if (!__any_sync(0xffffffffu, d < kBuckets)) return;  // most steps after the first pass or a top-k
      const unsigned peers = __match_any_sync(0xffffffffu, d);
      const bool leader = lane == __ffs(peers) - 1;
      if constexpr (kMass) {
        const uint64_t q = d < kBuckets ? mass_of(v, mx, t) : 0;
        const unsigned hi = __reduce_add_sync(peers, static_cast<unsigned>(q >> 20));
        const unsigned lo = __reduce_add_sync(peers, static_cast<unsigned>(q & 0xfffffu));
        if (leader && d < kBuckets) sh.mass[warp][d] += (static_cast<unsigned long long>(hi) << 20) + lo;
      }
      if (leader && d < kBuckets) sh.count[warp][d] += __popc(peers);
      __syncwarp();  // the next step's leader of this digit may be another lane: order the shared updates
    };
    for_each4(l, V, visit);
    __syncthreads();
    for (int b = tid; b < kBuckets; b += kThreads) {
      unsigned long long m = 0;
      int c = 0;
      for (int w = 0; w < kWarps; ++w) {
        m += sh.mass[w][b];
        c += sh.count[w][b];
      }
      sh.bucket_mass[b] = m;
      sh.bucket_count[b] = c;
    }
    __syncthreads();
    if (tid == 0) {
      unsigned long long m = shift == 24 ? 0 : sh.mass_above;
      long long c = shift == 24 ? 0 : sh.count_above;
      int chosen = -1, last = -1;
      for (int d = kBuckets - 1; d >= 0; --d) {
        const int bc = sh.bucket_count[d];
        if (bc == 0) continue;
        last = d;
        const unsigned long long bm = sh.bucket_mass[d];
        bool cross;
        if constexpr (kCrit == Crit::kCountAtLeast) {
          cross = static_cast<double>(c + bc) >= target;
        } else if constexpr (kCrit == Crit::kMassAtLeast) {
          cross = static_cast<double>(m + bm) >= target;
        } else {
          cross = static_cast<double>(m + bm) > target;
        }
        if (cross) {
          chosen = d;
          break;
        }
        m += bm;
        c += bc;
      }
      if (chosen < 0) {  // the target is past the end: the last element
        chosen = last;
        m -= sh.bucket_mass[last];
        c -= sh.bucket_count[last];
      }
      sh.chosen = chosen;
      sh.mass_above = m;
      sh.count_above = c;
    }
    __syncthreads();
    prefix |= static_cast<uint32_t>(sh.chosen) << shift;
    mask |= 0xffu << shift;
  }
  // The key is fixed; its tie group (the elements with this key) is bucket sh.chosen of the last pass.
  const long long n_tie = sh.bucket_count[sh.chosen];
  const uint64_t above = sh.mass_above;
  long long j;
  uint64_t w = 0;
  if constexpr (kCrit == Crit::kCountAtLeast) {
    j = static_cast<long long>(target) - 1 - sh.count_above;
  } else {
    w = mass_of(float_of(prefix), mx, t);
    if (w == 0) {
      j = n_tie - 1;
    } else {
      const double q = (target - static_cast<double>(above)) / static_cast<double>(w);
      j = kCrit == Crit::kMassAtLeast ? static_cast<long long>(ceil(q)) - 1 : static_cast<long long>(floor(q));
    }
  }
  j = j < 0 ? 0 : (j >= n_tie ? n_tie - 1 : j);
  __syncthreads();  // sh is reused by the next step
  return Selection{prefix, j, above + static_cast<uint64_t>(j) * w, w};
}

// Id of the tie_index-th element (in id order) whose key is `key`: per-thread contiguous chunks, a block scan
// of the per-chunk counts, then the owning thread walks its chunk.
__device__ int find_tie(const float* l, int V, uint32_t key, long long tie_index, Shared& sh) {
  const int tid = threadIdx.x;
  const int chunk = (V + kThreads - 1) / kThreads;
  const int begin = min(V, tid * chunk), end = min(V, begin + chunk);
  int n = 0;
  for (int i = begin; i < end; ++i) n += key_of(l[i]) == key;
  sh.scan[tid] = n;
  if (tid == 0) sh.found = -1;
  __syncthreads();
  for (int off = 1; off < kThreads; off *= 2) {  // inclusive Hillis-Steele scan
    const int add = tid >= off ? sh.scan[tid - off] : 0;
    __syncthreads();
    sh.scan[tid] += add;
    __syncthreads();
  }
  const long long first = sh.scan[tid] - n;
  if (n > 0 && tie_index >= first && tie_index < first + n) {
    long long k = first;
    for (int i = begin; i < end; ++i) {
      if (key_of(l[i]) != key) continue;
      if (k == tie_index) {
        sh.found = i;
        break;
      }
      ++k;
    }
  }
  __syncthreads();
  return sh.found;
}

// The sampled id of one row (greedy or drawn), from the (penalised) logits l. `bad` gets whether this thread's
// elements of l hold a NaN or an infinity (the first pass reads them all anyway).
__device__ int sample_row_id(const float* l, int V, const ops::SamplingRow& row, Shared& sh, bool& bad) {
  const int tid = threadIdx.x;
  // The first maximum, as std::max_element (greedy_key).
  unsigned long long best = 0;
  for_each4(l, V, [&](float v, int i, bool valid) {
    if (valid) {
      best = max(best, greedy_key(v, i));
      bad = bad || !isfinite(v);
    }
  });
  const int best_i = greedy_id(block_max_key(best, sh));
  if (row.temperature == 0.0f || row.top_k == 1) return best_i;
  const float mx = l[best_i], t = row.temperature;

  // min_p: the least key whose mass exp((l - max) / T) reaches min_p (the maximum always does).
  uint32_t min_key = 0;
  if (row.min_p > 0.0f) {
    uint32_t least = 0xffffffffu;
    const double want = static_cast<double>(row.min_p);
    for (int i = tid; i < V; i += kThreads) {
      const float v = l[i];
      const double e = exp((static_cast<double>(v) - static_cast<double>(mx)) / static_cast<double>(t));
      if (e >= want) least = min(least, key_of(v));
    }
    // A block minimum through the maximum of the complement.
    min_key = ~static_cast<uint32_t>(block_max_key(static_cast<unsigned long long>(~least), sh));
  }

  // Z: the softmax mass of the top-k (or of every token at or above min_key). Later steps only look at keys
  // >= min_key.
  uint64_t z;
  if (row.top_k > 0 && row.top_k < V) {
    // Fewer than top_k tokens at or above min_key: the selection ends at the last of them (all are kept).
    const Selection k = select<Crit::kCountAtLeast>(l, V, mx, t, min_key, static_cast<double>(row.top_k), sh);
    min_key = k.key;
    uint64_t s = 0;
    for (int i = tid; i < V; i += kThreads) {
      const float v = l[i];
      if (key_of(v) > k.key) s += mass_of(v, mx, t);
    }
    z = block_sum(s, sh) + static_cast<uint64_t>(k.tie_index + 1) * mass_of(float_of(k.key), mx, t);
  } else {
    uint64_t s = 0;
    for (int i = tid; i < V; i += kThreads) {
      const float v = l[i];
      if (key_of(v) >= min_key) s += mass_of(v, mx, t);
    }
    z = block_sum(s, sh);
  }
  // The nucleus: the shortest prefix whose mass reaches top_p (never past the top-k).
  if (row.top_p < 1.0f) {
    const Selection c =
        select<Crit::kMassAtLeast>(l, V, mx, t, min_key, static_cast<double>(row.top_p) * static_cast<double>(z), sh);
    z = min(z, c.mass_before + c.w);
  }
  const double u = counter_uniform(row.seed, row.step);
  const Selection s = select<Crit::kMassAbove>(l, V, mx, t, min_key, u * static_cast<double>(z), sh);
  return find_tie(l, V, s.key, s.tie_index, sh);
}

__global__ void __launch_bounds__(kThreads) sample_kernel(const SampleParams p) {
  __shared__ Shared sh;
  const int64_t r = blockIdx.x;
  const int V = p.vocab;
  const float* l = p.logits + r * V;
  const float* raw = p.raw + r * V;
  pdl_wait();  // PDL: the logits are the lm_head's (or the penalty kernel's) output, the rows uploaded this step
  pdl_trigger();
  const ops::SamplingRow row = p.rows != nullptr ? p.rows[r] : ops::SamplingRow{};  // none: greedy
  const int tid = threadIdx.x;

  bool bad = false;
  const int id = sample_row_id(l, V, row, sh, bad);
  if (tid == 0) p.out_ids[r] = id;

  if (p.nonfinite != nullptr) {
    // Without penalties l is the raw row and the sampler's first pass already checked it.
    if (l != raw) {
      bad = false;
      for_each4(raw, V, [&](float v, int, bool valid) { bad = bad || (valid && !isfinite(v)); });
    }
    const int any = __syncthreads_or(bad ? 1 : 0);
    if (tid == 0) p.nonfinite[r] = any != 0 ? 1 : 0;
  }
  const int k_want = p.top_ids != nullptr ? min(row.num_top_logprobs, V) : 0;
  if (p.logprobs == nullptr && k_want == 0) {
    if (p.top_ids != nullptr && tid == 0) {
      for (int j = 0; j < p.top_stride; ++j) {
        p.top_ids[r * p.top_stride + j] = -1;
        p.top_logprobs[r * p.top_stride + j] = 0.0f;
      }
    }
    return;
  }
  // Raw log-sum-exp in double: max, then sum of exp(l - max).
  unsigned long long best = 0;
  for_each4(raw, V, [&](float v, int i, bool valid) {
    if (valid) best = max(best, greedy_key(v, i));
  });
  unsigned long long prev = block_max_key(best, sh);
  const double rmax = raw[greedy_id(prev)];
  double part = 0.0;
  for (int i = tid; i < V; i += kThreads) part += exp(static_cast<double>(raw[i]) - rmax);
  const double lse = rmax + log(block_sum_double(part, sh));
  if (p.logprobs != nullptr && tid == 0) p.logprobs[r] = static_cast<float>(static_cast<double>(raw[id]) - lse);
  // Top-K: pick j is the largest greedy_key below pick j - 1's (the order: logit descending, id ascending).
  for (int j = 0; j < p.top_stride && p.top_ids != nullptr; ++j) {
    if (j >= k_want) {
      if (tid == 0) {
        p.top_ids[r * p.top_stride + j] = -1;
        p.top_logprobs[r * p.top_stride + j] = 0.0f;
      }
      continue;
    }
    if (j > 0) {
      unsigned long long next = 0;
      const unsigned long long bound = prev;
      for_each4(raw, V, [&](float v, int i, bool valid) {
        const unsigned long long k = greedy_key(v, i);
        if (valid && k < bound) next = max(next, k);
      });
      prev = block_max_key(next, sh);
    }
    if (tid == 0) {
      const int t = greedy_id(prev);
      p.top_ids[r * p.top_stride + j] = t;
      p.top_logprobs[r * p.top_stride + j] = static_cast<float>(static_cast<double>(raw[t]) - lse);
    }
  }
}

struct PenaltyParams {
  float* logits;                   // [R, V] the copy to penalise
  const ops::SamplingRow* rows;    // [R]
  const ops::PenaltyToken* tokens; // the rows' distinct tokens
  int vocab;
};

// One block per row; each thread rewrites the logits of distinct tokens of the row (no two threads share one).
__global__ void __launch_bounds__(kThreads) penalty_kernel(const PenaltyParams p) {
  const int64_t r = blockIdx.x;
  pdl_wait();  // the copy was written by the memcpy before us; the rows and tokens were uploaded
  pdl_trigger();
  const ops::SamplingRow row = p.rows[r];
  float* l = p.logits + r * p.vocab;
  for (int i = row.penalty_begin + static_cast<int>(threadIdx.x); i < row.penalty_end; i += kThreads) {
    const ops::PenaltyToken t = p.tokens[i];
    float v = l[t.id];
    if (row.repetition_penalty != 1.0f && (t.in_prompt != 0 || t.output_count > 0)) {
      v = v > 0.0f ? __fdiv_rn(v, row.repetition_penalty) : __fmul_rn(v, row.repetition_penalty);
    }
    v = __fsub_rn(v, __fmul_rn(row.frequency_penalty, static_cast<float>(t.output_count)));
    if (t.output_count > 0) v = __fsub_rn(v, row.presence_penalty);
    l[t.id] = v;
  }
}

// ---- greedy rows split over many blocks (see the header) ------------------------------------------------------
constexpr int kGreedyMaxRows = 64;               // the split path's rows: one scratch word each
constexpr int kGreedyTargetBlocks = 2 * 132;     // about two blocks per H200 SM
constexpr int kGreedyMinChunk = 4 * kThreads;    // one float4 per thread
constexpr int kGreedyMaxSplits = 128;
constexpr int kTicketSlots = 64;                 // one per host thread (mod 64), as router.cu's g_gate_tickets
// Zero at module load; every launch leaves its slot's words and ticket at zero.
__device__ unsigned long long g_greedy_best[kTicketSlots][kGreedyMaxRows];
__device__ unsigned int g_greedy_tickets[kTicketSlots];

struct GreedyParams {
  int32_t* out_ids;     // [R]
  const float* logits;  // [R, V]
  int vocab;
  int chunk;            // logits per block, a multiple of 4; grid.x = ceil(V / chunk)
  int slot;             // ticket slot of the calling host thread
  bool vec4;            // 16-byte loads: V % 4 == 0 and aligned logits
  int32_t* nonfinite;   // [R], zeroed before the launch, or null
};

// grid (splits, R), kThreads. Block (s, r) takes logits [s * chunk, min(V, (s + 1) * chunk)) of row r.
__global__ void __launch_bounds__(kThreads) greedy_split_kernel(const GreedyParams p) {
  __shared__ unsigned long long s_warp[kWarps];
  __shared__ bool s_last;
  const int r = static_cast<int>(blockIdx.y), tid = static_cast<int>(threadIdx.x);
  const int c0 = static_cast<int>(blockIdx.x) * p.chunk, c1 = min(p.vocab, c0 + p.chunk);
  const float* l = p.logits + static_cast<int64_t>(r) * p.vocab;
  pdl_wait();  // the logits come from the previous kernel
  pdl_trigger();

  unsigned long long best = 0;
  bool bad = false;
  if (p.vec4) {  // c0, c1 and the row start are multiples of 4: whole float4s
    for (int i = c0 + 4 * tid; i < c1; i += 4 * kThreads) {
      const float4 q = __ldg(reinterpret_cast<const float4*>(l + i));
      best = max(best, max(max(greedy_key(q.x, i), greedy_key(q.y, i + 1)),
                           max(greedy_key(q.z, i + 2), greedy_key(q.w, i + 3))));
      bad = bad || !isfinite(q.x) || !isfinite(q.y) || !isfinite(q.z) || !isfinite(q.w);
    }
  } else {
    for (int i = c0 + tid; i < c1; i += kThreads) {
      const float v = __ldg(l + i);
      best = max(best, greedy_key(v, i));
      bad = bad || !isfinite(v);
    }
  }
  if (__syncthreads_or(bad ? 1 : 0) != 0 && tid == 0 && p.nonfinite != nullptr) atomicOr(&p.nonfinite[r], 1);
  best = warp_max_u64(best);
  if (tid % 32 == 0) s_warp[tid / 32] = best;
  __syncthreads();
  if (tid == 0) {
    for (int w = 1; w < kWarps; ++w) best = max(best, s_warp[w]);
    atomicMax(&g_greedy_best[p.slot][r], best);
    __threadfence();  // the maximum before the ticket
    const unsigned int n_blocks = gridDim.x * gridDim.y;
    s_last = atomicInc(&g_greedy_tickets[p.slot], n_blocks - 1) == n_blocks - 1;  // wraps back to zero
  }
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  // Every row has a nonzero key (a number at id 0, or ~0 for a NaN there); read it and leave zero behind.
  for (int row = tid; row < static_cast<int>(gridDim.y); row += kThreads) {
    p.out_ids[row] = greedy_id(atomicExch(&g_greedy_best[p.slot][row], 0ull));
  }
}

int greedy_ticket_slot() {
  static std::atomic<int> next{0};
  thread_local const int slot = next.fetch_add(1) % kTicketSlots;
  return slot;
}

// Blocks per row for the split path, or 1 where one block per row already fills the GPU (or V is short).
int greedy_splits(int64_t R, int64_t V) {
  if (R > kGreedyMaxRows) return 1;
  const int64_t want = (kGreedyTargetBlocks + R - 1) / R;
  const int64_t most = std::min<int64_t>(kGreedyMaxSplits, (V + kGreedyMinChunk - 1) / kGreedyMinChunk);
  return static_cast<int>(std::max<int64_t>(1, std::min(want, most)));
}

// ---- greedy acceptance of a verify step (ops::accept_drafts_greedy) -------------------------------------------
struct AcceptParams {
  int32_t* accepted;            // [n]
  int32_t* head_rows;           // [n]
  int32_t* draft_context;       // [k - 1, n] or null
  const int32_t* tokens;        // [n (k + 1)]
  const int32_t* targets;       // [n (k + 1)]
  const int32_t* context_lens;  // [n]
  int n, k;
};

// One thread per sequence: k is a handful of drafts, n at most a few hundred sequences.
__global__ void accept_drafts_kernel(const AcceptParams p) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  pdl_wait();  // the targets are the previous kernel's
  pdl_trigger();
  if (i >= p.n) return;
  const int w = p.k + 1;
  const int32_t* tok = p.tokens + static_cast<int64_t>(i) * w;
  const int32_t* tgt = p.targets + static_cast<int64_t>(i) * w;
  int a = 0;
  while (a < p.k && tok[a + 1] == tgt[a]) ++a;
  p.accepted[i] = a;
  p.head_rows[i] = i * w + a;
  for (int d = 0; d + 1 < p.k; ++d) p.draft_context[d * p.n + i] = p.context_lens[i] + a + d + 1;
}

}  // namespace

void accept_drafts_greedy(const ops::Context& ctx, const Tensor& accepted, const Tensor& head_rows,
                          const Tensor& draft_context, const Tensor& tokens, const Tensor& targets,
                          const Tensor& context_lens) {
  const int n = static_cast<int>(accepted.dim(0));
  const AcceptParams p{accepted.data_as<int32_t>(),
                       head_rows.data_as<int32_t>(),
                       draft_context && draft_context.numel() > 0 ? draft_context.data_as<int32_t>() : nullptr,
                       tokens.data_as<const int32_t>(),
                       targets.data_as<const int32_t>(),
                       context_lens.data_as<const int32_t>(),
                       n,
                       static_cast<int>(tokens.dim(0) / n) - 1};
  constexpr int kBlock = 128;
  CHIMERA_CUDA_CHECK(launch(accept_drafts_kernel, dim3(static_cast<unsigned>(ceil_div(n, kBlock))), dim3(kBlock), 0,
                            as_stream(ctx.stream), p),
                     "ops::accept_drafts_greedy");
}

void sample_tokens(const ops::Context& ctx, const ops::SamplingOutputs& out, const Tensor& logits,
                   std::span<const ops::SamplingRow> rows, std::span<const ops::PenaltyToken> penalty_tokens) {
  const char* op = "ops::sample_tokens";
  const Tensor& out_ids = out.ids;
  const int64_t R = logits.dim(0), V = logits.dim(1);
  if (R == 0) return;
  // Fixed-point masses of up to 2^24 tokens fit 64-bit sums.
  if (V > (int64_t{1} << 24) || R > 0x7fffffffLL) {
    throw_runtime(str_cat(op, ": logits ", logits.describe(), " exceed the CUDA sampler's 2^24 vocabulary"));
  }
  const cudaStream_t stream = as_stream(ctx.stream);
  bool all_greedy = true, any_penalty = false;
  for (const ops::SamplingRow& row : rows) {
    all_greedy = all_greedy && (row.temperature == 0.0f || row.top_k == 1);
    any_penalty = any_penalty || row.penalty_end > row.penalty_begin;
  }
  const bool want_logprobs = static_cast<bool>(out.logprobs) || static_cast<bool>(out.top_ids);
  // Greedy rows without penalties or logprobs need no parameters (the default SamplingRow): nothing is uploaded, so
  // the launch can be graph-captured at any row count.
  const bool plain_greedy = all_greedy && !any_penalty && !want_logprobs;
  const int splits = plain_greedy ? greedy_splits(R, V) : 1;
  if (splits > 1) {  // no row parameters needed: nothing to upload (and the launch can be graph-captured)
    if (out.nonfinite) {
      CHIMERA_CUDA_CHECK(cudaMemsetAsync(out.nonfinite.data(), 0, out.nonfinite.nbytes(), stream), op);
    }
    const int chunk = ceil_div(ceil_div(V, splits), 4) * 4;
    const GreedyParams g{out_ids.data_as<int32_t>(),
                         logits.data_as<const float>(),
                         static_cast<int>(V),
                         chunk,
                         greedy_ticket_slot(),
                         V % 4 == 0 && reinterpret_cast<uintptr_t>(logits.data()) % 16 == 0,
                         out.nonfinite ? out.nonfinite.data_as<int32_t>() : nullptr};
    const dim3 grid(static_cast<unsigned>(ceil_div(V, chunk)), static_cast<unsigned>(R));
    CHIMERA_CUDA_CHECK(launch(greedy_split_kernel, grid, dim3(kThreads), 0, stream, g), op);
    return;
  }
  const auto* rows_device = plain_greedy ? nullptr
                                         : static_cast<const ops::SamplingRow*>(upload_scratch(
                                               rows.data(), rows.size_bytes(), stream, kRowsScratchSlot));
  // Penalties rewrite a copy of the logits (logprobs stay those of the raw rows).
  Tensor penalised;
  if (any_penalty) {
    penalised = device::empty(Device::kCuda, DType::kF32, logits.shape());
    CHIMERA_CUDA_CHECK(
        cudaMemcpyAsync(penalised.data(), logits.data(), logits.nbytes(), cudaMemcpyDeviceToDevice, stream), op);
    const PenaltyParams pp{penalised.data_as<float>(), rows_device,
                           static_cast<const ops::PenaltyToken*>(upload_scratch(
                               penalty_tokens.data(), penalty_tokens.size_bytes(), stream, kPenaltyScratchSlot)),
                           static_cast<int>(V)};
    CHIMERA_CUDA_CHECK(launch(penalty_kernel, dim3(static_cast<unsigned>(R)), dim3(kThreads), 0, stream, pp), op);
  }
  SampleParams p{};
  p.out_ids = out_ids.data_as<int32_t>();
  p.raw = logits.data_as<const float>();
  p.logits = any_penalty ? penalised.data_as<const float>() : p.raw;
  p.rows = rows_device;
  p.vocab = static_cast<int>(V);
  p.logprobs = out.logprobs ? out.logprobs.data_as<float>() : nullptr;
  p.top_ids = out.top_ids ? out.top_ids.data_as<int32_t>() : nullptr;
  p.top_logprobs = out.top_ids ? out.top_logprobs.data_as<float>() : nullptr;
  p.top_stride = out.top_ids ? static_cast<int>(out.top_ids.dim(1)) : 0;
  p.nonfinite = out.nonfinite ? out.nonfinite.data_as<int32_t>() : nullptr;
  CHIMERA_CUDA_CHECK(launch(sample_kernel, dim3(static_cast<unsigned>(R)), dim3(kThreads), 0, stream, p), op);
}

}  // namespace chimera::cuda
