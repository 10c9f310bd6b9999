// Portable SSD kernels (fp32 math on CUDA cores, any element type and shape): the stages every path shares
// (parameter prep, chunk cumsum, state passing), the SIMT chunk_state / chunk_scan used for F32 activations
// and shapes the tensor-core kernels do not cover, and the per-token recurrence oracle. They mirror the CPU
// reference (src/backends/cpu/ssd.cpp) stage by stage, including its order of fp32 operations where cheap.
#include <type_traits>

#include "backends/cuda/mamba/mamba_common.cuh"
#include "backends/cuda/mamba/ssd_kernels.cuh"

namespace chimera::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float load_param(const void* p, ParamType t, int i) {
  switch (t) {
    case ParamType::kBF16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case ParamType::kF16:
      return __half2float(static_cast<const __half*>(p)[i]);
    default:
      return static_cast<const float*>(p)[i];
  }
}

__global__ void ssd_prepare_kernel(const void* A_log, ParamType a_type, const void* D, ParamType d_type,
                                   const void* dt_bias, ParamType b_type, float* out, int H) {
  const int h = blockIdx.x * blockDim.x + threadIdx.x;
  if (h >= H) return;
  out[h] = -expf(load_param(A_log, a_type, h));
  out[H + h] = load_param(D, d_type, h);
  out[2 * H + h] = load_param(dt_bias, b_type, h);
}

// Stage 2: one block per (chunk, 32 heads). A coalesced tile of dt_raw [rows, 32 heads] goes to shared
// memory; lane h of warp 0 runs the sequential fp32 sum of the CPU reference (acc += dt * A, unfused) so
// dA_cumsum matches it bit for bit up to softplus' ulps; the tile is written back transposed to [H, T].
template <typename T>
__global__ void __launch_bounds__(kThreads) ssd_chunk_cumsum_kernel(SsdParams p) {
  constexpr int kRows = 64, kHeads = 32;
  __shared__ float raw[kRows][kHeads + 1];
  __shared__ float dts[kRows][kHeads + 1];
  __shared__ float acs[kRows][kHeads + 1];
  const int2 ch = p.chunks[blockIdx.x];
  const int h0 = blockIdx.y * kHeads;
  const int nh = min(kHeads, p.H - h0);
  const int tid = threadIdx.x;
  const T* dt_raw = static_cast<const T*>(p.dt_raw);
  float a = 0.0f, bias = 0.0f, acc = 0.0f;
  if (tid < nh) {
    a = p.A[h0 + tid];
    bias = p.dt_bias[h0 + tid];
  }
  for (int t0 = ch.x; t0 < ch.y; t0 += kRows) {
    const int rows = min(kRows, ch.y - t0);
    for (int i = tid; i < rows * kHeads; i += kThreads) {
      const int r = i / kHeads, c = i % kHeads;
      if (c < nh) raw[r][c] = to_float(dt_raw[static_cast<size_t>(t0 + r) * p.H + h0 + c]);
    }
    __syncthreads();
    if (tid < nh) {
      for (int r = 0; r < rows; ++r) {
        const float v = ssd_discretize_dt(raw[r][tid], bias, p.dt_min, p.dt_max);
        acc = __fadd_rn(acc, __fmul_rn(v, a));
        dts[r][tid] = v;
        acs[r][tid] = acc;
      }
    }
    __syncthreads();
    for (int i = tid; i < kRows * kHeads; i += kThreads) {
      const int c = i / kRows, r = i % kRows;
      if (r < rows && c < nh) {
        const size_t o = static_cast<size_t>(h0 + c) * p.T + t0 + r;
        p.dt[o] = dts[r][c];
        p.dA_cumsum[o] = acs[r][c];
      }
    }
    __syncthreads();
  }
}

