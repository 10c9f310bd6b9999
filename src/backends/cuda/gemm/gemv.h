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
// x computed by every block instead of read (ops::residual_norm_linear: the decode chain's residual add + RMSNorm
// folded into the dense layer that consumes it, one launch fewer): x[t] = weight * rms_norm(residual[t] + a[t]),
// or + round(a[t] + b[t]) when b is set, with the sum of squares and the roundings of the norm kernel
// (norm/row_norm.cuh, NormMode::kAdd / kAdd2) at its thread layout for the row (`threads` threads of
// kGemvNormVecs 8-element vectors each, threads <= 256): x is bit-identical to add_rms_norm's output. Block 0 writes
// the new residual to residual_out, which must not overlap residual, a or b (every block reads those). Needs
// 16-bit activations, K % 8 == 0, weight in the activation dtype, 16-byte aligned pointers. residual null: off.
constexpr int kGemvNormVecs = 2;
struct GemvResidualNorm {
  const void* residual = nullptr;  // [T, K]
  const void* a = nullptr;         // [T, K]
  const void* b = nullptr;         // [T, K] or null
  void* residual_out = nullptr;    // [T, K]
  const void* weight = nullptr;    // [K]
  float eps = 0.0f;
  int threads = 0;
};

struct GemvParams {
  const void* x = nullptr;  // unused (null) when norm.residual is set
  GemvResidualNorm norm;
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

}  // namespace chimera::cuda::gemm
