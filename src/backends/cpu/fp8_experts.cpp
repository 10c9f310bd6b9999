// Routed MoE experts with FP8 weights on the CPU (backends/cpu/fp8_experts.h): the permutation and accumulation
// order of cpu::moe_experts, each expert's projections through cpu::fp8_linear (exact fp32 dequantization) and the
// activations through core/fp8.h's fake quantization.
#include "backends/cpu/fp8_experts.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "backends/cpu/quant_ops.h"
#include "core/error_base.h"
#include "core/fp8.h"

namespace chimera::cpu {
namespace {

[[noreturn]] void throw_invalid(const std::string& message) {
  throw Error(ErrorKind::kInvalidInput, message);
}

void check_experts(const char* where, const char* role, const ops::ExpertWeights& w, int64_t E, int64_t N, int64_t K) {
  const std::string name = w.name.empty() ? std::string(role) : w.name;
  if (w.format != ops::WeightFormat::kFp8) {
    throw_invalid(str_cat(where, ": ", name, " is ", ops::weight_format_name(w.format), ", expected fp8"));
  }
  if (!w.weight || w.weight.dtype() != DType::kF8E4M3 || w.weight.ndim() != 3 || w.weight.dim(0) != E ||
      (N >= 0 && w.weight.dim(1) != N) || (K >= 0 && w.weight.dim(2) != K)) {
    throw_invalid(str_cat(where, ": ", name, ".weight ", w.weight ? w.weight.describe() : std::string("(none)"),
                          " must be F8_E4M3 [", E, ", ", N, ", ", K, "]"));
  }
  if (static_cast<int64_t>(w.host_scale.size()) != E || !w.scale || w.scale.dtype() != DType::kF32 ||
      w.scale.numel() != E) {
    throw_invalid(str_cat(where, ": ", name, ".weight_scale needs ", E, " F32 per-expert values (scale ",
                          w.scale ? w.scale.describe() : std::string("(none)"), ", ", w.host_scale.size(),
                          " host copies)"));
  }
  if (w.act == ops::ActQuant::kStatic) {
    if (static_cast<int64_t>(w.host_input_scale.size()) != E || !w.input_scale ||
        w.input_scale.dtype() != DType::kF32 || w.input_scale.numel() != E) {
      throw_invalid(str_cat(where, ": ", name, ".input_scale needs ", E,
                            " F32 per-expert values (static activation "
                            "quantization)"));
    }
    for (int64_t e = 0; e < E; ++e) {
      const float s = w.host_input_scale[static_cast<size_t>(e)];
      if (!(s > 0.0f) || !std::isfinite(s)) {
        throw_invalid(str_cat(where, ": ", name, ".input_scale of expert ", e, " is ", s, " (must be finite, > 0)"));
      }
    }
  }
}

}  // namespace

void check_fp8_experts(const char* where, const Tensor& x, const Tensor& topk_ids, const Tensor& topk_weights,
                       const ops::ExpertWeights& up, const ops::ExpertWeights& down) {
  if (x.ndim() != 2) throw_invalid(str_cat(where, ": x ", x.describe(), " must be [T, D]"));
  const int64_t T = x.dim(0), D = x.dim(1);
  if (topk_ids.ndim() != 2 || topk_ids.dim(0) != T || topk_ids.dtype() != DType::kI32) {
    throw_invalid(str_cat(where, ": topk_ids ", topk_ids.describe(), " must be I32 [", T, ", k]"));
  }
  const int64_t k = topk_ids.dim(1);
  if (topk_weights.ndim() != 2 || topk_weights.dim(0) != T || topk_weights.dim(1) != k ||
      topk_weights.dtype() != DType::kF32) {
    throw_invalid(str_cat(where, ": topk_weights ", topk_weights.describe(), " must be F32 [", T, ", ", k, "]"));
  }
  if (!up.weight || up.weight.ndim() != 3) throw_invalid(str_cat(where, ": up_proj has no [E, I, D] FP8 weight"));
  const int64_t E = up.weight.dim(0), I = up.weight.dim(1);
  check_experts(where, "up_proj", up, E, I, D);
  check_experts(where, "down_proj", down, E, D, I);
}

void moe_experts_fp8(const Tensor& out, const Tensor& x, const Tensor& topk_ids, const Tensor& topk_weights,
                     const ops::ExpertWeights& up, const ops::ExpertWeights& down, DType act_dtype) {
  check_fp8_experts("cpu::moe_experts_fp8", x, topk_ids, topk_weights, up, down);
  if (x.dtype() != DType::kF32 || out.dtype() != DType::kF32 || out.shape() != x.shape()) {
    throw_invalid(
        str_cat("cpu::moe_experts_fp8: x ", x.describe(), " and out ", out.describe(), " must be F32 of one shape"));
  }
  const int64_t T = x.dim(0), Din = x.dim(1), k = topk_ids.dim(1);
  const int64_t E = up.num_experts(), I = up.out_features();
  std::vector<std::vector<int64_t>> pairs(static_cast<size_t>(E));
  for (int64_t i = 0; i < T * k; ++i) {
    const int32_t e = topk_ids.i32()[i];
    if (e < -1 || e >= E)
      throw_invalid(str_cat("cpu::moe_experts_fp8: topk_ids[", i, "] = ", e, " outside [0, ", E, ")"));
    if (e >= 0) pairs[static_cast<size_t>(e)].push_back(i);  // -1: another rank's expert
  }
  out.fill_f32(0.0f);
  // ActQuant::kDynamic: one per-tensor scale over the whole input of the projection: x for up_proj, every routed
  // row's r (all experts) for down_proj, so the down projections wait until every expert's r exists.
  std::vector<float> x_dyn;
  if (up.act == ops::ActQuant::kDynamic) {
    x_dyn.assign(x.f32(), x.f32() + T * Din);
    fake_quantize_fp8_dynamic(x_dyn);
  }
  const float* x_rows = up.act == ops::ActQuant::kDynamic ? x_dyn.data() : x.f32();
  std::vector<Tensor> h_of(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) {
    const auto& pe = pairs[static_cast<size_t>(e)];
    const int64_t n = static_cast<int64_t>(pe.size());
    if (n == 0) continue;
    const Tensor xs = Tensor::empty(DType::kF32, {n, Din});
    const Tensor h = Tensor::empty(DType::kF32, {n, I});
    for (int64_t r = 0; r < n; ++r) {
      std::memcpy(xs.f32() + r * Din, x_rows + (pe[r] / k) * Din, static_cast<size_t>(Din) * sizeof(float));
    }
    const size_t ue = static_cast<size_t>(e);
    if (up.act == ops::ActQuant::kStatic) {
      fake_quantize_fp8(std::span<float>(xs.f32(), static_cast<size_t>(n * Din)), up.host_input_scale[ue]);
    }
    fp8_linear(h, xs, up.weight.select(e), up.host_scale[ue], Tensor());
    float* hp = h.f32();
    for (int64_t i = 0; i < n * I; ++i) {
      const float r = std::max(hp[i], 0.0f);
      hp[i] = r * r;
    }
    if (act_dtype != DType::kF32) {
      std::vector<uint16_t> half(static_cast<size_t>(n * I));
      convert_from_f32(hp, act_dtype, half.data(), half.size());
      convert_to_f32(half.data(), act_dtype, hp, half.size());
    }
    if (down.act == ops::ActQuant::kStatic) {
      fake_quantize_fp8(std::span<float>(hp, static_cast<size_t>(n * I)), down.host_input_scale[ue]);
    }
    h_of[ue] = h;
  }
  if (down.act == ops::ActQuant::kDynamic) {
    float amax = 0.0f;
    for (const Tensor& h : h_of) {
      if (h) amax = std::max(amax, max_abs({h.f32(), static_cast<size_t>(h.numel())}));
    }
    const float s_down = fp8_scale_for_amax(amax);  // fp8_weight_scale's rule over all rows
    for (const Tensor& h : h_of) {
      if (h) fake_quantize_fp8({h.f32(), static_cast<size_t>(h.numel())}, s_down);
    }
  }
  for (int64_t e = 0; e < E; ++e) {
    const Tensor& h = h_of[static_cast<size_t>(e)];
    if (!h) continue;
    const auto& pe = pairs[static_cast<size_t>(e)];
    const int64_t n = static_cast<int64_t>(pe.size());
    const Tensor ys = Tensor::empty(DType::kF32, {n, Din});
    fp8_linear(ys, h, down.weight.select(e), down.host_scale[static_cast<size_t>(e)], Tensor());
    for (int64_t r = 0; r < n; ++r) {
      const float w = topk_weights.f32()[pe[r]];
      float* o = out.f32() + (pe[r] / k) * Din;
      const float* yr = ys.f32() + r * Din;
      for (int64_t c = 0; c < Din; ++c) o[c] += yr[c] * w;
    }
  }
}

}  // namespace chimera::cpu
