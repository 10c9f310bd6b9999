// Explicit instantiation of the selective state update kernels for bf16 state (a file per state dtype so the
// build parallelises).
#include "backends/cuda/mamba/selective_state_update_kernels.cuh"

namespace chimera::cuda {
template void launch_selective_state_update_typed<__nv_bfloat16>(const SsuParams&, cudaStream_t);
}  // namespace chimera::cuda
