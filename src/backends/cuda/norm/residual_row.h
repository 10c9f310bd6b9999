// The arguments of the decode chain's residual step recomputed inside a consuming kernel (residual_row.cuh has the
// device code and the bit-identity argument). Plain data: included by launchers' params structs.
#pragma once

#include <cstdint>

#include "ops/ops.h"

namespace chimera::cuda::norm {

inline constexpr int kResidualRowVecs = 2;

// The step's inputs; 16-bit activations, K % 8 == 0, 16-byte aligned pointers, the weight in the activation dtype.
struct ResidualRowArgs {
  const void* residual = nullptr;  // [T, K]
  const void* a = nullptr;         // [T, K]
  const void* b = nullptr;         // [T, K] or null (add_rms_norm)
  void* residual_out = nullptr;    // [T, K]: the new residual; must not overlap residual, a or b
  const void* weight = nullptr;    // [K]
  float eps = 0.0f;
  int threads = 0;                 // the norm kernel's threads per row: norm::threads_per_row(K / 8, 2)
};

// The kernel arguments of rn's step when a block of block_threads threads can compute it (rows <= max_rows, 16-bit
// activations, the norm weight in their dtype, K % 8 == 0, 16-byte aligned, the norm kernel's layout at two vectors
// per thread with at most block_threads threads); false otherwise (the caller runs the two-op form). norm_ops.cu.
bool residual_row_args(const ops::ResidualNorm& rn, int block_threads, int64_t max_rows, ResidualRowArgs* args);

}  // namespace chimera::cuda::norm
