// Depthwise causal conv1d over a packed batch with per-slot conv state (docs/model.md 3.3, 3.5).
// conv_state[slot, c, j] is the input at time j - (K-1) relative to the sequence's first new token.
#include <vector>

#include "backends/cpu/cpu_common.h"
#include "backends/cpu/cpu_ops.h"
#include "core/parallel.h"

namespace chimera::cpu {
namespace {

struct ConvWeights {
  int64_t C, K;
  std::vector<float> w;     // [C, K]
  std::vector<float> bias;  // [C] (zeros when absent)
};

ConvWeights load_conv_weights(const Tensor& weight, const Tensor& bias) {
  ConvWeights cw;
  cw.C = weight.dim(0);
  cw.K = weight.dim(-1);  // [C, K] or [C, 1, K]
  cw.w = to_f32_vector(weight);
  cw.bias = bias ? to_f32_vector(bias) : std::vector<float>(static_cast<size_t>(cw.C), 0.0f);
  return cw;
}

}  // namespace

void causal_conv1d(const Tensor& out, const Tensor& x, const Tensor& weight, const Tensor& bias,
                   const Tensor& conv_state, std::span<const int32_t> cu_seqlens, std::span<const int32_t> slots,
                   bool silu_act, std::span<const ops::StateCheckpoint> checkpoints) {
  const ConvWeights cw = load_conv_weights(weight, bias);
  const int64_t C = cw.C, K = cw.K, S = static_cast<int64_t>(slots.size());
  parallel_for(C, 64, [&](int64_t c0, int64_t c1) {
    std::vector<float> hist;  // K-1 state columns followed by the sequence's new inputs, one channel
    auto cp = checkpoints.begin();
    for (int64_t s = 0; s < S; ++s) {
      const int32_t slot = slots[static_cast<size_t>(s)];
      if (slot < 0) continue;
      const int64_t r0 = cu_seqlens[static_cast<size_t>(s)], n = cu_seqlens[static_cast<size_t>(s) + 1] - r0;
      hist.resize(static_cast<size_t>(K - 1 + n));
      for (int64_t c = c0; c < c1; ++c) {
        float* st = conv_state.f32() + (slot * C + c) * (K - 1);
        for (int64_t j = 0; j < K - 1; ++j) hist[j] = st[j];
        for (int64_t t = 0; t < n; ++t) hist[K - 1 + t] = x.f32()[(r0 + t) * C + c];
        const float* w = cw.w.data() + c * K;
        for (int64_t t = 0; t < n; ++t) {
          float acc = cw.bias[c];
          for (int64_t j = 0; j < K; ++j) acc += w[j] * hist[t + j];  // hist[t + j] = input at t-(K-1)+j
          out.f32()[(r0 + t) * C + c] = silu_act ? silu(acc) : acc;
        }
        // A checkpoint after r rows holds the K-1 inputs before row r: hist[r .. r + K-2].
        for (auto k = cp; k != checkpoints.end() && k->seq == s; ++k) {
          float* ck = conv_state.f32() + (k->slot * C + c) * (K - 1);
          for (int64_t j = 0; j < K - 1; ++j) ck[j] = hist[k->rows + j];
        }
        for (int64_t j = 0; j < K - 1; ++j) st[j] = hist[n + j];  // the last K-1 inputs
      }
      while (cp != checkpoints.end() && cp->seq == s) ++cp;
    }
  });
}

void causal_conv1d_update(const Tensor& out, const Tensor& x, const Tensor& weight, const Tensor& bias,
                          const Tensor& conv_state, std::span<const int32_t> slots, bool silu_act,
                          std::span<const int32_t> dst_slots) {
  const ConvWeights cw = load_conv_weights(weight, bias);
  const int64_t C = cw.C, K = cw.K, Bn = static_cast<int64_t>(slots.size());
  for (int64_t b = 0; b < Bn; ++b) {
    const int32_t slot = slots[static_cast<size_t>(b)];
    if (slot < 0) continue;
    const int64_t dst_slot = dst_slots.empty() ? slot : dst_slots[static_cast<size_t>(b)];
    for (int64_t c = 0; c < C; ++c) {
      const float* st = conv_state.f32() + (slot * C + c) * (K - 1);
      float* dst = conv_state.f32() + (dst_slot * C + c) * (K - 1);
      const float* w = cw.w.data() + c * K;
      const float xn = x.f32()[b * C + c];
      float acc = cw.bias[c];
      for (int64_t j = 0; j < K - 1; ++j) acc += w[j] * st[j];
      acc += w[K - 1] * xn;
      // shift left by one and append the new input (in place: dst == st, read ahead of the write)
      for (int64_t j = 0; j + 1 < K - 1; ++j) dst[j] = st[j + 1];
      if (K > 1) dst[K - 2] = xn;
      out.f32()[b * C + c] = silu_act ? silu(acc) : acc;
    }
  }
}

}  // namespace chimera::cpu