// Stage 4: kVec consecutive state elements of one (sequence, head) per thread, sequential over the
// sequence's superchunks: entering[sc] = running; running = decay[sc] * running + states[sc]. The reads
// (states, decay) and writes (entering) are separate arrays, so a batch of kBatch superchunks is loaded
// before the dependent chain uses it.
template <typename S, int kVec>
__global__ void __launch_bounds__(kThreads) ssd_state_passing_kernel(SsdParams p) {
  using Vec = std::conditional_t<kVec == 4, float4, float>;
  constexpr int kBatch = 8;
  const int PN = p.P * p.N;
  const int e = (blockIdx.x * kThreads + threadIdx.x) * kVec;
  if (e >= PN) return;
  const int h = blockIdx.y;
  const int4 sq = p.seqs[blockIdx.z];
  S* slot_state = static_cast<S*>(p.ssm_state) + (static_cast<size_t>(sq.z) * p.H + h) * PN + e;
  float run[kVec];
#pragma unroll
  for (int k = 0; k < kVec; ++k) run[k] = to_float(slot_state[k]);
  const float* __restrict__ in = p.states;
  const float* __restrict__ decay = p.decay;
  float* __restrict__ out = p.entering;
  auto at = [&](int sc) { return (static_cast<size_t>(sc) * p.H + h) * PN + e; };
  for (int sc0 = sq.x; sc0 < sq.y; sc0 += kBatch) {
    Vec v[kBatch];
    float d[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (sc0 + b < sq.y) {
        v[b] = *reinterpret_cast<const Vec*>(&in[at(sc0 + b)]);
        d[b] = decay[static_cast<size_t>(sc0 + b) * p.H + h];
      }
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (sc0 + b < sq.y) {
        const float* vs = reinterpret_cast<const float*>(&v[b]);
        Vec o;
        float* os = reinterpret_cast<float*>(&o);
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          os[k] = run[k];
          run[k] = d[b] * run[k] + vs[k];
        }
        *reinterpret_cast<Vec*>(&out[at(sc0 + b)]) = o;
        if (p.super_checkpoints != nullptr) {
          const int2 ck = p.super_checkpoints[sc0 + b];
          if (ck.x >= 0) {
            S* dst = static_cast<S*>(p.ssm_state) + (static_cast<size_t>(ck.x) * p.H + h) * PN + e;
            const uint64_t ck_key = ssm_rounding_key(p.state_seed, ck.y);
#pragma unroll
            for (int k = 0; k < kVec; ++k) {
              dst[k] = mamba::round_state<S>(os[k], ck_key, static_cast<uint32_t>(h * PN + e + k));
            }
          }
        }
      }
    }
  }
  // F16: stochastic rounding keyed by the sequence's last position (element h * PN + e + k of the slot).
  const uint64_t key = ssm_rounding_key(p.state_seed, sq.w);
#pragma unroll
  for (int k = 0; k < kVec; ++k) slot_state[k] = mamba::round_state<S>(run[k], key, static_cast<uint32_t>(h * PN + e + k));
}

// Stage 3, portable: one block per (chunk, head) (superchunk == chunk). Thread per state element (p, n):
// S[p, n] = sum_s (w[s] * x[s, p]) * B[s, n], w[s] = exp(Acum[last] - Acum[s]) * dt[s].
template <typename T>
__global__ void __launch_bounds__(kThreads) ssd_chunk_state_portable_kernel(SsdParams p) {
  extern __shared__ float w[];  // [chunk_size]
  const int c = blockIdx.x / p.H, h = blockIdx.x % p.H, g = h / p.heads_per_group;
  const int2 ch = p.chunks[c];
  const int len = ch.y - ch.x;
  const float* dt = p.dt + static_cast<size_t>(h) * p.T + ch.x;
  const float* acs = p.dA_cumsum + static_cast<size_t>(h) * p.T + ch.x;
  const float a_last = acs[len - 1];
  for (int s = threadIdx.x; s < len; s += kThreads) w[s] = expf(a_last - acs[s]) * dt[s];
  __syncthreads();
  const T* x = static_cast<const T*>(p.x);
  const T* B = static_cast<const T*>(p.B);
  const int PN = p.P * p.N;
  float* out = p.states + (static_cast<size_t>(c) * p.H + h) * PN;
  for (int e = threadIdx.x; e < PN; e += kThreads) {
    const int pi = e / p.N, n = e % p.N;
    float acc = 0.0f;
    for (int s = 0; s < len; ++s) {
      const size_t t = static_cast<size_t>(ch.x + s);
      const float cx = w[s] * to_float(x[(t * p.H + h) * p.P + pi]);
      acc += cx * to_float(B[(t * p.G + g) * p.N + n]);
    }
    out[e] = acc;
  }
  if (threadIdx.x == 0) p.decay[static_cast<size_t>(c) * p.H + h] = expf(a_last);
}

