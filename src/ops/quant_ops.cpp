// Entry points of the quantized linear layers (ops/quant_ops.h): checkpoint checks (kInvalidInput naming the
// module's tensor), the activation fake quantization, then the backend. Only the CPU reference exists so far.
#include "ops/quant_ops.h"

#include <cmath>
#include <cstring>
#include <span>

#include "backends/cpu/quant_ops.h"
#include "core/error.h"
#include "core/fp8.h"
#include "core/nvfp4.h"

namespace chimera::ops {
namespace {

void expect_dtype(const std::string& module, const char* tensor, const Tensor& t, DType want, const char* layout) {
  if (!t) invalid_input("{}.{}: missing ({} {})", module, tensor, dtype_name(want), layout);
  if (t.dtype() != want) {
    invalid_input("{}.{}: dtype {}, expected {} ({})", module, tensor, dtype_name(t.dtype()), dtype_name(want), layout);
  }
}

void expect_shape(const std::string& module, const char* tensor, const Tensor& t, const Shape& want,
                  const char* layout) {
  if (t.shape() != want) {
    invalid_input("{}.{}: shape {}, expected {} ({})", module, tensor, shape_str(t.shape()), shape_str(want), layout);
  }
}

// An F32 scalar (shape [] or [1]) on the host, finite and > 0.
float scalar(const std::string& module, const char* tensor, const Tensor& t) {
  expect_dtype(module, tensor, t, DType::kF32, "a scalar");
  if (t.numel() != 1 || t.ndim() > 1) {
    invalid_input("{}.{}: shape {}, expected [] or [1] (an F32 scalar)", module, tensor, shape_str(t.shape()));
  }
  if (t.device() != Device::kCpu) return 1.0f;  // device scalars are read by the kernels
  float v;
  std::memcpy(&v, t.data(), sizeof v);
  if (!std::isfinite(v) || v <= 0.0f) invalid_input("{}.{}: {} is not a positive finite scale", module, tensor, v);
  return v;
}

void check_activations(const char* op, const Context& ctx, const Tensor& out, const Tensor& x, int64_t N,
                       const Tensor& bias) {
  if (ctx.device != Device::kCpu) runtime_error("ops::{}: only the CPU reference exists (no CUDA kernel yet)", op);
  if (!x || x.dtype() != DType::kF32 || x.ndim() != 2 || x.device() != Device::kCpu) {
    runtime_error("ops::{}: x {} must be a 2-D F32 host tensor", op, x ? x.describe() : std::string("(undefined)"));
  }
  if (!out || out.dtype() != DType::kF32 || out.shape() != Shape{x.dim(0), N} || out.device() != Device::kCpu) {
    runtime_error("ops::{}: out {} must be F32 [{}, {}]", op, out ? out.describe() : std::string("(undefined)"),
                  x.dim(0), N);
  }
  if (bias && (bias.shape() != Shape{N} || !dtype_is_float(bias.dtype()))) {
    runtime_error("ops::{}: bias {} must be a float [{}]", op, bias.describe(), N);
  }
  const auto* po = static_cast<const char*>(out.data());
  const auto* px = static_cast<const char*>(x.data());
  if (po < px + x.nbytes() && px < po + out.nbytes()) runtime_error("ops::{}: out must not overlap x", op);
}

}  // namespace

void validate(const Fp8Linear& w, int64_t in_features, ActQuant act) {
  expect_dtype(w.name, "weight", w.weight, DType::kF8E4M3, "F8_E4M3 [N, K]");
  if (w.weight.ndim() != 2) invalid_input("{}.weight: shape {}, expected [N, K]", w.name, shape_str(w.weight.shape()));
  expect_shape(w.name, "weight", w.weight, {w.weight.dim(0), in_features}, "F8_E4M3 [N, K]");
  scalar(w.name, "weight_scale", w.weight_scale);
  if (act == ActQuant::kStatic || w.input_scale) scalar(w.name, "input_scale", w.input_scale);
}

void validate(const Nvfp4Linear& w, int64_t in_features) {
  if (in_features % kNvfp4BlockSize != 0) {
    invalid_input("{}.weight: NVFP4 needs in_features K a multiple of {}, got K = {}", w.name, kNvfp4BlockSize,
                  in_features);
  }
  expect_dtype(w.name, "weight", w.weight, DType::kU8, "U8 [N, K / 2], two E2M1 values a byte");
  if (w.weight.ndim() != 2) invalid_input("{}.weight: shape {}, expected [N, K / 2]", w.name, shape_str(w.weight.shape()));
  const int64_t N = w.weight.dim(0);
  expect_shape(w.name, "weight", w.weight, {N, in_features / 2}, "U8 [N, K / 2], two E2M1 values a byte");
  expect_dtype(w.name, "weight_scale", w.weight_scale, DType::kF8E4M3, "F8_E4M3 [N, K / 16]");
  expect_shape(w.name, "weight_scale", w.weight_scale, {N, in_features / kNvfp4BlockSize}, "F8_E4M3 [N, K / 16]");
  scalar(w.name, "weight_scale_2", w.weight_scale_2);
  if (w.input_scale) scalar(w.name, "input_scale", w.input_scale);
}

void fp8_linear(const Context& ctx, const Tensor& out, const Tensor& x, const Fp8Linear& w, ActQuant act,
                const Tensor& bias) {
  if (!x || x.ndim() != 2) runtime_error("ops::fp8_linear: x must be a 2-D tensor");
  validate(w, x.dim(1), act);
  check_activations("fp8_linear", ctx, out, x, w.weight.dim(0), bias);
  const float ws = scalar(w.name, "weight_scale", w.weight_scale);
  if (act == ActQuant::kNone) {
    cpu::fp8_linear(out, x, w.weight, ws, bias);
    return;
  }
  Tensor xq = Tensor::empty(DType::kF32, x.shape());
  std::memcpy(xq.data(), x.data(), x.nbytes());
  fake_quantize_fp8({xq.f32(), static_cast<size_t>(xq.numel())}, scalar(w.name, "input_scale", w.input_scale));
  cpu::fp8_linear(out, xq, w.weight, ws, bias);
}

void nvfp4_linear(const Context& ctx, const Tensor& out, const Tensor& x, const Nvfp4Linear& w, const Tensor& bias) {
  if (!x || x.ndim() != 2) runtime_error("ops::nvfp4_linear: x must be a 2-D tensor");
  validate(w, x.dim(1));
  check_activations("nvfp4_linear", ctx, out, x, w.weight.dim(0), bias);
  cpu::nvfp4_linear(out, x, w.weight, w.weight_scale, scalar(w.name, "weight_scale_2", w.weight_scale_2), bias);
}

}  // namespace chimera::ops
