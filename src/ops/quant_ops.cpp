// Entry points of the quantized linear layers (ops/quant_ops.h): checkpoint checks (kInvalidInput naming the
// module's tensor), the activation fake quantization, then the backend: the CPU reference here, the quantized CUDA
// kernels (backends/cuda/gemm, backends/cuda/moe) in a CUDA build.
#include "ops/quant_ops.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <span>
#include <vector>

#include "backends/cpu/quant_ops.h"
#include "backends/device_api.h"
#include "core/error.h"
#include "core/fp8.h"
#include "core/nvfp4.h"
#include "runtime/profiler.h"
#ifdef CHIMERA_HAVE_CUDA
#include "backends/cuda/gemm/fp8_linear.h"
#include "backends/cuda/gemm/nvfp4_linear.h"
#include "backends/cuda/moe/fp8_experts.h"
#include "backends/cuda/moe/nvfp4_experts.h"
#define CHIMERA_CUDA_CALL(call) call
#else
#define CHIMERA_CUDA_CALL(call) ::chimera::runtime_error("this build of chimera has no CUDA backend")
#endif

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

// ---- LinearWeight / ExpertWeights -----------------------------------------------------------------------

namespace {

void positive_scale(const std::string& module, const char* tensor, float v) {
  if (!std::isfinite(v) || v <= 0.0f) invalid_input("{}.{}: {} is not a positive finite scale", module, tensor, v);
}

// The checks shared by a linear layer and one expert's view: `what` says where the weight sits in its tensor.
void validate_linear(const LinearWeight& w) {
  switch (w.format) {
    case WeightFormat::kDense:
      if (!w.weight || !dtype_is_float(w.weight.dtype()) || w.weight.ndim() != 2) {
        invalid_input("{}.weight: {}, expected a float [N, K] tensor", w.name,
                      w.weight ? w.weight.describe() : std::string("missing"));
      }
      if (w.act != ActQuant::kNone) invalid_input("{}: a dense weight takes no activation quantization", w.name);
      return;
    case WeightFormat::kFp8:
      expect_dtype(w.name, "weight", w.weight, DType::kF8E4M3, "F8_E4M3 [N, K]");
      if (w.weight.ndim() != 2) invalid_input("{}.weight: shape {}, expected [N, K]", w.name, shape_str(w.weight.shape()));
      positive_scale(w.name, "weight_scale", w.scale);
      if (w.act == ActQuant::kStatic) positive_scale(w.name, "input_scale", w.input_scale);
      return;
    case WeightFormat::kNvfp4: {
      expect_dtype(w.name, "weight", w.weight, DType::kU8, "U8 [N, K / 2], two E2M1 values a byte");
      if (w.weight.ndim() != 2) {
        invalid_input("{}.weight: shape {}, expected [N, K / 2]", w.name, shape_str(w.weight.shape()));
      }
      const int64_t N = w.weight.dim(0), K = w.in_features();
      if (K % kNvfp4BlockSize != 0) {
        invalid_input("{}.weight: NVFP4 needs in_features K a multiple of {}, got K = {}", w.name, kNvfp4BlockSize, K);
      }
      expect_dtype(w.name, "weight_scale", w.weight_scale, DType::kF8E4M3, "F8_E4M3 [N, K / 16]");
      expect_shape(w.name, "weight_scale", w.weight_scale, {N, K / kNvfp4BlockSize}, "F8_E4M3 [N, K / 16]");
      positive_scale(w.name, "weight_scale_2", w.scale);
      if (w.act != ActQuant::kNone) {
        invalid_input("{}: NVFP4 runs weight-only here (activations unquantized); {} FP8 activation "
                      "quantization does not apply to it", w.name, act_quant_name(w.act));
      }
      return;
    }
  }
  invalid_input("{}: unknown weight format", w.name);
}

// The CPU reference of one quantized linear layer: x [T, K] F32 host, out [T, N] F32 host.
void cpu_linear(const Tensor& out, const Tensor& x, const LinearWeight& w, const Tensor& bias) {
  switch (w.format) {
    case WeightFormat::kDense: runtime_error("ops::linear: dense weights take the dense op");
    case WeightFormat::kFp8: {
      if (w.act == ActQuant::kNone) {
        cpu::fp8_linear(out, x, w.weight, w.scale, bias);
        return;
      }
      Tensor xq = Tensor::empty(DType::kF32, x.shape());
      std::memcpy(xq.data(), x.data(), x.nbytes());
      const std::span<float> v(xq.f32(), static_cast<size_t>(xq.numel()));
      if (w.act == ActQuant::kDynamic) {
        fake_quantize_fp8_dynamic(v);
      } else {
        fake_quantize_fp8(v, w.input_scale);
      }
      cpu::fp8_linear(out, xq, w.weight, w.scale, bias);
      return;
    }
    case WeightFormat::kNvfp4: cpu::nvfp4_linear(out, x, w.weight, w.weight_scale, w.scale, bias); return;
  }
}

// Activation checks of the quantized ops: on the CPU every activation is an F32 host tensor.
void check_act(const char* op, const Context& ctx, const char* name, const Tensor& t, const Shape& want) {
  if (!t) runtime_error("ops::{}: {} is undefined", op, name);
  if (t.device() != ctx.device) runtime_error("ops::{}: {} {} is not on the context's device", op, name, t.describe());
  if (ctx.device == Device::kCpu && t.dtype() != DType::kF32) {
    runtime_error("ops::{}: {} {} must be F32 on the CPU", op, name, t.describe());
  }
  if (t.shape() != want) runtime_error("ops::{}: {} {} must have shape {}", op, name, t.describe(), shape_str(want));
}

bool all_dense(std::span<const LinearWeight* const> ws) {
  return std::all_of(ws.begin(), ws.end(), [](const LinearWeight* w) { return w->format == WeightFormat::kDense; });
}

template <size_t N>
std::array<Tensor, N> dense_weights(std::span<const LinearWeight* const> ws) {
  std::array<Tensor, N> r;
  for (size_t i = 0; i < ws.size(); ++i) r[i] = ws[i]->weight;
  return r;
}

// Per-expert views of a dense ExpertWeights' [E, N, K] buffer.
std::vector<Tensor> expert_views(const ExpertWeights& w) {
  std::vector<Tensor> v;
  v.reserve(static_cast<size_t>(w.num_experts()));
  for (int64_t e = 0; e < w.num_experts(); ++e) v.push_back(w.weight.select(e));
  return v;
}

template <typename CpuFn, typename CudaFn>
void dispatch(const Context& ctx, const char* op, CpuFn&& cpu_fn, CudaFn&& cuda_fn) {
  const ProfileScope profile(ctx.profiler, op, ctx.stream);
  if (ctx.device == Device::kCpu) {
    cpu_fn();
    return;
  }
  const device::LaunchScope launch_scope(ctx.kernels.pdl);
  cuda_fn();
}

}  // namespace

