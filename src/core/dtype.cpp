#include "core/dtype.h"

#include <cmath>

#include "core/error.h"

namespace chimera {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::kF32: return 4;
    case DType::kBF16: return 2;
    case DType::kF16: return 2;
    case DType::kF8E4M3: return 1;
    case DType::kU8: return 1;
    case DType::kI8: return 1;
    case DType::kI32: return 4;
    case DType::kI64: return 8;
  }
  return 0;
}

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::kF32: return "F32";
    case DType::kBF16: return "BF16";
    case DType::kF16: return "F16";
    case DType::kF8E4M3: return "F8_E4M3";
    case DType::kU8: return "U8";
    case DType::kI8: return "I8";
    case DType::kI32: return "I32";
    case DType::kI64: return "I64";
  }
  return "?";
}

std::optional<DType> dtype_from_name(std::string_view name) {
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16, DType::kF8E4M3, DType::kU8, DType::kI8,
                  DType::kI32, DType::kI64}) {
    if (dtype_name(t) == name) return t;
  }
  return std::nullopt;
}

bool dtype_is_float(DType t) {
  return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16 || t == DType::kF8E4M3;
}

float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  if (exp == 0) {
    if (man == 0) return f32_from_bits(sign);
    // subnormal: man * 2^-24
    const float v = std::ldexp(static_cast<float>(man), -24);
    return sign ? -v : v;
  }
  if (exp == 31) return f32_from_bits(sign | 0x7f800000u | (man << 13));
  return f32_from_bits(sign | ((exp + 112) << 23) | (man << 13));
}

uint16_t f32_to_f16(float f) {
  const uint32_t u = f32_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> inf (incl. rounding)
  if (abs < 0x38800000u) {
    // result is subnormal or zero: round abs / 2^-24 to nearest even
    const float v = f32_from_bits(abs);
    const float scaled = v * 16777216.0f;  // 2^24
    const float r = std::nearbyint(scaled);
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(r));
  }
  uint32_t m = abs + 0xfffu + ((abs >> 13) & 1u);  // round to nearest even at bit 13
  return static_cast<uint16_t>(sign | ((m - 0x38000000u) >> 13));
}

float f8e4m3_to_f32(uint8_t v) {
  const bool neg = v & 0x80u;
  const uint32_t exp = (v >> 3) & 0xfu;
  const uint32_t man = v & 0x7u;
  float r;
  if (exp == 15 && man == 7) {
    r = std::nanf("");
  } else if (exp == 0) {
    r = std::ldexp(static_cast<float>(man), -9);  // subnormal: man/8 * 2^-6
  } else {
    r = std::ldexp(1.0f + static_cast<float>(man) / 8.0f, static_cast<int>(exp) - 7);
  }
  return neg ? -r : r;
}

uint8_t f32_to_f8e4m3(float f) {
  if (std::isnan(f)) return 0x7f;
  const uint8_t sign = std::signbit(f) ? 0x80 : 0x00;
  float a = std::fabs(f);
  if (a >= 448.0f) return sign | 0x7e;  // saturate (the usual "satfinite" convention)
  // brute force nearest-even over the 127 finite magnitudes: exact and obviously correct.
  uint8_t best = 0;
  float best_err = INFINITY;
  for (uint8_t c = 0; c < 0x7f; ++c) {
    const float err = std::fabs(f8e4m3_to_f32(c) - a);
    if (err < best_err || (err == best_err && (c & 1u) == 0)) {
      best_err = err;
      best = c;
    }
  }
  return sign | best;
}

// Checkpoint tensors are not guaranteed to be aligned to their dtype (safetensors data starts at 8 + header
// length): element reads go through memcpy, which compiles to a plain load.
template <typename T>
static T load_unaligned(const void* data, size_t i) {
  T v;
  std::memcpy(&v, static_cast<const char*>(data) + i * sizeof(T), sizeof(T));
  return v;
}

float load_as_f32(const void* data, DType t, size_t i) {
  switch (t) {
    case DType::kF32: return load_unaligned<float>(data, i);
    case DType::kBF16: return bf16_to_f32(load_unaligned<uint16_t>(data, i));
    case DType::kF16: return f16_to_f32(load_unaligned<uint16_t>(data, i));
    case DType::kF8E4M3: return f8e4m3_to_f32(static_cast<const uint8_t*>(data)[i]);
    default: runtime_error("load_as_f32: dtype {} is not a float type", dtype_name(t));
  }
}

void convert_to_f32(const void* src, DType t, float* dst, size_t n) {
  switch (t) {
    case DType::kF32: std::memcpy(dst, src, n * 4); return;
    case DType::kBF16:
      for (size_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(load_unaligned<uint16_t>(src, i));
      return;
    default:
      for (size_t i = 0; i < n; ++i) dst[i] = load_as_f32(src, t, i);
  }
}

void convert_from_f32(const float* src, DType t, void* dst, size_t n) {
  switch (t) {
    case DType::kF32: std::memcpy(dst, src, n * 4); return;
    case DType::kBF16:
      for (size_t i = 0; i < n; ++i) static_cast<uint16_t*>(dst)[i] = f32_to_bf16(src[i]);
      return;
    case DType::kF16:
      for (size_t i = 0; i < n; ++i) static_cast<uint16_t*>(dst)[i] = f32_to_f16(src[i]);
      return;
    case DType::kF8E4M3:
      for (size_t i = 0; i < n; ++i) static_cast<uint8_t*>(dst)[i] = f32_to_f8e4m3(src[i]);
      return;
    default: runtime_error("convert_from_f32: dtype {} is not a float type", dtype_name(t));
  }
}

}  // namespace chimera
