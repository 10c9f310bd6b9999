// Token sampling, the reference: greedy, temperature, top-k, top-p, with the counter-based uniform
// (core/counter_rng.h) so a sequence's draws depend only on (seed, step). The CUDA sampler must agree.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "backends/cpu/cpu_ops.h"
#include "core/counter_rng.h"
#include "core/error.h"

namespace chimera::cpu {

int32_t sample_row(std::span<const float> logits, const ops::SamplingRow& p) {
  CHIMERA_CHECK(!logits.empty(), "sample_token on empty logits");
  const auto n = static_cast<int32_t>(logits.size());
  if (p.temperature == 0.0f || p.top_k == 1) {
    // max_element returns the first maximum: ties go to the lowest id.
    return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  }
  // Candidates in descending logit order (stable: ties keep the lower id first).
  std::vector<int32_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  size_t keep = order.size();
  if (p.top_k > 0) keep = std::min(keep, static_cast<size_t>(p.top_k));

  // Softmax over the kept candidates at the given temperature, in double for a stable cumulative sum.
  std::vector<double> prob(keep);
  const double mx = logits[order[0]];
  double sum = 0.0;
  for (size_t i = 0; i < keep; ++i) {
    prob[i] = std::exp((logits[order[i]] - mx) / p.temperature);
    sum += prob[i];
  }
  for (double& q : prob) q /= sum;
  if (p.top_p < 1.0f) {
    // Smallest prefix whose mass reaches top_p (always at least one token).
    double cum = 0.0;
    size_t cut = keep;
    for (size_t i = 0; i < keep; ++i) {
      cum += prob[i];
      if (cum >= p.top_p) {
        cut = i + 1;
        break;
      }
    }
    keep = cut;
    sum = std::accumulate(prob.begin(), prob.begin() + static_cast<long>(keep), 0.0);
  } else {
    sum = 1.0;
  }
  const double u = counter_uniform(p.seed, p.step) * sum;
  double cum = 0.0;
  for (size_t i = 0; i < keep; ++i) {
    cum += prob[i];
    if (u < cum) return order[i];
  }
  return order[keep - 1];
}

void sample_tokens(const Tensor& out_ids, const Tensor& logits, std::span<const ops::SamplingRow> rows) {
  const int64_t V = logits.dim(1);
  for (size_t r = 0; r < rows.size(); ++r) {
    const std::span<const float> row(logits.f32() + static_cast<int64_t>(r) * V, static_cast<size_t>(V));
    out_ids.i32()[r] = sample_row(row, rows[r]);
  }
}

}  // namespace chimera::cpu
