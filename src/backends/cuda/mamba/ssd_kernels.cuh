// SSD chunked scan (docs/model.md 3.4) and the plain recurrence (3.3) on CUDA: the params structs and the
// launchers shared by ssd.cu (the Tensor adapter), ssd_portable.cu (fp32 SIMT kernels, any shape and dtype)
// and ssd_mma.cu / ssd_mma_split.cu (bf16 / f16 tensor-core kernels for the Nemotron shape P = 64, N = 128,
// chunk 128).
//
// The prefill runs in five launches over a packed varlen batch whose chunk grid restarts at every sequence (and at
// every checkpoint's cut, where a superchunk starts too):
//   1. ssd_prepare       A = -exp(A_log), D, dt_bias -> fp32 [H]
//   2. chunk_cumsum      dt = clamp(softplus(dt_raw + dt_bias)), dA_cumsum within each chunk -> fp32 [H, T]
//   3. chunk_state       each "superchunk" (M consecutive chunks of one sequence) from a zero state:
//                        S = exp(Acum_c[last]) * S + sum_s exp(Acum_c[last] - Acum_c[s]) dt[s] x[s] B[s]^T,
//                        chunk by chunk -> states [n_supers, H, P, N] f32 and decay [n_supers, H] = prod_c exp(..)
//   4. state_passing     from ssm_state[slot]: entering[sc] <- the state entering superchunk sc; final -> ssm_state
//                        (and a checkpoint's slot <- the state entering the superchunk at its cut)
//   5. chunk_scan        per superchunk and head, chunk by chunk: y = Y_diag + exp(Acum) C S^T + D x, then the
//                        state advanced over the chunk (the chunk_state step) for the next chunk.
// Stage 5 runs with 16 warps per block on the tensor-core path (ssd_mma_split.cu).
// mamba_ssm materialises the state entering every chunk (M = 1); a superchunk of M chunks writes 1/M of
// that state traffic and pays one extra state step per chunk in the scan. The portable kernels use M = 1.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <span>
#include <vector>

#include "backends/cuda/cuda_common.cuh"
#include "ops/ops.h"

