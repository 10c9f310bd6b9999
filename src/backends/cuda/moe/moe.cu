// Placeholder until the CUDA kernels of this family land: every entry fails loudly with the op's name.
#include "backends/cuda/cuda_ops.h"
#include "core/error_base.h"

namespace chimera::cuda {
namespace {
[[noreturn]] void not_yet(const char* op) { throw_runtime(str_cat("ops::", op, ": no CUDA kernel yet")); }
}  // namespace

void router_topk(const ops::Context&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                 const ops::RouterParams&) {
  not_yet("router_topk");
}
void moe_experts(const ops::Context&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                 std::span<const Tensor>, std::span<const Tensor>) {
  not_yet("moe_experts");
}

}  // namespace chimera::cuda