void validate(const LinearWeight& w) { validate_linear(w); }

void validate(const ExpertWeights& w) {
  if (!w.weight || w.weight.ndim() != 3) {
    invalid_input("{}.weight: {}, expected [E, N, K]", w.name, w.weight ? w.weight.describe() : std::string("missing"));
  }
  const int64_t E = w.num_experts();
  if (w.format != WeightFormat::kDense) {
    if (static_cast<int64_t>(w.host_scale.size()) != E || !w.scale || w.scale.numel() != E) {
      invalid_input("{}: {} per-expert weight scales for {} experts", w.name, w.host_scale.size(), E);
    }
    if (w.act == ActQuant::kStatic &&
        (static_cast<int64_t>(w.host_input_scale.size()) != E || !w.input_scale || w.input_scale.numel() != E)) {
      invalid_input("{}: {} per-expert input scales for {} experts", w.name, w.host_input_scale.size(), E);
    }
    if (w.format == WeightFormat::kNvfp4 && (!w.weight_scale || w.weight_scale.ndim() != 3 || w.weight_scale.dim(0) != E)) {
      invalid_input("{}.weight_scale: {}, expected F8_E4M3 [E, N, K / 16]", w.name,
                    w.weight_scale ? w.weight_scale.describe() : std::string("missing"));
    }
  }
  for (int64_t e = 0; e < E; ++e) validate_linear(w.expert(e));
}