namespace chimera::cuda {

struct SsdParams {
  // Activations, all of the kernel's element type. Packed rows (token-major):
  const void* x = nullptr;       // [T, H, P]
  const void* dt_raw = nullptr;  // [T, H]
  const void* B = nullptr;       // [T, G, N]
  const void* C = nullptr;       // [T, G, N]
  void* y = nullptr;             // [T, H, P]
  void* ssm_state = nullptr;     // [num_slots, H, P, N] in the state's element type (F32, BF16 or F16)
  // Per-head fp32 parameters (written by launch_ssd_prepare): A = -exp(A_log), D, dt_bias, each [H].
  const float* A = nullptr;
  const float* D = nullptr;
  const float* dt_bias = nullptr;
  float dt_min = 0.0f;
  float dt_max = 0.0f;
  int T = 0, H = 0, P = 0, G = 0, N = 0;
  int heads_per_group = 1;
  int chunk_size = 0;
  // The plan (device copies of host-built tables):
  const int2* chunks = nullptr;  // [n_chunks] {begin row, end row}; never crosses a sequence
  const int2* supers = nullptr;  // [n_supers] {first chunk, chunk count}; consecutive chunks of one sequence
  // [n_seqs] {first super, end super, slot, position of the last token}; only non-pad, non-empty ones. The position
  // and state_seed key the stochastic rounding of an F16 final state (ops.h SsmParams).
  const int4* seqs = nullptr;
  // [n_supers] {slot, position of the row before it}, or nullptr: the state entering a superchunk that starts at a
  // checkpoint's cut (ops::StateCheckpoint) also goes to that slot, rounded like a final state (slot < 0: none).
  const int2* super_checkpoints = nullptr;
  uint64_t state_seed = 0;
  int n_chunks = 0, n_supers = 0, n_seqs = 0;
  // fp32 workspace:
  float* dt = nullptr;         // [H, T] discretised dt (head-major so a chunk of one head is contiguous)
  float* dA_cumsum = nullptr;  // [H, T] cumsum of dt * A within each chunk
  float* states = nullptr;     // [n_supers, H, P, N]: superchunk end states from a zero start (stage 3)
  float* entering = nullptr;   // [n_supers, H, P, N]: the state entering each superchunk (stage 4)
  float* decay = nullptr;      // [n_supers, H]: prod over the superchunk's chunks of exp(dA_cumsum[last])
};

// Element types of the fp32 parameter inputs (A_log, D, dt_bias may each be F32, BF16 or F16).
enum class ParamType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

// out: [3, H] f32 = {-exp(A_log), D, dt_bias}.
void launch_ssd_prepare(const void* A_log, ParamType a_type, const void* D, ParamType d_type, const void* dt_bias,
                        ParamType b_type, float* out, int H, cudaStream_t stream);

template <typename T>
void launch_ssd_chunk_cumsum(const SsdParams& p, cudaStream_t stream);
template <typename S>
void launch_ssd_state_passing(const SsdParams& p, cudaStream_t stream);

// Portable (SIMT fp32) stages 3 and 5: any P, N, chunk size and element type; superchunks of one chunk.
template <typename T>
void launch_ssd_chunk_state_portable(const SsdParams& p, cudaStream_t stream);
template <typename T>
void launch_ssd_chunk_scan_portable(const SsdParams& p, cudaStream_t stream);

// Tensor-core stages 3 and 5 (mma.sync m16n8k16, fp32 accumulation): T = __nv_bfloat16 or __half,
// P = kSsdMmaHeadDim, N = kSsdMmaStateSize, chunk_size = kSsdMmaChunk, 16-byte aligned x, B, C rows.
inline constexpr int kSsdMmaHeadDim = 64;
inline constexpr int kSsdMmaStateSize = 128;
inline constexpr int kSsdMmaChunk = 128;
// The causal 16 x 16 C.B^T tiles of one chunk (on or below the diagonal), which the scan deals to its warp groups.
inline constexpr int kSsdCbTiles = (kSsdMmaChunk / 16) * (kSsdMmaChunk / 16 + 1) / 2;  // 36
// The state pass (ssd_mma.cu): two heads of a group per block share one B tile.
template <typename T>
void launch_ssd_chunk_state_mma(const SsdParams& p, cudaStream_t stream);
// The scan (ssd_mma_split.cu): one block per (superchunk, head), each chunk's output columns, C.B^T tiles and state
// columns split over 16 warps; y goes through shared memory and out as whole 128-byte rows.
template <typename T>
void launch_ssd_chunk_scan_split_mma(const SsdParams& p, cudaStream_t stream);

// The plain per-token recurrence (docs/model.md 3.3), one block per (sequence, head).
struct SsmRecurrenceParams {
  const void* x = nullptr;       // [T, H, P]
  const void* dt_raw = nullptr;  // [T, H]
  const void* B = nullptr;       // [T, G, N]
  const void* C = nullptr;       // [T, G, N]
  void* y = nullptr;             // [T, H, P]
  void* ssm_state = nullptr;     // [num_slots, H, P, N]
  const float* A = nullptr;      // [H] prepared as above
  const float* D = nullptr;
  const float* dt_bias = nullptr;
  float dt_min = 0.0f, dt_max = 0.0f;
  int H = 0, P = 0, G = 0, N = 0, heads_per_group = 1;
  // [n_seqs] {begin row, end row, slot, position of the last token}; only non-pad, non-empty ones (SsdParams::seqs).
  const int4* seqs = nullptr;
  int n_seqs = 0;
  uint64_t state_seed = 0;
};
template <typename T, typename S>
void launch_ssm_recurrence(const SsmRecurrenceParams& p, cudaStream_t stream);

// ---- the host side of one ssd_chunk_scan call -----------------------------------------------------------
// Plans the chunk grid, uploads it, takes the workspace and runs the stages; cuda::ssd_chunk_scan is
// SsdRunner(...).run(), and the benchmark times the stages one by one. Inputs are validated by ops::.
// Benchmark options (the defaults are what ops::ssd_chunk_scan runs).
struct SsdOptions {
  int superchunk = 0;       // chunks per superchunk; 0 picks (see ssd.cu)
  bool portable = false;    // force the portable fp32 kernels (the benchmark's cross-check)
};

class SsdRunner {
 public:
  SsdRunner(const Tensor& y, const Tensor& x, const Tensor& dt_raw, const Tensor& B, const Tensor& C,
            const ops::SsmParams& sp, const Tensor& ssm_state, std::span<const int32_t> cu_seqlens,
            std::span<const int32_t> slots, int64_t chunk_size, cudaStream_t stream, SsdOptions options = {},
            std::span<const ops::StateCheckpoint> checkpoints = {});
  bool empty() const { return p_.n_chunks == 0; }  // every sequence a pad or empty: nothing to launch
  bool uses_mma() const { return use_mma_; }
  int superchunk() const { return superchunk_; }
  void prepare() const;        // stage 1
  void chunk_cumsum() const;   // stage 2
  void chunk_state() const;    // stage 3
  void state_passing() const;  // stage 4 (reads and writes ssm_state)
  void chunk_scan() const;     // stage 5
  void run() const;

 private:
  SsdParams p_;
  float* prepared_ = nullptr;  // [3, H] workspace written by prepare(): p_.A, p_.D, p_.dt_bias
  DType act_, state_;
  const void* A_log_;
  const void* D_;
  const void* dt_bias_;
  ParamType a_type_, d_type_, b_type_;
  bool use_mma_ = false;
  int superchunk_ = 1;
  SsdOptions options_;
  cudaStream_t stream_;
  Tensor workspace_;
};

// ---- shared device helpers --------------------------------------------------------------------------
// torch softplus with threshold 20, then the time_step_limit clamp (std::clamp order).
__device__ __forceinline__ float ssd_discretize_dt(float raw, float bias, float lo, float hi) {
  const float v = raw + bias;
  const float sp = v > 20.0f ? v : log1pf(expf(v));
  return sp < lo ? lo : (hi < sp ? hi : sp);
}

}  // namespace chimera::cuda
