// Dense layers: linear (y = x @ W^T + b), relu2, relu2_mlp (docs/model.md 5).
#include <algorithm>
#include <vector>

#include "backends/cpu/cpu_common.h"
#include "backends/cpu/cpu_ops.h"
#include "core/parallel.h"

namespace chimera::cpu {
namespace {

constexpr int kLanes = 8;         // independent partial sums per dot product (vectorisable, fixed order)
constexpr int64_t kRowBlock = 4;  // weight rows converted together and reused for every token

// NR dot products of one token row x against NR converted weight rows w (row stride `in`).
// Every output uses the same lane structure whatever NR is, so a result does not depend on the blocking.
template <int NR>
inline void dot_rows(const float* x, const float* w, int64_t in, float* result) {
  float acc[NR][kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= in; i += kLanes) {
    for (int r = 0; r < NR; ++r) {
      const float* wr = w + r * in + i;
      for (int l = 0; l < kLanes; ++l) acc[r][l] += x[i + l] * wr[l];
    }
  }
  for (int l = 0; i < in; ++i, ++l) {
    for (int r = 0; r < NR; ++r) acc[r][l] += x[i] * w[r * in + i];
  }
  for (int r = 0; r < NR; ++r) {
    float s = 0.0f;
    for (int l = 0; l < kLanes; ++l) s += acc[r][l];
    result[r] = s;
  }
}

}  // namespace

void linear_f32(const float* x, int64_t T, int64_t in, const Tensor& weight, const float* bias, float* y) {
  const int64_t out = weight.dim(0);
  if (T == 0 || out == 0) return;
  const int64_t n_blocks = (out + kRowBlock - 1) / kRowBlock;
  // Keep each thread's share above ~64k multiply-adds so small GEMMs do not pay for threads.
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, kRowBlock * T * in));
  parallel_for(n_blocks, grain, [&](int64_t b0, int64_t b1) {
    std::vector<float> w(static_cast<size_t>(kRowBlock * in));
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t o0 = b * kRowBlock;
      const int64_t nr = std::min(kRowBlock, out - o0);
      load_rows_f32(weight, o0, nr, in, w.data());
      float r[kRowBlock];
      for (int64_t t = 0; t < T; ++t) {
        const float* xt = x + t * in;
        if (nr == kRowBlock) {
          dot_rows<kRowBlock>(xt, w.data(), in, r);
        } else {
          for (int64_t j = 0; j < nr; ++j) dot_rows<1>(xt, w.data() + j * in, in, r + j);
        }
        float* yt = y + t * out + o0;
        for (int64_t j = 0; j < nr; ++j) yt[j] = bias ? r[j] + bias[o0 + j] : r[j];
      }
    }
  });
}

void linear(const Tensor& out, const Tensor& x, const Tensor& weight, const Tensor& bias) {
  std::vector<float> b;
  if (bias) b = to_f32_vector(bias);
  linear_f32(x.f32(), x.dim(0), x.dim(1), weight, bias ? b.data() : nullptr, out.f32());
}

void relu2(const Tensor& x) {
  float* p = x.f32();
  for (int64_t i = 0, n = x.numel(); i < n; ++i) {
    const float r = std::max(p[i], 0.0f);
    p[i] = r * r;
  }
}

void relu2_mlp(const Tensor& out, const Tensor& x, const Tensor& up_proj, const Tensor& down_proj) {
  const int64_t T = x.dim(0), D = x.dim(1), I = up_proj.dim(0);
  Tensor h = Tensor::empty(DType::kF32, {T, I});
  linear_f32(x.f32(), T, D, up_proj, nullptr, h.f32());
  relu2(h);
  linear_f32(h.f32(), T, I, down_proj, nullptr, out.f32());
}

}  // namespace chimera::cpu