void linear(const Context& ctx, const Tensor& out, const Tensor& x, const LinearWeight& w, const Tensor& bias) {
  if (w.format == WeightFormat::kDense) {
    linear(ctx, out, x, w.weight, bias);
    return;
  }
  validate_linear(w);
  if (!x || x.ndim() != 2) runtime_error("ops::linear: x must be a 2-D tensor ({})", w.name);
  check_act("linear", ctx, "x", x, {x.dim(0), w.in_features()});
  check_act("linear", ctx, "out", out, {x.dim(0), w.out_features()});
  if (bias && (bias.shape() != Shape{w.out_features()} || !dtype_is_float(bias.dtype()))) {
    runtime_error("ops::linear: bias {} must be a float [{}] ({})", bias.describe(), w.out_features(), w.name);
  }
  const auto* po = static_cast<const char*>(out.data());
  const auto* px = static_cast<const char*>(x.data());
  if (po < px + x.nbytes() && px < po + out.nbytes()) runtime_error("ops::linear: out must not overlap x");
  const bool fp8 = w.format == WeightFormat::kFp8;
  dispatch(
      ctx, fp8 ? "fp8_linear" : "nvfp4_linear", [&] { cpu_linear(out, x, w, bias); },
      [&] {
        if (fp8) {
          CHIMERA_CUDA_CALL(cuda::fp8_linear(ctx, out, x, w, bias));
        } else {
          CHIMERA_CUDA_CALL(cuda::nvfp4_linear(ctx, out, x, w, bias));
        }
      });
}

void linear_multi(const Context& ctx, std::span<const Tensor> outs, const Tensor& x,
                  std::span<const LinearWeight* const> weights) {
  if (outs.size() != weights.size() || weights.empty() || weights.size() > 3) {
    runtime_error("ops::linear_multi: {} outputs for {} weights (1 to 3 of each)", outs.size(), weights.size());
  }
  if (all_dense(weights)) {
    const std::array<Tensor, 3> w = dense_weights<3>(weights);
    linear_multi(ctx, outs, x, std::span<const Tensor>(w.data(), weights.size()));
    return;
  }
  for (size_t i = 0; i < weights.size(); ++i) linear(ctx, outs[i], x, *weights[i]);
}

void residual_norm_linear(const Context& ctx, const ResidualNorm& rn, std::span<const Tensor> outs,
                          std::span<const LinearWeight* const> weights, const Tensor& bias) {
  if (outs.size() != weights.size() || weights.empty() || weights.size() > 3) {
    runtime_error("ops::residual_norm_linear: {} outputs for {} weights (1 to 3 of each)", outs.size(),
                  weights.size());
  }
  if (bias && weights.size() != 1) runtime_error("ops::residual_norm_linear: a bias needs exactly one weight");
  if (all_dense(weights)) {
    const std::array<Tensor, 3> w = dense_weights<3>(weights);
    residual_norm_linear(ctx, rn, outs, std::span<const Tensor>(w.data(), weights.size()), bias);
    return;
  }
  // The residual step (one launch, residual written out of place), then the quantized layers: the same arithmetic
  // as the dense op's CPU reference.
  residual_rms_norm(ctx, rn);
  for (size_t i = 0; i < weights.size(); ++i) linear(ctx, outs[i], rn.x, *weights[i], bias);
}

void relu2_mlp(const Context& ctx, const Tensor& out, const Tensor& x, const LinearWeight& up_proj,
               const LinearWeight& down_proj) {
  if (up_proj.format == WeightFormat::kDense && down_proj.format == WeightFormat::kDense) {
    relu2_mlp(ctx, out, x, up_proj.weight, down_proj.weight);
    return;
  }
  if (!x || x.ndim() != 2) runtime_error("ops::relu2_mlp: x must be a 2-D tensor ({})", up_proj.name);
  Tensor h = device::empty(ctx.device, x.dtype(), {x.dim(0), up_proj.out_features()});
  linear(ctx, h, x, up_proj);
  relu2(ctx, h);
  linear(ctx, out, h, down_proj);
}

