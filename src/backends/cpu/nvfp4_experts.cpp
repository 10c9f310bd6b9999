// NVFP4 routed experts on the CPU (backends/cpu/nvfp4_experts.h).
#include "backends/cpu/nvfp4_experts.h"

#include <vector>

#include "backends/cpu/cpu_ops.h"
#include "core/error.h"
#include "core/nvfp4.h"

namespace chimera::cpu {
namespace {

void check(const char* which, const ops::ExpertWeights& w) {
  const std::string name = w.name.empty() ? std::string(which) : w.name;
  if (w.format != ops::WeightFormat::kNvfp4) {
    invalid_input("{}: format {}, expected nvfp4", name, ops::weight_format_name(w.format));
  }
  if (!w.weight || w.weight.dtype() != DType::kU8 || w.weight.ndim() != 3 || w.weight.device() != Device::kCpu) {
    invalid_input("{}.weight: {}, expected a host U8 [E, N, K / 2]", name,
                  w.weight ? w.weight.describe() : std::string("(undefined)"));
  }
  const int64_t E = w.weight.dim(0), N = w.weight.dim(1), K = 2 * w.weight.dim(2);
  if (K % kNvfp4BlockSize != 0) invalid_input("{}.weight: K = {} is not a multiple of {}", name, K, kNvfp4BlockSize);
  if (!w.weight_scale || w.weight_scale.dtype() != DType::kF8E4M3 ||
      w.weight_scale.shape() != Shape{E, N, K / kNvfp4BlockSize} || w.weight_scale.device() != Device::kCpu) {
    invalid_input("{}.weight_scale: {}, expected a host F8_E4M3 [{}, {}, {}]", name,
                  w.weight_scale ? w.weight_scale.describe() : std::string("(undefined)"), E, N, K / kNvfp4BlockSize);
  }
  if (static_cast<int64_t>(w.host_scale.size()) != E) {
    invalid_input("{}.weight_scale_2: {} host values, expected {}", name, w.host_scale.size(), E);
  }
}

}  // namespace

Tensor dequantize_expert(const ops::ExpertWeights& w, int64_t e) {
  const int64_t N = w.weight.dim(1), K = 2 * w.weight.dim(2);
  Tensor t = Tensor::empty(DType::kF32, {N, K});
  const auto* packed = static_cast<const uint8_t*>(w.weight.data()) + e * N * (K / 2);
  const auto* scales = static_cast<const uint8_t*>(w.weight_scale.data()) + e * N * (K / kNvfp4BlockSize);
  dequantize_nvfp4_rows(packed, scales, w.host_scale[static_cast<size_t>(e)], K, 0, N, t.f32());
  return t;
}

void moe_experts_nvfp4(const Tensor& out, const Tensor& x, const Tensor& topk_ids, const Tensor& topk_weights,
                       const ops::ExpertWeights& up, const ops::ExpertWeights& down) {
  check("up_proj", up);
  check("down_proj", down);
  const int64_t E = up.weight.dim(0), I = up.weight.dim(1), D = 2 * up.weight.dim(2);
  if (down.weight.dim(0) != E || down.weight.dim(1) != D || 2 * down.weight.dim(2) != I) {
    invalid_input("{}.weight: {}, expected U8 [{}, {}, {}] for the up projection {}",
                  down.name.empty() ? std::string("down_proj") : down.name, down.weight.describe(), E, D, I / 2,
                  up.weight.describe());
  }
  CHIMERA_CHECK(x.dtype() == DType::kF32 && x.ndim() == 2 && x.dim(1) == D, "moe_experts_nvfp4: x {} for D = {}",
                x.describe(), D);
  CHIMERA_CHECK(out.dtype() == DType::kF32 && out.shape() == x.shape(), "moe_experts_nvfp4: out {}", out.describe());
  CHIMERA_CHECK(topk_ids.dtype() == DType::kI32 && topk_ids.ndim() == 2 && topk_ids.dim(0) == x.dim(0) &&
                    topk_weights.shape() == topk_ids.shape() && topk_weights.dtype() == DType::kF32,
                "moe_experts_nvfp4: topk_ids {} topk_weights {}", topk_ids.describe(), topk_weights.describe());
  for (int64_t i = 0; i < topk_ids.numel(); ++i) {
    const int32_t id = topk_ids.i32()[i];
    CHIMERA_CHECK(id >= -1 && id < E, "moe_experts_nvfp4: topk_ids[{}] = {} outside [0, {})", i, id, E);
  }
  // Only the experts some token picked are dequantized; the others get an empty [I, D] / [D, I] placeholder that
  // cpu::moe_experts never reads.
  std::vector<bool> used(static_cast<size_t>(E), false);
  for (int64_t i = 0; i < topk_ids.numel(); ++i) {
    if (topk_ids.i32()[i] >= 0) used[static_cast<size_t>(topk_ids.i32()[i])] = true;  // -1: another rank's
  }
  std::vector<Tensor> ups, downs;
  ups.reserve(static_cast<size_t>(E));
  downs.reserve(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) {
    if (used[static_cast<size_t>(e)]) {
      ups.push_back(dequantize_expert(up, e));
      downs.push_back(dequantize_expert(down, e));
    } else {
      ups.push_back(Tensor::empty(DType::kF32, {I, 0}));
      downs.push_back(Tensor::empty(DType::kF32, {D, 0}));
    }
  }
  moe_experts(out, x, topk_ids, topk_weights, ups, downs);
}

}  // namespace chimera::cpu