// Rows of the chunk handled per pass of the portable scan: the [rows, chunk] decay-weighted C.B tile
// stays within kScanTileFloats of shared memory.
constexpr int kScanTileFloats = 8192;
inline int scan_tile_rows(int chunk) { return chunk >= kScanTileFloats ? 1 : kScanTileFloats / chunk; }

// Stage 5, portable: one block per (chunk, head), the entering state from stage 4. Rows are taken in tiles;
// per tile, M[l, s] = (C[l] . B[s]) * exp(Acum[l] - Acum[s]) * dt[s] (s <= l) goes to shared memory, then
// y[l, p] = exp(Acum[l]) * (S_in[p] . C[l]) + sum_s M[l, s] x[s, p] + D x[l, p].
template <typename T>
__global__ void __launch_bounds__(kThreads) ssd_chunk_scan_portable_kernel(SsdParams p, int tile_rows) {
  extern __shared__ float smem[];
  const int q4 = (p.chunk_size + 3) / 4 * 4;
  float* dts = smem;     // [chunk_size]
  float* acs = dts + q4;  // [chunk_size]
  float* m = acs + q4;    // [tile_rows, chunk_size]
  const int c = blockIdx.x / p.H, h = blockIdx.x % p.H, g = h / p.heads_per_group;
  const int2 ch = p.chunks[c];
  const int len = ch.y - ch.x;
  for (int s = threadIdx.x; s < len; s += kThreads) {
    dts[s] = p.dt[static_cast<size_t>(h) * p.T + ch.x + s];
    acs[s] = p.dA_cumsum[static_cast<size_t>(h) * p.T + ch.x + s];
  }
  __syncthreads();
  const T* x = static_cast<const T*>(p.x);
  const T* B = static_cast<const T*>(p.B);
  const T* C = static_cast<const T*>(p.C);
  T* y = static_cast<T*>(p.y);
  const float* s_in = p.entering + (static_cast<size_t>(c) * p.H + h) * p.P * p.N;
  const float d = p.D[h];
  auto xat = [&](int s, int pi) { return to_float(x[(static_cast<size_t>(ch.x + s) * p.H + h) * p.P + pi]); };
  auto crow = [&](int l) { return C + (static_cast<size_t>(ch.x + l) * p.G + g) * p.N; };
  for (int l0 = 0; l0 < len; l0 += tile_rows) {
    const int nl = min(tile_rows, len - l0);
    for (int i = threadIdx.x; i < nl * len; i += kThreads) {
      const int li = i / len, s = i % len, l = l0 + li;
      if (s > l) continue;
      const T* cl = crow(l);
      const T* bs = B + (static_cast<size_t>(ch.x + s) * p.G + g) * p.N;
      float cb = 0.0f;
      for (int n = 0; n < p.N; ++n) cb += to_float(cl[n]) * to_float(bs[n]);
      m[li * len + s] = cb * expf(acs[l] - acs[s]) * dts[s];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < nl * p.P; i += kThreads) {
      const int li = i / p.P, pi = i % p.P, l = l0 + li;
      const T* cl = crow(l);
      const float* sp = s_in + static_cast<size_t>(pi) * p.N;
      float off = 0.0f;
      for (int n = 0; n < p.N; ++n) off += sp[n] * to_float(cl[n]);
      float acc = expf(acs[l]) * off;
      for (int s = 0; s <= l; ++s) acc += m[li * len + s] * xat(s, pi);
      y[(static_cast<size_t>(ch.x + l) * p.H + h) * p.P + pi] = from_float<T>(acc + d * xat(l, pi));
    }
    __syncthreads();
  }
}

