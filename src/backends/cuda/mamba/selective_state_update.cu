// ops::selective_state_update on CUDA: Tensors -> SsuParams, slots to the device, dispatch on the state dtype.
// Kernels: selective_state_update_kernels.cuh (instantiated per state dtype in selective_state_update_*.cu).
#include "backends/cuda/cuda_ops.h"
#include "backends/cuda/mamba/mamba_common.cuh"
#include "backends/cuda/mamba/selective_state_update.cuh"

namespace chimera::cuda {


void launch_selective_state_update(const SsuParams& p, cudaStream_t stream) {
  CHIMERA_DISPATCH_FLOAT(p.state_dtype, "ops::selective_state_update ssm_state", S,
                         launch_selective_state_update_typed<S>(p, stream));
}

void selective_state_update(const ops::Context& ctx, const Tensor& y, const Tensor& x, const Tensor& dt_raw,
                            const Tensor& B, const Tensor& C, const ops::SsmParams& sp, const Tensor& ssm_state,
                            const ops::Indices& slots, const ops::Indices& dst_slots) {
  // One activation dtype per call (the state and the [H] parameters may differ).
  for (const Tensor* t : {&y, &dt_raw, &B, &C}) {
    if (t->dtype() != x.dtype()) {
      throw_runtime(str_cat("ops::selective_state_update: activations must share one dtype on CUDA (x ",
                            x.describe(), ", got ", t->describe(), ")"));
    }
  }
  const cudaStream_t stream = as_stream(ctx.stream);
  SsuParams p;
  p.x = x.data();
  p.dt_raw = dt_raw.data();
  p.B = B.data();
  p.C = C.data();
  p.y = y.data();
  p.state = ssm_state.data();
  p.A_log = sp.A_log.data();
  p.D = sp.D.data();
  p.dt_bias = sp.dt_bias.data();
  p.act = x.dtype();
  p.state_dtype = ssm_state.dtype();
  p.a_log_dtype = sp.A_log.dtype();
  p.d_dtype = sp.D.dtype();
  p.dt_bias_dtype = sp.dt_bias.dtype();
  p.dt_min = sp.dt_min;
  p.dt_max = sp.dt_max;
  p.batch = static_cast<int>(x.dim(0));
  p.H = static_cast<int>(x.dim(1));
  p.P = static_cast<int>(x.dim(2));
  p.G = static_cast<int>(B.dim(1));
  p.N = static_cast<int>(B.dim(2));
  p.auto_dynamic = ctx.kernels.ssu_dynamic_split;
  if (p.batch == 0) return;
  p.slots = device_indices(slots, stream, 0);
  p.dst_slots = dst_slots.empty() ? nullptr : device_indices(dst_slots, stream, 1);  // nullptr: in place
  p.state_seed = sp.state_seed;
  if (ssm_state.dtype() == DType::kF16 && !sp.context_lens.empty()) {
    p.positions = device_indices(sp.context_lens, stream, 2);
  }
  launch_selective_state_update(p, stream);
}

}  // namespace chimera::cuda
