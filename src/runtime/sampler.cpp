#include "runtime/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "core/error.h"

namespace chimera {

void SamplingParams::validate() const {
  if (!(temperature >= 0.0f) || !std::isfinite(temperature)) {
    invalid_input("--temperature must be a finite number >= 0, got {}", temperature);
  }
  if (top_k < 0) invalid_input("--top-k must be >= 0 (0 disables it), got {}", top_k);
  if (!(top_p > 0.0f && top_p <= 1.0f)) invalid_input("--top-p must be in (0, 1], got {}", top_p);
  if (max_new_tokens < 0) invalid_input("--max-tokens must be >= 0, got {}", max_new_tokens);
}

namespace {
uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
}  // namespace

double counter_uniform(uint64_t seed, uint64_t step) {
  const uint64_t r = splitmix64(splitmix64(seed) ^ (step * 0xd1342543de82ef95ull + 1));
  return static_cast<double>(r >> 11) * 0x1.0p-53;
}

int32_t sample_token(std::span<const float> logits, const SamplingParams& p, uint64_t step) {
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
  const double u = counter_uniform(p.seed, step) * sum;
  double cum = 0.0;
  for (size_t i = 0; i < keep; ++i) {
    cum += prob[i];
    if (u < cum) return order[i];
  }
  return order[keep - 1];
}

}  // namespace chimera
