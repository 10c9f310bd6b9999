// Token sampling on the GPU, the same function as the CPU reference (backends/cpu/sampling.cpp):
// greedy argmax (ties -> lowest id), or temperature / top-k / top-p / inverse-CDF sampling in descending
// logit order (ties: lower id first) with the counter-based uniform of core/counter_rng.h.
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
#include <cmath>

#include "backends/cuda/cuda_common.cuh"
#include "backends/cuda/cuda_ops.h"
#include "backends/cuda/launch.cuh"
#include "core/counter_rng.h"

namespace chimera::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kBuckets = 256;
constexpr int kRowsScratchSlot = 1;
constexpr double kFixedOne = 1099511627776.0;  // 2^40: the fixed-point scale of a mass in [0, 1]

struct SampleParams {
  int32_t* out_ids;              // [R]
  const float* logits;           // [R, V]
  const ops::SamplingRow* rows;  // [R] device copy of the host parameters
  int vocab;
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
  float red_v[kWarps];
  int red_i[kWarps];
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

// First maximum (lowest id among equal maxima), as std::max_element.
__device__ void block_argmax(float& v, int& i, Shared& sh) {
  for (int off = 16; off > 0; off /= 2) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, off);
    const int oi = __shfl_xor_sync(0xffffffffu, i, off);
    if (ov > v || (ov == v && oi < i)) {
      v = ov;
      i = oi;
    }
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();
  if (lane == 0) {
    sh.red_v[warp] = v;
    sh.red_i[warp] = i;
  }
  __syncthreads();
  v = sh.red_v[0];
  i = sh.red_i[0];
  for (int w = 1; w < kWarps; ++w) {
    if (sh.red_v[w] > v || (sh.red_v[w] == v && sh.red_i[w] < i)) {
      v = sh.red_v[w];
      i = sh.red_i[w];
    }
  }
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

__global__ void __launch_bounds__(kThreads) sample_kernel(const SampleParams p) {
  __shared__ Shared sh;
  const int64_t r = blockIdx.x;
  const int V = p.vocab;
  const float* l = p.logits + r * V;
  pdl_wait();  // PDL: the logits are the lm_head's output, the rows uploaded this step
  pdl_trigger();
  const ops::SamplingRow row = p.rows[r];
  const int tid = threadIdx.x;

  float best = -INFINITY;
  int best_i = V;  // "none yet": loses every tie against a real index
  for (int i = tid; i < V; i += kThreads) {
    const float v = l[i];
    if (v > best || best_i == V) {
      best = v;
      best_i = i;
    }
  }
  block_argmax(best, best_i, sh);
  if (row.temperature == 0.0f || row.top_k == 1) {
    if (tid == 0) p.out_ids[r] = best_i;
    return;
  }
  const float mx = best, t = row.temperature;

  // Z: the softmax mass of the top-k (or of every token). Later steps only look at keys >= min_key.
  uint32_t min_key = 0;
  uint64_t z;
  if (row.top_k > 0 && row.top_k < V) {
    const Selection k = select<Crit::kCountAtLeast>(l, V, mx, t, 0, static_cast<double>(row.top_k), sh);
    min_key = k.key;
    uint64_t s = 0;
    for (int i = tid; i < V; i += kThreads) {
      const float v = l[i];
      if (key_of(v) > k.key) s += mass_of(v, mx, t);
    }
    z = block_sum(s, sh) + static_cast<uint64_t>(k.tie_index + 1) * mass_of(float_of(k.key), mx, t);
  } else {
    uint64_t s = 0;
    for (int i = tid; i < V; i += kThreads) s += mass_of(l[i], mx, t);
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
  const int id = find_tie(l, V, s.key, s.tie_index, sh);
  if (tid == 0) p.out_ids[r] = id;
}

}  // namespace

void sample_tokens(const ops::Context& ctx, const Tensor& out_ids, const Tensor& logits,
                   std::span<const ops::SamplingRow> rows) {
  const char* op = "ops::sample_tokens";
  const int64_t R = logits.dim(0), V = logits.dim(1);
  if (R == 0) return;
  // Fixed-point masses of up to 2^24 tokens fit 64-bit sums.
  if (V > (int64_t{1} << 24) || R > 0x7fffffffLL) {
    throw_runtime(str_cat(op, ": logits ", logits.describe(), " exceed the CUDA sampler's 2^24 vocabulary"));
  }
  const cudaStream_t stream = as_stream(ctx.stream);
  SampleParams p{out_ids.data_as<int32_t>(), logits.data_as<const float>(), nullptr, static_cast<int>(V)};
  p.rows =
      static_cast<const ops::SamplingRow*>(upload_scratch(rows.data(), rows.size_bytes(), stream, kRowsScratchSlot));
  launch(sample_kernel, dim3(static_cast<unsigned>(R)), dim3(kThreads), 0, stream, p);
  CHIMERA_LAUNCH_CHECK(op);
}

}  // namespace chimera::cuda