// The recurrence: one block per (sequence, head); the fp32 state [P, N] lives in shared memory. Per token,
// warp w owns rows p = w, w + 8, ...; lanes stride over n and a shuffle reduction gives y[p].
template <typename T, typename S>
__global__ void __launch_bounds__(kThreads) ssm_recurrence_kernel(SsmRecurrenceParams p) {
  extern __shared__ float smem[];
  const int PN = p.P * p.N;
  const int pn4 = (PN + 3) / 4 * 4, n4 = (p.N + 3) / 4 * 4;
  float* state = smem;     // [P, N]
  float* bs = state + pn4;  // [N]
  float* cs = bs + n4;      // [N]
  float* xs = cs + n4;      // [P]
  const int seq = blockIdx.x / p.H, h = blockIdx.x % p.H, g = h / p.heads_per_group;
  const int4 sq = p.seqs[seq];
  S* slot_state = static_cast<S*>(p.ssm_state) + (static_cast<size_t>(sq.z) * p.H + h) * PN;
  for (int e = threadIdx.x; e < PN; e += kThreads) state[e] = to_float(slot_state[e]);
  const T* x = static_cast<const T*>(p.x);
  const T* B = static_cast<const T*>(p.B);
  const T* C = static_cast<const T*>(p.C);
  const T* dt_raw = static_cast<const T*>(p.dt_raw);
  T* y = static_cast<T*>(p.y);
  const float a = p.A[h], d = p.D[h], bias = p.dt_bias[h];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int t = sq.x; t < sq.y; ++t) {
    __syncthreads();  // the previous token is done with bs, cs, xs (and the initial state is loaded)
    const size_t bc = (static_cast<size_t>(t) * p.G + g) * p.N;
    for (int n = threadIdx.x; n < p.N; n += kThreads) {
      bs[n] = to_float(B[bc + n]);
      cs[n] = to_float(C[bc + n]);
    }
    for (int pi = threadIdx.x; pi < p.P; pi += kThreads) {
      xs[pi] = to_float(x[(static_cast<size_t>(t) * p.H + h) * p.P + pi]);
    }
    __syncthreads();
    const float dt =
        ssd_discretize_dt(to_float(dt_raw[static_cast<size_t>(t) * p.H + h]), bias, p.dt_min, p.dt_max);
    const float dA = expf(dt * a);
    for (int pi = warp; pi < p.P; pi += kThreads / 32) {
      const float dtx = dt * xs[pi];
      float* row = state + static_cast<size_t>(pi) * p.N;
      float part = 0.0f;
      for (int n = lane; n < p.N; n += 32) {
        const float s = row[n] * dA + dtx * bs[n];
        row[n] = s;
        part += s * cs[n];
      }
#pragma unroll
      for (int o = 16; o > 0; o /= 2) part += __shfl_xor_sync(0xffffffffu, part, o);
      if (lane == 0) y[(static_cast<size_t>(t) * p.H + h) * p.P + pi] = from_float<T>(part + d * xs[pi]);
    }
  }
  __syncthreads();
  const uint64_t key = ssm_rounding_key(p.state_seed, sq.w);  // F16: stochastic rounding (as the scan's final state)
  for (int e = threadIdx.x; e < PN; e += kThreads) {
    slot_state[e] = mamba::round_state<S>(state[e], key, static_cast<uint32_t>(h * PN + e));
  }
}

// Shared arrays are carved at multiples of 4 floats: the compiler may read a loop's tail as one 16-byte
// vector (seen under compute-sanitizer: a 16-byte read of a 4-byte array), so every piece is padded.
inline size_t pad4(size_t n) { return (n + 3) / 4 * 4; }

// Dynamic shared memory above the 48 KB default needs an opt-in per kernel.
template <typename Kernel>
void set_smem(Kernel kernel, size_t bytes, const char* op) {
  constexpr size_t kMax = 200 * 1024;
  if (bytes > kMax) {
    throw_runtime(str_cat(op, ": the portable CUDA kernel needs ", bytes, " bytes of shared memory (more than ",
                          kMax, "): shape too large"));
  }
  if (bytes > 48 * 1024) set_max_dynamic_smem(kernel, bytes, op);
}

}  // namespace

void launch_ssd_prepare(const void* A_log, ParamType a_type, const void* D, ParamType d_type, const void* dt_bias,
                        ParamType b_type, float* out, int H, cudaStream_t stream) {
  ssd_prepare_kernel<<<ceil_div(H, 128), 128, 0, stream>>>(A_log, a_type, D, d_type, dt_bias, b_type, out, H);
  CHIMERA_LAUNCH_CHECK("ops::ssd_chunk_scan (prepare)");
}

template <typename T>
void launch_ssd_chunk_cumsum(const SsdParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.n_chunks), static_cast<unsigned>(ceil_div(p.H, 32)));
  ssd_chunk_cumsum_kernel<T><<<grid, kThreads, 0, stream>>>(p);
  CHIMERA_LAUNCH_CHECK("ops::ssd_chunk_scan (chunk_cumsum)");
}

