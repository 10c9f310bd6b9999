// Embedding lookup and the RMSNorm family (docs/model.md 2.2, 3.3 gated grouped norm).
#include <algorithm>
#include <cstring>
#include <vector>

#include "backends/cpu/cpu_common.h"
#include "backends/cpu/cpu_ops.h"
#include "core/parallel.h"

namespace chimera::cpu {
namespace {

// out_row = w * (x_row * 1/sqrt(mean(x_row^2) + eps)); out_row may alias x_row.
void rms_norm_row(float* out_row, const float* x_row, const float* w, int64_t D, float eps) {
  const float var = dot_f32(x_row, x_row, D) / static_cast<float>(D);
  const float inv = 1.0f / std::sqrt(var + eps);
  for (int64_t c = 0; c < D; ++c) out_row[c] = w[c] * (x_row[c] * inv);
}

int64_t row_grain(int64_t D) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, D)); }

}  // namespace

void embedding(const Tensor& out, const Tensor& table, std::span<const int32_t> ids) {
  const int64_t D = table.dim(1);
  for (size_t t = 0; t < ids.size(); ++t) {
    load_rows_f32(table, ids[t], 1, D, out.f32() + static_cast<int64_t>(t) * D);
  }
}

void embedding_shard(const Tensor& out, const Tensor& table, std::span<const int32_t> ids, int64_t first) {
  const int64_t V = table.dim(0), D = table.dim(1);
  for (size_t t = 0; t < ids.size(); ++t) {
    float* dst = out.f32() + static_cast<int64_t>(t) * D;
    const int64_t row = ids[t] - first;
    if (row >= 0 && row < V) {
      load_rows_f32(table, row, 1, D, dst);
    } else {
      std::fill_n(dst, D, 0.0f);
    }
  }
}

void convert(const Tensor& out, const Tensor& in) { load_rows_f32(in, 0, in.dim(0), in.dim(1), out.f32()); }

void rms_norm(const Tensor& out, const Tensor& x, const Tensor& weight, float eps) {
  const int64_t T = x.dim(0), D = x.dim(1);
  const std::vector<float> w = to_f32_vector(weight);
  parallel_for(T, row_grain(D), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) rms_norm_row(out.f32() + t * D, x.f32() + t * D, w.data(), D, eps);
  });
}

void add_rms_norm(const Tensor& residual, const Tensor& out, const Tensor& x, const Tensor& weight, float eps) {
  const int64_t T = x.dim(0), D = x.dim(1);
  const std::vector<float> w = to_f32_vector(weight);
  parallel_for(T, row_grain(D), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* r = residual.f32() + t * D;
      const float* xr = x.f32() + t * D;
      for (int64_t c = 0; c < D; ++c) r[c] += xr[c];
      rms_norm_row(out.f32() + t * D, r, w.data(), D, eps);
    }
  });
}

// residual += a + b with a + b computed first (one fp32 add, as add() then add_rms_norm() do), then the norm.
void add2_rms_norm(const Tensor& residual, const Tensor& out, const Tensor& a, const Tensor& b, const Tensor& weight,
                   float eps) {
  const int64_t T = a.dim(0), D = a.dim(1);
  const std::vector<float> w = to_f32_vector(weight);
  parallel_for(T, row_grain(D), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* r = residual.f32() + t * D;
      const float* ar = a.f32() + t * D;
      const float* br = b.f32() + t * D;
      for (int64_t c = 0; c < D; ++c) {
        const float mix = ar[c] + br[c];
        r[c] += mix;
      }
      rms_norm_row(out.f32() + t * D, r, w.data(), D, eps);
    }
  });
}

void gated_rms_norm(const Tensor& out, const Tensor& y, const Tensor& z, const Tensor& weight, int64_t n_groups,
                    float eps) {
  const int64_t T = y.dim(0), D = y.dim(1), gs = D / n_groups;
  const std::vector<float> w = to_f32_vector(weight);
  parallel_for(T, row_grain(D), [&](int64_t t0, int64_t t1) {
    std::vector<float> u(static_cast<size_t>(D));
    for (int64_t t = t0; t < t1; ++t) {
      const float* yr = y.f32() + t * D;
      const float* zr = z.f32() + t * D;
      for (int64_t c = 0; c < D; ++c) u[c] = yr[c] * silu(zr[c]);  // gate first (norm_before_gate = false)
      float* o = out.f32() + t * D;
      for (int64_t g = 0; g < n_groups; ++g) rms_norm_row(o + g * gs, u.data() + g * gs, w.data() + g * gs, gs, eps);
    }
  });
}

void gated_square_sums(const Tensor& sums, const Tensor& y, const Tensor& z, int64_t group) {
  const int64_t T = y.dim(0), D = y.dim(1), G = sums.dim(1);
  parallel_for(T, row_grain(D), [&](int64_t t0, int64_t t1) {
    std::vector<float> u(static_cast<size_t>(D));
    for (int64_t t = t0; t < t1; ++t) {
      const float* yr = y.f32() + t * D;
      const float* zr = z.f32() + t * D;
      for (int64_t c = 0; c < D; ++c) u[c] = yr[c] * silu(zr[c]);
      sums.f32()[t * G + group] = dot_f32(u.data(), u.data(), D);
    }
  });
}

void gated_rms_norm_from_sums(const Tensor& out, const Tensor& y, const Tensor& z, const Tensor& weight,
                              const Tensor& sums, int64_t group, int64_t count, float eps) {
  const int64_t T = y.dim(0), D = y.dim(1), G = sums.dim(1);
  const std::vector<float> w = to_f32_vector(weight);
  parallel_for(T, row_grain(D), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* yr = y.f32() + t * D;
      const float* zr = z.f32() + t * D;
      const float inv = 1.0f / std::sqrt(sums.f32()[t * G + group] / static_cast<float>(count) + eps);
      float* o = out.f32() + t * D;
      for (int64_t c = 0; c < D; ++c) o[c] = w[c] * (yr[c] * silu(zr[c]) * inv);
    }
  });
}

}  // namespace chimera::cpu
