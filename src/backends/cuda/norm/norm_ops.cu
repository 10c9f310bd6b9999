// Placeholder until the CUDA kernels of this family land: every entry fails loudly with the op's name.
#include "backends/cuda/cuda_ops.h"
#include "core/error_base.h"

namespace chimera::cuda {
namespace {
[[noreturn]] void not_yet(const char* op) { throw_runtime(str_cat("ops::", op, ": no CUDA kernel yet")); }
}  // namespace

void embedding(const ops::Context&, const Tensor&, const Tensor&, std::span<const int32_t>) { not_yet("embedding"); }
void rms_norm(const ops::Context&, const Tensor&, const Tensor&, const Tensor&, float) { not_yet("rms_norm"); }
void add_rms_norm(const ops::Context&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, float) {
  not_yet("add_rms_norm");
}
void gated_rms_norm(const ops::Context&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t, float) {
  not_yet("gated_rms_norm");
}

}  // namespace chimera::cuda
