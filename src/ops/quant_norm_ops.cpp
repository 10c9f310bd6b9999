// Entry points of the FP8 activation quantizer and the fused norm + FP8 quant ops (ops/quant_norm_ops.h): shape,
// dtype and device checks (kRuntime errors naming the op and the tensors), then the backend.
#include "ops/quant_norm_ops.h"

#include <cmath>
#include <initializer_list>
#include <string>

#include "backends/cpu/quant_norm.h"
#include "core/error.h"
#ifdef CHIMERA_HAVE_CUDA
#include "backends/cuda/gemm/fp8_linear.h"
#define CHIMERA_CUDA_CALL(call) call
#else
#define CHIMERA_CUDA_CALL(call) ::chimera::runtime_error("this build of chimera has no CUDA backend")
#endif

namespace chimera::ops {
namespace {

std::string describe(const Tensor& t) {
  return t ? t.describe() : std::string("(undefined)");
}

bool float_dtype(DType d) {
  return d == DType::kF32 || d == DType::kBF16 || d == DType::kF16;
}

// The checks every op here shares: activations (2-D, F32 on the CPU, one float dtype), out_q (F8_E4M3 of the
// activation's shape), the norm weight ([weight_len], float), the scale, and one device for all of them.
void check(const char* op, const Context& ctx, const Tensor& out_q,
           std::initializer_list<std::pair<const char*, const Tensor*>> acts, const Tensor* weight, float input_scale) {
  const Tensor& a0 = *acts.begin()->second;
  for (const auto& [name, t] : acts) {
    if (!*t || t->ndim() != 2 || !float_dtype(t->dtype()) || t->device() != ctx.device) {
      runtime_error("ops::{}: {} {} must be a 2-D F32 / BF16 / F16 tensor on the context's device", op, name,
                    describe(*t));
    }
    if (ctx.device == Device::kCpu && t->dtype() != DType::kF32) {
      runtime_error("ops::{}: {} {} must be F32 on the CPU", op, name, t->describe());
    }
    if (t->dtype() != a0.dtype() || t->shape() != a0.shape()) {
      runtime_error("ops::{}: {} {} does not match {} {}", op, name, t->describe(), acts.begin()->first, a0.describe());
    }
  }
  if (!out_q || out_q.dtype() != DType::kF8E4M3 || out_q.shape() != a0.shape() || out_q.device() != ctx.device) {
    runtime_error("ops::{}: out_q {} must be F8_E4M3 shaped like {} {} on the context's device", op, describe(out_q),
                  acts.begin()->first, a0.describe());
  }
  if (weight != nullptr && (!*weight || weight->ndim() != 1 || weight->dim(0) != a0.dim(1) ||
                            !float_dtype(weight->dtype()) || weight->device() != ctx.device)) {
    runtime_error("ops::{}: weight {} must be a float [{}] on the context's device", op, describe(*weight), a0.dim(1));
  }
  if (!std::isfinite(input_scale) || input_scale <= 0.0f) {
    runtime_error("ops::{}: input_scale {} must be positive and finite", op, input_scale);
  }
}

}  // namespace

void quantize_fp8(const Context& ctx, const Tensor& out_q, const Tensor& x, float input_scale) {
  check("quantize_fp8", ctx, out_q, {{"x", &x}}, nullptr, input_scale);
  if (ctx.device == Device::kCpu) return cpu::quantize_fp8(out_q, x, input_scale);
  CHIMERA_CUDA_CALL(cuda::quantize_fp8(ctx, out_q, x, input_scale));
}

void add_rms_norm_fp8(const Context& ctx, const Tensor& residual, const Tensor& out_q, const Tensor& x,
                      const Tensor& weight, float eps, float input_scale) {
  check("add_rms_norm_fp8", ctx, out_q, {{"x", &x}, {"residual", &residual}}, &weight, input_scale);
  if (ctx.device == Device::kCpu) return cpu::add_rms_norm_fp8(residual, out_q, x, weight, eps, input_scale);
  CHIMERA_CUDA_CALL(cuda::add_rms_norm_fp8(ctx, residual, out_q, x, weight, eps, input_scale));
}

void gated_rms_norm_fp8(const Context& ctx, const Tensor& out_q, const Tensor& y, const Tensor& z, const Tensor& weight,
                        int64_t n_groups, float eps, float input_scale) {
  check("gated_rms_norm_fp8", ctx, out_q, {{"y", &y}, {"z", &z}}, &weight, input_scale);
  if (n_groups <= 0 || y.dim(1) % n_groups != 0) {
    runtime_error("ops::gated_rms_norm_fp8: n_groups {} does not divide y {}", n_groups, y.describe());
  }
  if (ctx.device == Device::kCpu) return cpu::gated_rms_norm_fp8(out_q, y, z, weight, n_groups, eps, input_scale);
  CHIMERA_CUDA_CALL(cuda::gated_rms_norm_fp8(ctx, out_q, y, z, weight, n_groups, eps, input_scale));
}

}  // namespace chimera::ops
