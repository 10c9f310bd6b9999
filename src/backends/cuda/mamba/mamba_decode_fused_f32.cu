// Explicit instantiation of the fused Mamba-2 decode kernels for f32 SSM state (a file per state dtype so the
// build parallelises).
#include "backends/cuda/mamba/mamba_decode_fused_kernels.cuh"

namespace chimera::cuda {
template int mamba_decode_fused_typed<float>(const MambaDecodeParams&, cudaStream_t, bool);
}  // namespace chimera::cuda
