// Element types of checkpoints and tensors, and scalar conversions on the host.
// g++ 12 has no std::bfloat16_t (docs/build.md 3): bf16 / fp16 / fp8 are converted by bit manipulation here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

namespace chimera {

enum class DType : uint8_t { kF32, kBF16, kF16, kF8E4M3, kU8, kI8, kI32, kI64 };

size_t dtype_size(DType t);
// The safetensors spelling: "F32", "BF16", "F16", "F8_E4M3", "U8", "I8", "I32", "I64".
std::string_view dtype_name(DType t);
std::optional<DType> dtype_from_name(std::string_view name);
bool dtype_is_float(DType t);

inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float f32_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// bf16: upper 16 bits of an fp32; round to nearest even on the way down, NaN kept quiet.
inline float bf16_to_f32(uint16_t h) { return f32_from_bits(static_cast<uint32_t>(h) << 16); }
inline uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);
// OCP FP8 E4M3 (the "fn" variant: no infinities, 0x7f / 0xff are NaN, max 448).
float f8e4m3_to_f32(uint8_t v);
uint8_t f32_to_f8e4m3(float f);

// Reads element i of a buffer of any float dtype as fp32.
float load_as_f32(const void* data, DType t, size_t i);
// Converts n elements of any float dtype to fp32.
void convert_to_f32(const void* src, DType t, float* dst, size_t n);
void convert_from_f32(const float* src, DType t, void* dst, size_t n);

}  // namespace chimera
