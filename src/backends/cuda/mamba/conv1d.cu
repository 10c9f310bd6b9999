// Placeholder until the CUDA kernels of this family land: every entry fails loudly with the op's name.
#include "backends/cuda/cuda_ops.h"
#include "core/error_base.h"

namespace chimera::cuda {
namespace {
[[noreturn]] void not_yet(const char* op) { throw_runtime(str_cat("ops::", op, ": no CUDA kernel yet")); }
}  // namespace

void causal_conv1d(const ops::Context&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                   std::span<const int32_t>, std::span<const int32_t>, bool) {
  not_yet("causal_conv1d");
}
void causal_conv1d_update(const ops::Context&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                          const Tensor&, std::span<const int32_t>, bool) {
  not_yet("causal_conv1d_update");
}

}  // namespace chimera::cuda
