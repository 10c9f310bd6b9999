// How a linear layer's weight is stored: dense (a float tensor) or quantized as ModelOpt exports it (FP8 with a
// per-tensor scale, NVFP4 with 16-element block scales and a per-tensor second scale). The model holds every
// linear layer as a LinearWeight and every MoE projection's routed experts as an ExpertWeights; the ops dispatch on
// the format (docs/quantization.md says what each format computes).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace chimera::ops {

enum class WeightFormat : uint8_t {
  kDense,  // weight float [N, K] (F32 / BF16 / F16)
  kFp8,    // weight F8_E4M3 [N, K]; W = e4m3(weight) * scale
  kNvfp4,  // weight U8 [N, K / 2] (E2M1 pairs, element 2i in the low nibble), weight_scale F8_E4M3 [N, K / 16];
           // W[n, k] = e2m1(weight[n, k / 2]) * e4m3(weight_scale[n, k / 16]) * scale
};

inline const char* weight_format_name(WeightFormat f) {
  switch (f) {
    case WeightFormat::kDense: return "dense";
    case WeightFormat::kFp8: return "fp8";
    case WeightFormat::kNvfp4: return "nvfp4";
  }
  return "?";
}

// What happens to the activation before the product.
//   kNone     the activation as it is (weight-only dequantization)
//   kStatic   x' = e4m3(x / input_scale) * input_scale, saturated at +-448 (FP8 W8A8 with the checkpoint's static
//             activation scale; FP8 formats only)
//   kDynamic  the same with s = max|x| / 448 over the whole [T, K] input of the op, in place of input_scale (1 when
//             x is all zeros): FP8 W8A8 with a per-tensor dynamic scale, computed each call, for weights quantized
//             without calibration (--quantization fp8; vLLM's dynamic FP8 scheme). FP8 only; for routed experts the
//             tensor is the projection's whole input: x for up_proj, every routed row of every expert for down_proj.
enum class ActQuant : uint8_t { kNone, kStatic, kDynamic };

inline const char* act_quant_name(ActQuant a) {
  switch (a) {
    case ActQuant::kNone: return "weight-only";
    case ActQuant::kStatic: return "static";
    case ActQuant::kDynamic: return "dynamic";
  }
  return "?";
}

// One linear layer y = x' @ W^T (+ b).
struct LinearWeight {
  WeightFormat format = WeightFormat::kDense;
  ActQuant act = ActQuant::kNone;
  std::string name;     // the checkpoint module ("backbone.layers.0.mixer.in_proj"), for error messages
  Tensor weight;        // see WeightFormat
  Tensor weight_scale;  // kNvfp4: F8_E4M3 [N, K / 16]; undefined otherwise
  float scale = 1.0f;        // kFp8: weight_scale; kNvfp4: weight_scale_2 (per-tensor, kept on the host)
  float input_scale = 0.0f;  // the static activation scale (> 0 with ActQuant::kStatic; 0: none)

  explicit operator bool() const { return static_cast<bool>(weight); }
  int64_t out_features() const { return weight ? weight.dim(0) : 0; }
  int64_t in_features() const {
    if (!weight) return 0;
    return format == WeightFormat::kNvfp4 ? 2 * weight.dim(1) : weight.dim(1);
  }
};

// The E routed experts of one MoE projection (up_proj [E, I, K] or down_proj [E, K, I]), one format for all of
// them, in one buffer per tensor so that a kernel reads expert e at a fixed stride. Per-expert scales live in
// device-readable F32 [E] tensors and in host copies (the CPU reference and the launchers read those).
struct ExpertWeights {
  WeightFormat format = WeightFormat::kDense;
  ActQuant act = ActQuant::kNone;
  std::string name;           // "backbone.layers.3.mixer.experts.{e}.up_proj" with {e} literal, for errors
  Tensor weight;              // [E, N, K] float / F8_E4M3, or U8 [E, N, K / 2]
  Tensor weight_scale;        // kNvfp4: F8_E4M3 [E, N, K / 16]
  Tensor scale;               // F32 [E]: kFp8 weight_scale, kNvfp4 weight_scale_2; on the weights' device
  Tensor input_scale;         // F32 [E] static activation scales (ActQuant::kStatic); on the weights' device
  std::vector<float> host_scale;        // [E] copies of `scale`
  std::vector<float> host_input_scale;  // [E] copies of `input_scale` (empty without)

  explicit operator bool() const { return static_cast<bool>(weight); }
  int64_t num_experts() const { return weight ? weight.dim(0) : 0; }
  int64_t out_features() const { return weight ? weight.dim(1) : 0; }
  int64_t in_features() const {
    if (!weight) return 0;
    return format == WeightFormat::kNvfp4 ? 2 * weight.dim(2) : weight.dim(2);
  }
  // Expert e as one linear layer (views into the buffers).
  LinearWeight expert(int64_t e) const {
    LinearWeight w;
    w.format = format;
    w.act = act;
    w.name = name;
    w.weight = weight.select(e);
    if (weight_scale) w.weight_scale = weight_scale.select(e);
    if (!host_scale.empty()) w.scale = host_scale[static_cast<size_t>(e)];
    if (!host_input_scale.empty()) w.input_scale = host_input_scale[static_cast<size_t>(e)];
    return w;
  }
};

}  // namespace chimera::ops
