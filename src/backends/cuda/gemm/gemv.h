// Decode-size dense layers as a weight-streaming GEMV (gemv.cu has the design and the measured reason); used by
// cuda::linear for T <= kGemvMaxTokens with 16-bit weights, cuBLASLt otherwise.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.h"

namespace chimera::cuda::gemm {

constexpr int64_t kGemvMaxTokens = 8;
constexpr int64_t kGemvMaxSmemBytes = 100 * 1024;  // x staged in shared memory: tokens (rounded up to 1/2/4/8) x K x 2

// y_i[T, N_i] = x[T, K] @ w_i[N_i, K]^T (+ bias_i[N_i]) (then relu^2 when asked) for 1..kGemvMaxParts weight
// matrices of the same x in ONE launch (an attention layer's q, k and v projections: one weight stream instead of
// three dependent launches), all of one 16-bit dtype, contiguous rows. The launch's rows are the parts' rows one
// after the other (row r of part i is launch row N_0 + ... + N_{i-1} + r).
constexpr int kGemvMaxParts = 3;
struct GemvPart {
  const void* w = nullptr;
  const void* bias = nullptr;  // null: none
  void* y = nullptr;
  int N = 0;
};
struct GemvParams {
  const void* x = nullptr;
  GemvPart parts[kGemvMaxParts];
  int n_parts = 1;
  int T = 0, K = 0;
  int N = 0;              // the launch's rows: the sum of the parts' N
  int warps_per_row = 0;  // 1, 2, 4 or 8 warps share a row; 0: chosen at launch (launch_gemv has the rule)
};

// Whether the GEMV handles this shape: 1 <= T <= 8, K % 8 == 0, BF16/F16, 16-byte aligned x, w and y, x fits in
// shared memory.
bool gemv_supported(int64_t T, int64_t K, int64_t N, DType dtype, const void* x, const void* w, const void* y);
void launch_gemv(const GemvParams& p, DType dtype, bool relu2, cudaStream_t stream);

// The residual add + RMSNorm behind a decode layer's last dense layer, as an epilogue of its GEMV launch: once every
// block has written its rows of y, the last block to finish computes, for each of the T tokens,
//   residual += y (rounded to the activation dtype); out = rms_norm(residual) * weight
// i.e. exactly ops::add_rms_norm(residual, out, y, weight, eps), bit for bit: row_norm.cuh's kAdd kernel, in the
// thread layout of its own launch for a row of N elements (threads_per_row), run inside the GEMV's block. One
// launch instead of two on the decode critical path (the norm kernel's launch and grid dependency).
struct GemvNormEpilogue {
  void* residual = nullptr;      // [T, N] activation dtype, updated in place
  void* out = nullptr;           // [T, N] activation dtype
  const void* weight = nullptr;  // [N] activation dtype
  float eps = 0.0f;
};
// Whether the epilogue takes a row of N elements: one part, 16-byte aligned residual, out and weight, N % 8 == 0 and
// the norm kernel's threads per row for it (two 16-byte groups per thread) within the GEMV's 256-thread block, i.e.
// N <= 4096 (Nano's 2688, the 8B's and Super's 4096; the 47B / 56B's 8192 is not). The weight must have the activation
// dtype (the caller checks it). Otherwise the caller runs the norm kernel after launch_gemv.
bool gemv_norm_supported(const GemvParams& p, const GemvNormEpilogue& e);
// launch_gemv(p, dtype, false, stream) followed by the epilogue, in one launch; throws unless gemv_norm_supported.
void launch_gemv_add_rms_norm(const GemvParams& p, const GemvNormEpilogue& e, DType dtype, cudaStream_t stream);

}  // namespace chimera::cuda::gemm
