// Explicit instances of the row-normalisation kernel for ops::gated_rms_norm (row_norm.cuh), one translation unit per
// mode so the 9 (activation x weight dtype) instances of each compile in parallel.
#include "backends/cuda/norm/row_norm.cuh"

namespace chimera::cuda::norm {

void launch_gated_rms_norm(const RowNormParams& p, DType act, DType weight, cudaStream_t stream, int vecs_per_thread) {
  launch_row_norm<NormMode::kGated>(p, act, weight, stream, "ops::gated_rms_norm", vecs_per_thread);
}

}  // namespace chimera::cuda::norm
