// Explicit instances of the row-normalisation kernel for ops::add_moe_rms_norm (row_norm.cuh, NormMode::kAddMoe: the
// MoE combine, the add of the shared expert's output and the residual add + RMSNorm in one launch), in a translation
// unit of their own so the 9 (activation x weight dtype) instances compile in parallel with the others.
#include "backends/cuda/norm/row_norm.cuh"

namespace chimera::cuda::norm {

void launch_add_moe_rms_norm(const RowNormParams& p, DType act, DType weight, cudaStream_t stream,
                             int vecs_per_thread) {
  launch_row_norm<NormMode::kAddMoe>(p, act, weight, stream, "ops::add_moe_rms_norm", vecs_per_thread);
}

}  // namespace chimera::cuda::norm
