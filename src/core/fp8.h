// FP8 E4M3 as NVIDIA ModelOpt checkpoints store it (OCP "E4M3FN", torch.float8_e4m3fn): 1 sign, 4 exponent
// (bias 7), 3 mantissa bits; no infinities; 0x7f / 0xff are NaN; largest finite 448 (0x7e); smallest subnormal
// 2^-9. Bit manipulation only, so the results are the same on every host (docs/quantization.md 2).
#pragma once

#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "core/dtype.h"

namespace chimera {

inline constexpr float kE4m3Max = 448.0f;
inline constexpr float kE4m3MinSubnormal = 1.0f / 512.0f;  // 2^-9

// The value of one byte (NaN for 0x7f / 0xff).
inline float e4m3_to_f32(uint8_t v) {
  const uint32_t sign = static_cast<uint32_t>(v & 0x80u) << 24;
  const uint32_t exp = (v >> 3) & 0xfu;
  const uint32_t man = v & 0x7u;
  if (exp == 15 && man == 7) return f32_from_bits(sign | 0x7fc00000u);
  if (exp == 0) {
    // subnormal: man * 2^-9, exact in fp32
    const float r = static_cast<float>(man) * (1.0f / 512.0f);
    return sign ? -r : r;
  }
  return f32_from_bits(sign | ((exp + 127 - 7) << 23) | (man << 20));
}

// What happens to a magnitude beyond the largest finite value.
enum class E4m3Overflow : uint8_t {
  kSaturate,  // clamp to +-448 first (ModelOpt's quantizers clamp before the cast; infinities become +-448)
  kNaN,       // torch's plain cast `x.to(torch.float8_e4m3fn)`: rounds as if 480 existed, so > 464 -> NaN
};

// Round to nearest, ties to even. NaN -> 0x7f with the input's sign bit (0xff for -NaN), as torch does; -0.0 keeps
// its sign (0x80).
inline uint8_t f32_to_e4m3(float f, E4m3Overflow overflow = E4m3Overflow::kSaturate) {
  const uint32_t bits = f32_bits(f);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  uint32_t a = bits & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7fu;
  if (overflow == E4m3Overflow::kSaturate) {
    if (a >= 0x43e00000u) return sign | 0x7eu;  // >= 448
  } else if (a >= 0x43f00000u) {
    return sign | 0x7fu;  // >= 480: past the rounding range of 448
  }
  if (a < 0x3c800000u) {
    // below 2^-6: a subnormal (or zero) of e4m3; count units of 2^-9 (exact: a power-of-two scaling of a value
    // whose result is < 8) and round to nearest even. 8 units is 2^-6, whose encoding 0x08 follows on.
    const float q = f32_from_bits(a) * 512.0f;
    const float fl = std::floor(q);
    uint32_t n = static_cast<uint32_t>(fl);
    const float d = q - fl;
    if (d > 0.5f || (d == 0.5f && (n & 1u))) ++n;
    return sign | static_cast<uint8_t>(n);
  }
  // normal: re-bias the exponent (127 -> 7) and round the 23-bit mantissa to 3 bits at bit 20, ties to even;
  // a carry moves into the exponent, which is the correct next value. 464 <= a < 480 rounds to 0x7f (NaN),
  // the plain cast's overflow.
  a += static_cast<uint32_t>(7 - 127) << 23;
  a += 0x7ffffu + ((a >> 20) & 1u);
  return sign | static_cast<uint8_t>(a >> 20);
}

// ---- ModelOpt FP8 per-tensor weight quantization (quant_algo FP8) ------------------------------------------
// weight_scale = amax(|w|) / 448 (an F32 scalar); weight = e4m3(w / weight_scale), saturated; dequantized
// w' = e4m3_to_f32(weight) * weight_scale. An all-zero tensor gets weight_scale 1 (nothing to scale; every
// byte 0), so the dequantization stays finite.
struct Fp8Weight {
  std::vector<uint8_t> data;  // e4m3 bytes, same element order as the input
  float weight_scale = 1.0f;
};
float fp8_weight_scale(std::span<const float> w);
// The per-tensor scale of a tensor whose max |value| is amax: amax / 448, 1 when amax is 0.
inline float fp8_scale_for_amax(float amax) {
  return amax > 0.0f ? amax / kE4m3Max : 1.0f;
}
// max |w[i]| (0 for an empty span); NaN elements are ignored as std::max ignores them.
float max_abs(std::span<const float> w);
Fp8Weight quantize_fp8_per_tensor(std::span<const float> w);
// out[i] = e4m3_to_f32(q[i]) * scale
void dequantize_fp8(std::span<const uint8_t> q, float scale, std::span<float> out);

// Static activation fake quantization (ModelOpt's input quantizer with a calibrated amax, exported as
// input_scale = amax / 448): x' = e4m3_to_f32(e4m3(x / input_scale)) * input_scale, in place.
void fake_quantize_fp8(std::span<float> x, float input_scale);
// Dynamic per-tensor activation quantization (ops::ActQuant::kDynamic): s = fp8_weight_scale(x) (the same
// amax / 448 rule, 1 for all zeros), then fake_quantize_fp8(x, s) in place; returns s.
float fake_quantize_fp8_dynamic(std::span<float> x);

}  // namespace chimera