template <typename S>
void launch_ssd_state_passing(const SsdParams& p, cudaStream_t stream) {
  const int64_t PN = static_cast<int64_t>(p.P) * p.N;
  const bool vec = PN % 4 == 0;  // then every (superchunk, head) block of PN floats is 16-byte aligned
  const dim3 grid(static_cast<unsigned>(ceil_div(vec ? PN / 4 : PN, kThreads)), static_cast<unsigned>(p.H),
                  static_cast<unsigned>(p.n_seqs));
  if (vec) {
    ssd_state_passing_kernel<S, 4><<<grid, kThreads, 0, stream>>>(p);
  } else {
    ssd_state_passing_kernel<S, 1><<<grid, kThreads, 0, stream>>>(p);
  }
  CHIMERA_LAUNCH_CHECK("ops::ssd_chunk_scan (state_passing)");
}

template <typename T>
void launch_ssd_chunk_state_portable(const SsdParams& p, cudaStream_t stream) {
  const size_t smem = pad4(static_cast<size_t>(p.chunk_size)) * sizeof(float);
  set_smem(ssd_chunk_state_portable_kernel<T>, smem, "ops::ssd_chunk_scan (chunk_state)");
  ssd_chunk_state_portable_kernel<T>
      <<<static_cast<unsigned>(p.n_chunks) * static_cast<unsigned>(p.H), kThreads, smem, stream>>>(p);
  CHIMERA_LAUNCH_CHECK("ops::ssd_chunk_scan (chunk_state)");
}

template <typename T>
void launch_ssd_chunk_scan_portable(const SsdParams& p, cudaStream_t stream) {
  const int tile_rows = scan_tile_rows(p.chunk_size);
  const size_t smem =
      (2 * pad4(static_cast<size_t>(p.chunk_size)) + pad4(static_cast<size_t>(tile_rows) * p.chunk_size)) *
      sizeof(float);
  set_smem(ssd_chunk_scan_portable_kernel<T>, smem, "ops::ssd_chunk_scan (chunk_scan)");
  ssd_chunk_scan_portable_kernel<T>
      <<<static_cast<unsigned>(p.n_chunks) * static_cast<unsigned>(p.H), kThreads, smem, stream>>>(p, tile_rows);
  CHIMERA_LAUNCH_CHECK("ops::ssd_chunk_scan (chunk_scan)");
}

template <typename T, typename S>
void launch_ssm_recurrence(const SsmRecurrenceParams& p, cudaStream_t stream) {
  const size_t smem =
      (pad4(static_cast<size_t>(p.P) * p.N) + 2 * pad4(static_cast<size_t>(p.N)) + pad4(static_cast<size_t>(p.P))) *
      sizeof(float);
  set_smem(ssm_recurrence_kernel<T, S>, smem, "ops::ssm_recurrence");
  ssm_recurrence_kernel<T, S>
      <<<static_cast<unsigned>(p.n_seqs) * static_cast<unsigned>(p.H), kThreads, smem, stream>>>(p);
  CHIMERA_LAUNCH_CHECK("ops::ssm_recurrence");
}

// Explicit instances: activations F32 / BF16 / F16; states F32 / BF16 / F16.
#define CHIMERA_SSD_FOR_T(T)                                                    \
  template void launch_ssd_chunk_cumsum<T>(const SsdParams&, cudaStream_t);    \
  template void launch_ssd_state_passing<T>(const SsdParams&, cudaStream_t);   \
  template void launch_ssd_chunk_state_portable<T>(const SsdParams&, cudaStream_t); \
  template void launch_ssd_chunk_scan_portable<T>(const SsdParams&, cudaStream_t);  \
  template void launch_ssm_recurrence<T, float>(const SsmRecurrenceParams&, cudaStream_t);          \
  template void launch_ssm_recurrence<T, __nv_bfloat16>(const SsmRecurrenceParams&, cudaStream_t);  \
  template void launch_ssm_recurrence<T, __half>(const SsmRecurrenceParams&, cudaStream_t);
CHIMERA_SSD_FOR_T(float)
CHIMERA_SSD_FOR_T(__nv_bfloat16)
CHIMERA_SSD_FOR_T(__half)
#undef CHIMERA_SSD_FOR_T

}  // namespace chimera::cuda
