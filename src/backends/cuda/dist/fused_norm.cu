// The NCCL path's epilogue (NCCL has no fusion): ncclAllReduce has written the full sum; this one
// kernel adds the residual, normalises and quantises with the same fuse_row as the custom kernels, so all
// three strategies share one definition of the fused math. Also the Lamport buffer fill.
#include "backends/cuda/dist/fusion_common.cuh"

namespace chimera::cuda::dist {

namespace {

// sum (a.input), outputs: [tokens, hidden] T. a.input may alias a.norm_out: each thread loads its vectors of
// a row before the block reduction and stores them after it.
template <typename T, FusionPattern P, int kItems>
__global__ void __launch_bounds__(kMaxThreads) fused_norm_kernel(const FusionArgs a) {
  constexpr int kN = VecOf<T>::kN;
  const int n_vecs = a.hidden / kN;
  for (int64_t row = blockIdx.x; row < a.tokens; row += gridDim.x) {
    float acc[kItems][kN] = {};
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int vi = static_cast<int>(threadIdx.x) + i * static_cast<int>(blockDim.x);
      if (vi < n_vecs) add_unpacked<T>(reinterpret_cast<const uint4*>(a.input)[row * n_vecs + vi], acc[i]);
    }
    fuse_row<T, P, kItems>(acc, row, n_vecs, a);
  }
}

template <typename T, FusionPattern P, int kItems>
void launch(const FusionArgs& a, const RowShape& s, cudaStream_t stream) {
  // Not a peer kernel: any grid works; one block a row up to a few waves.
  const int64_t blocks = std::min<int64_t>(a.tokens, 132 * 8);
  fused_norm_kernel<T, P, kItems><<<static_cast<int>(blocks), s.threads, 0, stream>>>(a);
}

__global__ void lamport_fill_kernel(uint32_t* p, size_t words) {
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < words;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    p[i] = chimera::dist::kLamportEmpty32;
  }
}

}  // namespace

void launch_fused_norm(DType dtype, FusionPattern pattern, const FusionArgs& args, void* stream) {
  if (pattern == FusionPattern::kAllReduce) return;
  CHIMERA_DISPATCH_FLOAT(dtype, "dist::fused_norm", T, {
    const RowShape s = row_shape(args.hidden, static_cast<int>(sizeof(T)));
    CHIMERA_DIST_DISPATCH_PATTERN(pattern, "dist::fused_norm", {
      CHIMERA_DIST_DISPATCH_ITEMS(s.items, "dist::fused_norm", (launch<T, P, kItems>(args, s, as_stream(stream))));
    });
  });
  CHIMERA_LAUNCH_CHECK("dist::fused_norm");
}

void launch_lamport_fill(void* buffer, size_t bytes, void* stream) {
  lamport_fill_kernel<<<1024, 256, 0, as_stream(stream)>>>(static_cast<uint32_t*>(buffer), bytes / 4);
  CHIMERA_LAUNCH_CHECK("dist::lamport_fill");
}

}  // namespace chimera::cuda::dist
