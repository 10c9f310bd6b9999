// ops::mamba_decode_update on CUDA: Tensors -> MambaDecodeParams, slots to the device, dispatch on the SSM state
// dtype. Kernel: mamba_decode_fused_kernels.cuh (instantiated per state dtype in mamba_decode_fused_*.cu).
#include <algorithm>
#include <cstdlib>

#include "backends/cuda/cuda_ops.h"
#include "backends/cuda/mamba/mamba_common.cuh"
#include "backends/cuda/mamba/mamba_decode_fused.cuh"

namespace chimera::cuda {

namespace {

// Everything but the slots and the stream. Shapes were validated by ops::mamba_decode_update.
MambaDecodeParams decode_params(const Tensor& out, const Tensor& zxbcdt, const Tensor& conv_weight,
                                const Tensor& conv_bias, const ops::SsmParams& sp, const Tensor& norm_weight,
                                int64_t n_groups, float eps, const Tensor& conv_state, const Tensor& ssm_state) {
  MambaDecodeParams p;
  p.zxbcdt = zxbcdt.data();
  p.out = out ? out.data() : nullptr;
  p.conv_weight = conv_weight.data();
  p.conv_bias = conv_bias ? conv_bias.data() : nullptr;
  p.conv_state = conv_state.data();
  p.ssm_state = ssm_state.data();
  p.A_log = sp.A_log.data();
  p.D = sp.D.data();
  p.dt_bias = sp.dt_bias.data();
  p.norm_weight = norm_weight.data();
  p.act = zxbcdt.dtype();
  p.conv_weight_dtype = conv_weight.dtype();
  p.conv_bias_dtype = conv_bias ? conv_bias.dtype() : DType::kF32;
  p.conv_state_dtype = conv_state.dtype();
  p.ssm_state_dtype = ssm_state.dtype();
  p.a_log_dtype = sp.A_log.dtype();
  p.d_dtype = sp.D.dtype();
  p.dt_bias_dtype = sp.dt_bias.dtype();
  p.norm_weight_dtype = norm_weight.dtype();
  p.dt_min = sp.dt_min;
  p.dt_max = sp.dt_max;
  p.eps = eps;
  p.batch = static_cast<int>(zxbcdt.dim(0));
  p.H = static_cast<int>(ssm_state.dim(1));
  p.P = static_cast<int>(ssm_state.dim(2));
  p.N = static_cast<int>(ssm_state.dim(3));
  p.G = static_cast<int>(n_groups);
  p.K = static_cast<int>(conv_weight.dim(-1));
  return p;
}

bool supported_dtype(DType t) { return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16; }

}  // namespace

int mamba_decode_fused_cluster(const MambaDecodeParams& p) {
  if (!supported_dtype(p.act) || !supported_dtype(p.ssm_state_dtype) || !supported_dtype(p.conv_state_dtype)) return 0;
  int cs = 0;
  CHIMERA_DISPATCH_FLOAT(p.ssm_state_dtype, "ops::mamba_decode_update ssm_state", S,
                         cs = mamba_decode_fused_typed<S>(p, nullptr, false));
  return cs;
}

void launch_mamba_decode_fused(const MambaDecodeParams& p, cudaStream_t stream) {
  if (p.batch == 0) return;
  int cs = 0;
  CHIMERA_DISPATCH_FLOAT(p.ssm_state_dtype, "ops::mamba_decode_update ssm_state", S,
                         cs = mamba_decode_fused_typed<S>(p, stream, true));
  if (cs == 0) {
    throw_runtime(str_cat("ops::mamba_decode_update: the fused kernel does not take H ", p.H, " P ", p.P, " N ", p.N,
                          " G ", p.G, " K ", p.K, " (check mamba_decode_fused_cluster first)"));
  }
  CHIMERA_LAUNCH_CHECK("ops::mamba_decode_update");
}

bool mamba_decode_fusable(const Tensor& zxbcdt, const Tensor& conv_weight, const Tensor& conv_state,
                          const Tensor& ssm_state, int64_t n_groups) {
  // The parameter tensors do not affect the choice: any placeholder pointers do for the plan.
  MambaDecodeParams p;
  p.zxbcdt = zxbcdt.data();
  p.ssm_state = ssm_state.data();
  p.act = zxbcdt.dtype();
  p.conv_state_dtype = conv_state.dtype();
  p.ssm_state_dtype = ssm_state.dtype();
  p.batch = static_cast<int>(std::min<int64_t>(zxbcdt.dim(0), 1 << 30));
  p.H = static_cast<int>(ssm_state.dim(1));
  p.P = static_cast<int>(ssm_state.dim(2));
  p.N = static_cast<int>(ssm_state.dim(3));
  p.G = static_cast<int>(n_groups);
  p.K = static_cast<int>(conv_weight.dim(-1));
  return mamba_decode_fused_cluster(p) > 0;
}

void mamba_decode_update(const ops::Context& ctx, const Tensor& out, const Tensor& zxbcdt, const Tensor& conv_weight,
                         const Tensor& conv_bias, const ops::SsmParams& sp, const Tensor& norm_weight,
                         int64_t n_groups, float eps, const Tensor& conv_state, const Tensor& ssm_state,
                         const ops::Indices& slots, bool prefetch_states) {
  if (out.dtype() != zxbcdt.dtype()) {
    throw_runtime(str_cat("ops::mamba_decode_update: out ", out.describe(), " must have the dtype of zxbcdt ",
                          zxbcdt.describe(), " on CUDA"));
  }
  MambaDecodeParams p =
      decode_params(out, zxbcdt, conv_weight, conv_bias, sp, norm_weight, n_groups, eps, conv_state, ssm_state);
  if (p.batch == 0) return;
  const cudaStream_t stream = as_stream(ctx.stream);
  p.slots = device_indices(slots, stream, 0);
  p.state_seed = sp.state_seed;
  if (ssm_state.dtype() == DType::kF16 && !sp.context_lens.empty()) {
    p.positions = device_indices(sp.context_lens, stream, 2);
  }
  // A host slot list goes up by a copy right before the kernel: a full dependency, so the states are settled anyway.
  // ctx.kernels.mamba_prefetch_states off keeps the loads after the wait (same results).
  p.states_before_wait = prefetch_states && ctx.kernels.mamba_prefetch_states;
  launch_mamba_decode_fused(p, stream);
}

}  // namespace chimera::cuda
