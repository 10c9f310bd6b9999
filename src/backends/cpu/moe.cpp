// MoE: DeepSeek-V3 noaux_tc sigmoid router (docs/model.md 6.1) and the routed non-gated relu2 experts (6.2).
#include <algorithm>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "backends/cpu/cpu_common.h"
#include "backends/cpu/cpu_ops.h"
#include "core/parallel.h"

namespace chimera::cpu {

void router_topk(const Tensor& topk_ids, const Tensor& topk_weights, const Tensor& logits,
                 const Tensor& correction_bias, const ops::RouterParams& p) {
  const int64_t T = logits.dim(0), E = logits.dim(1), k = p.top_k;
  const int64_t n_group = p.n_group, per_group = E / n_group;
  const std::vector<float> bias = to_f32_vector(correction_bias);
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  // Strict order "a before b": larger value first, ties toward the lower index.
  auto before = [](float va, int64_t ia, float vb, int64_t ib) { return va > vb || (va == vb && ia < ib); };

  parallel_for(T, 16, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores(static_cast<size_t>(E)), choice(static_cast<size_t>(E));
    std::vector<float> group_score(static_cast<size_t>(n_group));
    std::vector<int64_t> order(static_cast<size_t>(std::max(E, n_group)));
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t e = 0; e < E; ++e) {
        scores[e] = sigmoid(logits.f32()[t * E + e]);
        choice[e] = scores[e] + bias[e];  // the bias only affects selection
      }
      if (n_group > 1) {
        // group score = sum of the two largest choice values in the group (HF topk(2).sum())
        for (int64_t g = 0; g < n_group; ++g) {
          float a = kNegInf, b = kNegInf;
          for (int64_t e = g * per_group; e < (g + 1) * per_group; ++e) {
            if (choice[e] > a) {
              b = a;
              a = choice[e];
            } else if (choice[e] > b) {
              b = choice[e];
            }
          }
          group_score[g] = per_group >= 2 ? a + b : a;
        }
        std::iota(order.begin(), order.begin() + n_group, 0);
        std::partial_sort(order.begin(), order.begin() + p.topk_group, order.begin() + n_group,
                          [&](int64_t x, int64_t y) { return before(group_score[x], x, group_score[y], y); });
        std::vector<bool> keep(static_cast<size_t>(n_group), false);
        for (int64_t r = 0; r < p.topk_group; ++r) keep[order[r]] = true;
        for (int64_t e = 0; e < E; ++e) {
          if (!keep[e / per_group]) choice[e] = kNegInf;  // HF masked_fill(~score_mask, -inf)
        }
      }
      std::iota(order.begin(), order.begin() + E, 0);
      std::partial_sort(order.begin(), order.begin() + k, order.begin() + E,
                        [&](int64_t x, int64_t y) { return before(choice[x], x, choice[y], y); });
      float sum = 0.0f;
      for (int64_t r = 0; r < k; ++r) sum += scores[order[r]];
      const float denom = p.norm_topk_prob ? sum + 1e-20f : 1.0f;
      for (int64_t r = 0; r < k; ++r) {
        const int64_t e = order[r];
        topk_ids.i32()[t * k + r] = static_cast<int32_t>(e);
        const float w = p.norm_topk_prob ? scores[e] / denom : scores[e];
        topk_weights.f32()[t * k + r] = w * p.routed_scaling_factor;
      }
    }
  });
}

// The reference is literally the two ops: fp32 logits from linear (x is F32 on the CPU), then router_topk.
void router_gate_topk(const Tensor& topk_ids, const Tensor& topk_weights, const Tensor& x, const Tensor& gate,
                      const Tensor& correction_bias, const ops::RouterParams& p) {
  const Tensor logits = Tensor::empty(DType::kF32, {x.dim(0), gate.dim(0)});
  linear(logits, x, gate, Tensor());
  router_topk(topk_ids, topk_weights, logits, correction_bias, p);
}

void local_expert_ids(const Tensor& ids, int64_t first, int64_t count) {
  int32_t* p = ids.i32();
  for (int64_t i = 0; i < ids.numel(); ++i) {
    const int64_t e = p[i] - first;
    p[i] = e >= 0 && e < count ? static_cast<int32_t>(e) : -1;
  }
}

void moe_experts(const Tensor& out, const Tensor& x, const Tensor& topk_ids, const Tensor& topk_weights,
                 std::span<const Tensor> up_proj, std::span<const Tensor> down_proj) {
  const int64_t T = x.dim(0), Din = x.dim(1), k = topk_ids.dim(1);
  const int64_t E = static_cast<int64_t>(up_proj.size());
  // Permutation: the (token, choice) pairs of each expert, tokens in increasing order (id -1: no expert here).
  std::vector<std::vector<int64_t>> pairs(static_cast<size_t>(E));
  for (int64_t i = 0; i < T * k; ++i) {
    if (topk_ids.i32()[i] >= 0) pairs[static_cast<size_t>(topk_ids.i32()[i])].push_back(i);
  }

  out.fill_f32(0.0f);
  std::vector<float> xs, h, ys;
  // Experts in increasing index order, each one's contribution added as it finishes: the per-token fp32
  // accumulation order of HF eager's index_add_ loop.
  for (int64_t e = 0; e < E; ++e) {
    const auto& pe = pairs[static_cast<size_t>(e)];
    const int64_t n = static_cast<int64_t>(pe.size());
    if (n == 0) continue;
    const int64_t I = up_proj[e].dim(0);
    xs.resize(static_cast<size_t>(n * Din));
    h.resize(static_cast<size_t>(n * I));
    ys.resize(static_cast<size_t>(n * Din));
    for (int64_t r = 0; r < n; ++r) {
      std::memcpy(xs.data() + r * Din, x.f32() + (pe[r] / k) * Din, static_cast<size_t>(Din) * sizeof(float));
    }
    linear_f32(xs.data(), n, Din, up_proj[e], nullptr, h.data());
    for (float& v : h) {
      const float r = std::max(v, 0.0f);
      v = r * r;
    }
    linear_f32(h.data(), n, I, down_proj[e], nullptr, ys.data());
    for (int64_t r = 0; r < n; ++r) {
      const float w = topk_weights.f32()[pe[r]];
      float* o = out.f32() + (pe[r] / k) * Din;
      const float* yr = ys.data() + r * Din;
      for (int64_t c = 0; c < Din; ++c) o[c] += yr[c] * w;
    }
  }
}

}  // namespace chimera::cpu
