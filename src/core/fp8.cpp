// ModelOpt's FP8 per-tensor rules (core/fp8.h).
#include "core/fp8.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace chimera {

float fp8_weight_scale(std::span<const float> w) {
  float amax = 0.0f;
  for (float v : w) amax = std::max(amax, std::fabs(v));
  return amax > 0.0f ? amax / kE4m3Max : 1.0f;
}

Fp8Weight quantize_fp8_per_tensor(std::span<const float> w) {
  Fp8Weight q;
  q.weight_scale = fp8_weight_scale(w);
  q.data.resize(w.size());
  for (size_t i = 0; i < w.size(); ++i) q.data[i] = f32_to_e4m3(w[i] / q.weight_scale);
  return q;
}

void dequantize_fp8(std::span<const uint8_t> q, float scale, std::span<float> out) {
  CHIMERA_CHECK(q.size() == out.size(), "dequantize_fp8: {} bytes into {} floats", q.size(), out.size());
  for (size_t i = 0; i < q.size(); ++i) out[i] = e4m3_to_f32(q[i]) * scale;
}

void fake_quantize_fp8(std::span<float> x, float input_scale) {
  for (float& v : x) v = e4m3_to_f32(f32_to_e4m3(v / input_scale)) * input_scale;
}

}  // namespace chimera
