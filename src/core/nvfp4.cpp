// ModelOpt's NVFP4 rules (core/nvfp4.h).
#include "core/nvfp4.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/fp8.h"
#include "core/parallel.h"

namespace chimera {
namespace {

// One row of `cols` values: its block scales (n = cols / 16) and its E2M1 codes (one a byte).
void quantize_row(const float* row, int64_t cols, float weight_scale_2, uint8_t* block_scale, uint8_t* codes) {
  for (int64_t b = 0; b < cols / kNvfp4BlockSize; ++b) {
    const float* blk = row + b * kNvfp4BlockSize;
    float bmax = 0.0f;
    for (int64_t i = 0; i < kNvfp4BlockSize; ++i) bmax = std::max(bmax, std::fabs(blk[i]));
    float s = bmax / (kE2m1Max * weight_scale_2);
    if (s == 0.0f) s = 1.0f;
    // clamped into e4m3's range before the cast (no underflow to 0, no overflow), as ModelOpt does
    const uint8_t s8 = f32_to_e4m3(std::clamp(s, kE4m3MinSubnormal, kE4m3Max));
    block_scale[b] = s8;
    const float denom = e4m3_to_f32(s8) * weight_scale_2;
    for (int64_t i = 0; i < kNvfp4BlockSize; ++i) codes[b * kNvfp4BlockSize + i] = f32_to_e2m1(blk[i] / denom);
  }
}

}  // namespace

Nvfp4Weight quantize_nvfp4(std::span<const float> w, int64_t rows, int64_t cols) {
  if (rows < 0 || cols < 0 || cols % kNvfp4BlockSize != 0) {
    invalid_input("quantize_nvfp4: shape [{}, {}]: the columns must be a multiple of {}", rows, cols, kNvfp4BlockSize);
  }
  CHIMERA_CHECK(static_cast<int64_t>(w.size()) == rows * cols, "quantize_nvfp4: {} values for [{}, {}]", w.size(), rows,
                cols);
  Nvfp4Weight q;
  q.rows = rows;
  q.cols = cols;
  const float amax = max_abs(w);
  q.weight_scale_2 = amax > 0.0f ? amax / (kE2m1Max * kE4m3Max) : 1.0f;
  const int64_t n_blocks = cols / kNvfp4BlockSize;
  q.block_scale.resize(static_cast<size_t>(rows * n_blocks));
  std::vector<uint8_t> codes(static_cast<size_t>(rows * cols));
  // Rows split over the CPU backend's threads (a row's bytes depend on that row and weight_scale_2 alone).
  const auto quantize_rows = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      quantize_row(w.data() + r * cols, cols, q.weight_scale_2, q.block_scale.data() + r * n_blocks,
                   codes.data() + r * cols);
    }
  };
  parallel_for(rows, std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, cols)), quantize_rows);
  q.packed = pack_e2m1(codes);
  return q;
}

void dequantize_nvfp4_rows(const uint8_t* packed, const uint8_t* block_scale, float weight_scale_2, int64_t cols,
                           int64_t r0, int64_t n_rows, float* out) {
  const int64_t n_blocks = cols / kNvfp4BlockSize;
  for (int64_t r = 0; r < n_rows; ++r) {
    const uint8_t* p = packed + (r0 + r) * (cols / 2);
    const uint8_t* s = block_scale + (r0 + r) * n_blocks;
    float* o = out + r * cols;
    for (int64_t b = 0; b < n_blocks; ++b) {
      // The block's scale first (fp32 e4m3 x weight_scale_2), then times each element: the order of ModelOpt's
      // NVFP4QTensor.dequantize, so the values are bit-identical to it.
      const float scale = e4m3_to_f32(s[b]) * weight_scale_2;
      for (int64_t i = 0; i < kNvfp4BlockSize / 2; ++i) {
        const uint8_t byte = p[b * (kNvfp4BlockSize / 2) + i];
        o[b * kNvfp4BlockSize + 2 * i] = e2m1_to_f32(byte & 0xfu) * scale;
        o[b * kNvfp4BlockSize + 2 * i + 1] = e2m1_to_f32(byte >> 4) * scale;
      }
    }
  }
}

std::vector<float> dequantize_nvfp4(const Nvfp4Weight& q) {
  std::vector<float> out(static_cast<size_t>(q.rows * q.cols));
  dequantize_nvfp4_rows(q.packed.data(), q.block_scale.data(), q.weight_scale_2, q.cols, 0, q.rows, out.data());
  return out;
}

std::vector<uint8_t> pack_e2m1(std::span<const uint8_t> codes) {
  CHIMERA_CHECK(codes.size() % 2 == 0, "pack_e2m1: an odd count {}", codes.size());
  std::vector<uint8_t> out(codes.size() / 2);
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = static_cast<uint8_t>((codes[2 * i] & 0xfu) | ((codes[2 * i + 1] & 0xfu) << 4));
  }
  return out;
}

}  // namespace chimera
