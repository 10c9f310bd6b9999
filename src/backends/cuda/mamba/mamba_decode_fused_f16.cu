// Explicit instantiation of the fused Mamba-2 decode kernels for f16 SSM state (a file per state dtype so the
// build parallelises).
#include "backends/cuda/mamba/mamba_decode_fused_kernels.cuh"

namespace chimera::cuda {
template int mamba_decode_fused_typed<__half>(const MambaDecodeParams&, cudaStream_t, bool);
}  // namespace chimera::cuda