void moe_experts(const Context& ctx, const Tensor& out, const Tensor& x, const Tensor& topk_ids,
                 const Tensor& topk_weights, const ExpertWeights& up_proj, const ExpertWeights& down_proj) {
  if (up_proj.format == WeightFormat::kDense && down_proj.format == WeightFormat::kDense) {
    const std::vector<Tensor> up = expert_views(up_proj), down = expert_views(down_proj);
    moe_experts(ctx, out, x, topk_ids, topk_weights, up, down);
    return;
  }
  if (up_proj.format != down_proj.format) {
    invalid_input("{} is {} but {} is {}: a MoE layer's experts need one format", up_proj.name,
                  weight_format_name(up_proj.format), down_proj.name, weight_format_name(down_proj.format));
  }
  validate(up_proj);
  validate(down_proj);
  const int64_t E = up_proj.num_experts(), I = up_proj.out_features();
  if (!x || x.ndim() != 2) runtime_error("ops::moe_experts: x must be a 2-D tensor ({})", up_proj.name);
  const int64_t T = x.dim(0), Din = x.dim(1);
  if (up_proj.in_features() != Din || down_proj.num_experts() != E || down_proj.out_features() != Din ||
      down_proj.in_features() != I) {
    runtime_error("ops::moe_experts: experts up [{}, {}, {}] / down [{}, {}, {}] do not fit x [{}, {}]", E, I,
                  up_proj.in_features(), down_proj.num_experts(), down_proj.out_features(), down_proj.in_features(),
                  T, Din);
  }
  check_act("moe_experts", ctx, "out", out, x.shape());
  if (!topk_ids || topk_ids.dtype() != DType::kI32 || topk_ids.ndim() != 2 || topk_ids.dim(0) != T) {
    runtime_error("ops::moe_experts: topk_ids must be I32 [{}, k]", T);
  }
  const int64_t k = topk_ids.dim(1);
  if (!topk_weights || topk_weights.dtype() != DType::kF32 || topk_weights.shape() != topk_ids.shape()) {
    runtime_error("ops::moe_experts: topk_weights must be F32 [{}, {}]", T, k);
  }
  const bool fp8 = up_proj.format == WeightFormat::kFp8;
  dispatch(
      ctx, fp8 ? "moe_experts_fp8" : "moe_experts_nvfp4",
      [&] {
        check_act("moe_experts", ctx, "x", x, x.shape());
        const int32_t* ids = topk_ids.i32();
        std::vector<std::vector<int64_t>> pairs(static_cast<size_t>(E));
        for (int64_t i = 0; i < T * k; ++i) {
          if (ids[i] < -1 || ids[i] >= E) runtime_error("ops::moe_experts: topk_ids[{}] = {} out of range", i, ids[i]);
          if (ids[i] >= 0) pairs[static_cast<size_t>(ids[i])].push_back(i);  // -1: another rank's expert
        }
        out.fill_f32(0.0f);
        // Experts in increasing index order, each one's contribution added as it finishes (the dense
        // reference's order, HF eager's index_add_ loop).
        for (int64_t e = 0; e < E; ++e) {
          const auto& pe = pairs[static_cast<size_t>(e)];
          const auto n = static_cast<int64_t>(pe.size());
          if (n == 0) continue;
          Tensor xs = Tensor::empty(DType::kF32, {n, Din}), h = Tensor::empty(DType::kF32, {n, I});
          Tensor ys = Tensor::empty(DType::kF32, {n, Din});
          for (int64_t r = 0; r < n; ++r) {
            std::memcpy(xs.f32() + r * Din, x.f32() + (pe[static_cast<size_t>(r)] / k) * Din,
                        static_cast<size_t>(Din) * sizeof(float));
          }
          cpu_linear(h, xs, up_proj.expert(e), Tensor());
          for (int64_t i = 0; i < n * I; ++i) {
            const float v = std::max(h.f32()[i], 0.0f);
            h.f32()[i] = v * v;
          }
          cpu_linear(ys, h, down_proj.expert(e), Tensor());
          for (int64_t r = 0; r < n; ++r) {
            const int64_t pair = pe[static_cast<size_t>(r)];
            const float w = topk_weights.f32()[pair];
            float* o = out.f32() + (pair / k) * Din;
            const float* yr = ys.f32() + r * Din;
            for (int64_t c = 0; c < Din; ++c) o[c] += yr[c] * w;
          }
        }
      },
      [&] {
        if (fp8) {
          CHIMERA_CUDA_CALL(cuda::moe_experts_fp8(ctx, out, x, topk_ids, topk_weights, up_proj, down_proj));
        } else {
          CHIMERA_CUDA_CALL(cuda::moe_experts_nvfp4(ctx, out, x, topk_ids, topk_weights, up_proj, down_proj));
        }
      });
}

}  // namespace chimera::ops
