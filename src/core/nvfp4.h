// NVFP4 as NVIDIA ModelOpt checkpoints store it (docs/quantization.md 3): E2M1 elements (1 sign, 2 exponent,
// 1 mantissa bit: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6), two a byte with element 2i in the low nibble; one
// E4M3 scale per 16 consecutive elements of a row; one F32 scale per tensor (weight_scale_2).
//   weight         U8      [out, in / 2]
//   weight_scale   F8_E4M3 [out, in / 16]
//   weight_scale_2 F32     []
//   w[r, c] = e2m1(weight[r, c / 2] nibble c % 2) * e4m3(weight_scale[r, c / 16]) * weight_scale_2
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace chimera {

inline constexpr int64_t kNvfp4BlockSize = 16;
inline constexpr float kE2m1Max = 6.0f;

// The value of a 4-bit code (bits 0-3 of `nibble`; bit 3 is the sign). Code 0x8 (negative zero) reads as +0, as
// in ModelOpt's table, so dequantized tensors are bit-identical to its own.
inline float e2m1_to_f32(uint8_t nibble) {
  static constexpr float kValue[16] = {0.0f, 0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                       0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  return kValue[nibble & 0xfu];
}

// Round to the nearest E2M1 magnitude, ties to the even code (the one with mantissa bit 0), saturating at 6:
// the midpoints 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 go to 0, 1, 1, 2, 2, 4, 4. The sign bit is set for x < 0,
// also when the magnitude rounds to 0 (ModelOpt's cast does the same: -0.1 -> 0x8); -0.0 and NaN -> 0x0 sign.
// NaN is not a value ModelOpt produces (a NaN weight has a NaN amax); it encodes as 6 here.
// Branch-free: the code is the number of rounding boundaries below the magnitude (> where the tie goes down to an
// even code, >= where it goes up to one), since random weights make a chain of ifs mispredict at every element.
inline uint8_t f32_to_e2m1(float x) {
  const auto sign = static_cast<uint8_t>(x < 0.0f ? 0x8u : 0x0u);
  const float a = x < 0.0f ? -x : x;
  const int code = int{a > 0.25f} + int{a >= 0.75f} + int{a > 1.25f} + int{a >= 1.75f} + int{a > 2.5f} +
                   int{a >= 3.5f} + int{a > 5.0f} + 7 * int{a != a};  // (5, inf] -> 7; NaN passes none -> 7
  return static_cast<uint8_t>(sign | code);
}

// A quantized [rows, cols] NVFP4 tensor (cols a multiple of 16).
struct Nvfp4Weight {
  int64_t rows = 0, cols = 0;
  std::vector<uint8_t> packed;        // [rows, cols / 2]
  std::vector<uint8_t> block_scale;   // [rows, cols / 16] e4m3 (the checkpoint's weight_scale)
  float weight_scale_2 = 1.0f;        // per-tensor
};

// ModelOpt's weight quantization (NVFP4QTensor): with amax = max |w| over the tensor,
//   weight_scale_2 = amax / (6 * 448)
//   block_scale    = e4m3(clamp(amax_block / (6 * weight_scale_2), 2^-9, 448)), a zero block amax stored as 1
//   q              = e2m1(w / (e4m3_to_f32(block_scale) * weight_scale_2))
// An all-zero tensor gets weight_scale_2 = 1 (ModelOpt divides 0 by 0 there). Throws kInvalidInput when cols is
// not a multiple of 16.
Nvfp4Weight quantize_nvfp4(std::span<const float> w, int64_t rows, int64_t cols);

// Row r0 .. r0 + n_rows of the tensor as fp32: out [n_rows, cols]. packed / block_scale are the whole tensor.
void dequantize_nvfp4_rows(const uint8_t* packed, const uint8_t* block_scale, float weight_scale_2, int64_t cols,
                           int64_t r0, int64_t n_rows, float* out);
std::vector<float> dequantize_nvfp4(const Nvfp4Weight& q);

// Packs codes (one per element, low 4 bits) two a byte, element 2i in the low nibble. codes.size() even.
std::vector<uint8_t> pack_e2m1(std::span<const uint8_t> codes);

}  // namespace chimera
