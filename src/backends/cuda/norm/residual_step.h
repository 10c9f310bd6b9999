// Host side of the residual step recomputed inside a consuming kernel (residual_row.h / residual_row.cuh): whether
// a block can compute an ops::ResidualNorm, and its kernel arguments. Separate from residual_row.h so that kernel
// params headers do not pull in the framework's types (the CUTLASS translation unit has its own Shape).
#pragma once

#include <cstdint>

#include "backends/cuda/norm/residual_row.h"
#include "ops/ops.h"

namespace chimera::cuda::norm {

// The kernel arguments of rn's step when a block of block_threads threads can compute it (rows <= max_rows, 16-bit
// activations, the norm weight in their dtype, K % 8 == 0, 16-byte aligned, the norm kernel's layout at two vectors
// per thread with at most block_threads threads); false otherwise (the caller runs the two-op form). norm_ops.cu.
bool residual_row_args(const ops::ResidualNorm& rn, int block_threads, int64_t max_rows, ResidualRowArgs* args);

}  // namespace chimera::cuda::norm
