// ModelOpt's FP8 per-tensor rules (core/fp8.h).
#include "core/fp8.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/parallel.h"

namespace chimera {

// Large tensors (a --quantization load quantizes every weight of the model on the host) split over the CPU
// backend's threads; each element's result is independent of the split and max is exact, so the bytes are the
// same for every thread count.
constexpr int64_t kGrain = int64_t{1} << 18;

float max_abs(std::span<const float> w) {
  const int64_t n = static_cast<int64_t>(w.size());
  const int64_t chunks = (n + kGrain - 1) / kGrain;
  std::vector<float> partial(static_cast<size_t>(chunks), 0.0f);
  parallel_for(chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      float m = 0.0f;
      for (int64_t i = c * kGrain; i < std::min(n, (c + 1) * kGrain); ++i) {
        m = std::max(m, std::fabs(w[static_cast<size_t>(i)]));
      }
      partial[static_cast<size_t>(c)] = m;
    }
  });
  float amax = 0.0f;
  for (float m : partial) amax = std::max(amax, m);
  return amax;
}

float fp8_weight_scale(std::span<const float> w) {
  return fp8_scale_for_amax(max_abs(w));
}

Fp8Weight quantize_fp8_per_tensor(std::span<const float> w) {
  Fp8Weight q;
  q.weight_scale = fp8_weight_scale(w);
  q.data.resize(w.size());
  parallel_for(static_cast<int64_t>(w.size()), kGrain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      q.data[static_cast<size_t>(i)] = f32_to_e4m3(w[static_cast<size_t>(i)] / q.weight_scale);
    }
  });
  return q;
}

void dequantize_fp8(std::span<const uint8_t> q, float scale, std::span<float> out) {
  CHIMERA_CHECK(q.size() == out.size(), "dequantize_fp8: {} bytes into {} floats", q.size(), out.size());
  for (size_t i = 0; i < q.size(); ++i) out[i] = e4m3_to_f32(q[i]) * scale;
}

void fake_quantize_fp8(std::span<float> x, float input_scale) {
  for (float& v : x) v = e4m3_to_f32(f32_to_e4m3(v / input_scale)) * input_scale;
}

float fake_quantize_fp8_dynamic(std::span<float> x) {
  const float s = fp8_weight_scale(x);
  fake_quantize_fp8(x, s);
  return s;
}

}  // namespace chimera
