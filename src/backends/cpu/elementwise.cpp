// Small helpers the model uses between ops: add, copy_columns, write_columns.
#include <cstring>

#include "backends/cpu/cpu_ops.h"

namespace chimera::cpu {

void add(const Tensor& out, const Tensor& a, const Tensor& b) {
  float* o = out.f32();
  const float* pa = a.f32();
  const float* pb = b.f32();
  for (int64_t i = 0, n = out.numel(); i < n; ++i) o[i] = pa[i] + pb[i];
}

void copy_columns(const Tensor& out, const Tensor& in, int64_t col_begin) {
  const int64_t T = out.dim(0), w = out.dim(1), W = in.dim(1);
  for (int64_t t = 0; t < T; ++t) {
    std::memcpy(out.f32() + t * w, in.f32() + t * W + col_begin, static_cast<size_t>(w) * sizeof(float));
  }
}

void write_columns(const Tensor& out, const Tensor& in, int64_t col_begin) {
  const int64_t T = in.dim(0), w = in.dim(1), W = out.dim(1);
  for (int64_t t = 0; t < T; ++t) {
    std::memcpy(out.f32() + t * W + col_begin, in.f32() + t * w, static_cast<size_t>(w) * sizeof(float));
  }
}

}  // namespace chimera::cpu
