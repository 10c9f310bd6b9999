// Causal GQA attention over a packed batch with a paged KV cache (docs/model.md 4; no RoPE), the cache in fp32 or
// FP8 E4M3 with per-tensor scales (ops.h KvCacheView).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "backends/cpu/cpu_common.h"
#include "backends/cpu/cpu_ops.h"
#include "core/fp8.h"
#include "core/parallel.h"

namespace chimera::cpu {

void attention(const Tensor& out, const Tensor& q, const Tensor& k, const Tensor& v, const ops::KvCacheView& cache,
               std::span<const int32_t> cu_seqlens, std::span<const int32_t> context_lens, const Tensor& block_tables,
               float scale) {
  const int64_t Qh = q.dim(1), hd = q.dim(2), KVh = k.dim(1);
  const int64_t block_size = cache.k.dim(1), max_blocks = block_tables.dim(1);
  const int64_t S = static_cast<int64_t>(context_lens.size());
  const int64_t group = Qh / KVh;
  const int32_t* tables = block_tables.i32();
  // Row of position `pos` of sequence s in the cache, viewed as [num_blocks * block_size, KVh, hd].
  auto cache_row = [&](int64_t s, int64_t pos) {
    return static_cast<int64_t>(tables[s * max_blocks + pos / block_size]) * block_size + pos % block_size;
  };
  const size_t row_bytes = static_cast<size_t>(KVh * hd) * sizeof(float);
  // An FP8 cache (ops.h KvCacheView) holds e4m3(x / scale) and is read back as e4m3 x scale.
  const bool fp8 = cache.k.dtype() == DType::kF8E4M3;

  // 1. Append this step's k, v at positions context_len .. context_len + n - 1.
  for (int64_t s = 0; s < S; ++s) {
    const int64_t r0 = cu_seqlens[static_cast<size_t>(s)], n = cu_seqlens[static_cast<size_t>(s) + 1] - r0;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t row = cache_row(s, context_lens[static_cast<size_t>(s)] + i);
      const float* kr = k.f32() + (r0 + i) * KVh * hd;
      const float* vr = v.f32() + (r0 + i) * KVh * hd;
      if (fp8) {
        auto* kd = static_cast<uint8_t*>(cache.k.data()) + row * KVh * hd;
        auto* vd = static_cast<uint8_t*>(cache.v.data()) + row * KVh * hd;
        for (int64_t e = 0; e < KVh * hd; ++e) {
          kd[e] = f32_to_e4m3(kr[e] / cache.k_scale);
          vd[e] = f32_to_e4m3(vr[e] / cache.v_scale);
        }
      } else {
        std::memcpy(cache.k.f32() + row * KVh * hd, kr, row_bytes);
        std::memcpy(cache.v.f32() + row * KVh * hd, vr, row_bytes);
      }
    }
  }
  // Row (position u of sequence s, kv head kvh) of the cache as fp32: the row itself, or dequantized into buf.
  auto cache_vec = [&](const Tensor& c, float qscale, int64_t s, int64_t u, int64_t kvh, float* buf) -> const float* {
    const int64_t off = (cache_row(s, u) * KVh + kvh) * hd;
    if (!fp8) return c.f32() + off;
    const uint8_t* q8 = static_cast<const uint8_t*>(c.data()) + off;
    for (int64_t e = 0; e < hd; ++e) buf[e] = e4m3_to_f32(q8[e]) * qscale;
    return buf;
  };

  // 2. Each query row attends to positions [0, context_len + i] of its sequence; parallel over (row, head).
  const int64_t T = q.dim(0);
  std::vector<int64_t> row_seq(static_cast<size_t>(T), -1);
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t t = cu_seqlens[static_cast<size_t>(s)]; t < cu_seqlens[static_cast<size_t>(s) + 1]; ++t)
      row_seq[t] = s;
  }
  parallel_for(T * Qh, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> p;
    std::vector<float> acc(static_cast<size_t>(hd)), buf(static_cast<size_t>(hd));
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / Qh, j = i % Qh, kvh = j / group, s = row_seq[t];
      if (s < 0) continue;
      const int64_t pos = context_lens[static_cast<size_t>(s)] + (t - cu_seqlens[static_cast<size_t>(s)]);
      const float* qr = q.f32() + (t * Qh + j) * hd;
      p.resize(static_cast<size_t>(pos + 1));
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t u = 0; u <= pos; ++u) {
        p[u] = dot_f32(qr, cache_vec(cache.k, cache.k_scale, s, u, kvh, buf.data()), hd) * scale;
        m = std::max(m, p[u]);
      }
      float sum = 0.0f;
      for (int64_t u = 0; u <= pos; ++u) {
        p[u] = std::exp(p[u] - m);
        sum += p[u];
      }
      const float inv = 1.0f / sum;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t u = 0; u <= pos; ++u) {
        const float w = p[u] * inv;  // softmax first, then p @ v (HF eager order)
        const float* vr = cache_vec(cache.v, cache.v_scale, s, u, kvh, buf.data());
        for (int64_t e = 0; e < hd; ++e) acc[e] += w * vr[e];
      }
      std::copy(acc.begin(), acc.end(), out.f32() + (t * Qh + j) * hd);
    }
  });
}

}  // namespace chimera::cpu
