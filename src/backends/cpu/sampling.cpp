// Token sampling, the reference (ops/ops.h sample_tokens gives the contract): penalties -> temperature ->
// min_p -> top-k -> top-p -> inverse-CDF sample, with the counter-based uniform (core/counter_rng.h) so a
// sequence's draws depend only on (seed, step); log-probabilities of the raw logits. The CUDA sampler
// (backends/cuda/sampling/sampling.cu) computes the same function.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "backends/cpu/cpu_ops.h"
#include "core/counter_rng.h"
#include "core/error.h"

namespace chimera::cpu {
namespace {

bool has_penalty(const ops::SamplingRow& p) {
  return p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f || p.repetition_penalty != 1.0f;
}

// One penalised logit, in fp32 in this order (vLLM's apply_penalties): repetition, frequency, presence.
float penalised(float l, const ops::SamplingRow& p, const ops::PenaltyToken& t) {
  if (p.repetition_penalty != 1.0f && (t.in_prompt != 0 || t.output_count > 0)) {
    l = l > 0.0f ? l / p.repetition_penalty : l * p.repetition_penalty;
  }
  const float count = static_cast<float>(t.output_count);
  const float freq = p.frequency_penalty * count;
  l = l - freq;
  if (t.output_count > 0) l = l - p.presence_penalty;
  return l;
}

int32_t argmax(std::span<const float> l) {
  // max_element returns the first maximum: ties go to the lowest id.
  return static_cast<int32_t>(std::max_element(l.begin(), l.end()) - l.begin());
}

// The distribution a row samples from (temperature, min_p, top-k, top-p applied to already penalised logits): the
// kept tokens in descending logit order (stable: ties keep the lower id first) with their unnormalised
// probabilities, and their sum. Greedy rows (temperature 0 or top_k 1) keep the argmax alone.
struct Kept {
  std::vector<int32_t> order;
  std::vector<double> prob;
  double sum = 1.0;
};

Kept kept_distribution(std::span<const float> logits, const ops::SamplingRow& p) {
  Kept k;
  const auto n = static_cast<int32_t>(logits.size());
  if (p.temperature == 0.0f || p.top_k == 1) {
    k.order = {argmax(logits)};
    k.prob = {1.0};
    return k;
  }
  std::vector<int32_t>& order = k.order;
  order.resize(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  // Softmax numerators at the temperature relative to the best token, in double (the CUDA sampler's mass_of).
  const double mx = logits[order[0]];
  const double t = p.temperature;
  auto mass = [&](int32_t id) { return std::exp((static_cast<double>(logits[id]) - mx) / t); };
  size_t keep = order.size();
  if (p.min_p > 0.0f) {
    // min_p: keep p_i >= min_p * p_max, i.e. exp((l_i - max) / T) >= min_p (a prefix of the order; never empty).
    size_t cut = 1;
    while (cut < keep && mass(order[cut]) >= static_cast<double>(p.min_p)) ++cut;
    keep = cut;
  }
  if (p.top_k > 0) keep = std::min(keep, static_cast<size_t>(p.top_k));

  std::vector<double>& prob = k.prob;
  prob.resize(keep);
  double sum = 0.0;
  for (size_t i = 0; i < keep; ++i) {
    prob[i] = mass(order[i]);
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
    k.sum = std::accumulate(prob.begin(), prob.begin() + static_cast<long>(keep), 0.0);
  }
  order.resize(keep);
  prob.resize(keep);
  return k;
}

int32_t sample_penalised(std::span<const float> logits, const ops::SamplingRow& p) {
  if (p.temperature == 0.0f || p.top_k == 1) return argmax(logits);
  const Kept k = kept_distribution(logits, p);
  const double u = counter_uniform(p.seed, p.step) * k.sum;
  double cum = 0.0;
  for (size_t i = 0; i < k.order.size(); ++i) {
    cum += k.prob[i];
    if (u < cum) return k.order[i];
  }
  return k.order.back();
}

// Logits with the row's penalties applied (a copy only when some apply).
std::span<const float> penalised_row(std::span<const float> logits, const ops::SamplingRow& p,
                                     std::span<const ops::PenaltyToken> penalties, std::vector<float>& storage) {
  if (!has_penalty(p) || penalties.empty()) return logits;
  storage.assign(logits.begin(), logits.end());
  for (const ops::PenaltyToken& t : penalties) storage[static_cast<size_t>(t.id)] = penalised(storage[t.id], p, t);
  return storage;
}

// Raw log-softmax normaliser in double: max + log(sum exp(l - max)).
double log_sum_exp(std::span<const float> logits) {
  const double mx = *std::max_element(logits.begin(), logits.end());
  double sum = 0.0;
  for (float v : logits) sum += std::exp(static_cast<double>(v) - mx);
  return mx + std::log(sum);
}

// The k most likely tokens (ties: lower id first) with their raw log-probabilities.
std::vector<std::pair<int32_t, float>> top_logprobs(std::span<const float> logits, int32_t k_wanted, double lse) {
  std::vector<std::pair<int32_t, float>> top;
  if (k_wanted <= 0) return top;
  const size_t k = std::min(logits.size(), static_cast<size_t>(k_wanted));
  std::vector<int32_t> ids(logits.size());
  std::iota(ids.begin(), ids.end(), 0);
  std::partial_sort(ids.begin(), ids.begin() + static_cast<long>(k), ids.end(), [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  for (size_t i = 0; i < k; ++i) {
    top.emplace_back(ids[i], static_cast<float>(static_cast<double>(logits[ids[i]]) - lse));
  }
  return top;
}

}  // namespace

SampledRow sample_row(std::span<const float> logits, const ops::SamplingRow& p,
                      std::span<const ops::PenaltyToken> penalties, bool with_logprob) {
  CHIMERA_CHECK(!logits.empty(), "sample_token on empty logits");
  SampledRow out;
  out.nonfinite = !std::all_of(logits.begin(), logits.end(), [](float v) { return std::isfinite(v); });

  std::vector<float> storage;
  out.id = sample_penalised(penalised_row(logits, p, penalties, storage), p);

  if (with_logprob || p.num_top_logprobs > 0) {
    const double lse = log_sum_exp(logits);
    out.logprob = static_cast<float>(static_cast<double>(logits[out.id]) - lse);
    out.top = top_logprobs(logits, p.num_top_logprobs, lse);
  }
  return out;
}

std::vector<float> sampling_probs(std::span<const float> logits, const ops::SamplingRow& p,
                                  std::span<const ops::PenaltyToken> penalties) {
  CHIMERA_CHECK(!logits.empty(), "sampling_probs on empty logits");
  std::vector<float> storage;
  const Kept k = kept_distribution(penalised_row(logits, p, penalties, storage), p);
  std::vector<float> probs(logits.size(), 0.0f);
  for (size_t i = 0; i < k.order.size(); ++i)
    probs[static_cast<size_t>(k.order[i])] = static_cast<float>(k.prob[i] / k.sum);
  return probs;
}

void sample_tokens(const ops::SamplingOutputs& out, const Tensor& logits, std::span<const ops::SamplingRow> rows,
                   std::span<const ops::PenaltyToken> penalty_tokens) {
  const int64_t V = logits.dim(1);
  const int64_t K = out.top_ids ? out.top_ids.dim(1) : 0;
  for (size_t r = 0; r < rows.size(); ++r) {
    const ops::SamplingRow& p = rows[r];
    const std::span<const float> row(logits.f32() + static_cast<int64_t>(r) * V, static_cast<size_t>(V));
    const SampledRow s =
        sample_row(row, p, penalty_tokens.subspan(static_cast<size_t>(p.penalty_begin),
                                                  static_cast<size_t>(p.penalty_end - p.penalty_begin)),
                   static_cast<bool>(out.logprobs));
    out.ids.i32()[r] = s.id;
    if (out.logprobs) out.logprobs.f32()[r] = s.logprob;
    if (out.nonfinite) out.nonfinite.i32()[r] = s.nonfinite ? 1 : 0;
    for (int64_t j = 0; j < K; ++j) {
      const bool have = j < static_cast<int64_t>(s.top.size());
      out.top_ids.i32()[static_cast<int64_t>(r) * K + j] = have ? s.top[static_cast<size_t>(j)].first : -1;
      out.top_logprobs.f32()[static_cast<int64_t>(r) * K + j] = have ? s.top[static_cast<size_t>(j)].second : 0.0f;
    }
  }
}

void accept_drafts_greedy(const Tensor& accepted, const Tensor& head_rows, const Tensor& draft_context,
                          const Tensor& tokens, const Tensor& targets, const Tensor& context_lens) {
  const int64_t n = accepted.dim(0), w = tokens.dim(0) / n, k = w - 1;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t* tok = tokens.i32() + i * w;
    const int32_t* tgt = targets.i32() + i * w;
    int32_t a = 0;
    while (a < k && tok[a + 1] == tgt[a]) ++a;  // draft a is the token after row a
    accepted.i32()[i] = a;
    head_rows.i32()[i] = static_cast<int32_t>(i * w) + a;
    for (int64_t d = 0; d + 1 < k; ++d) {
      draft_context.i32()[d * n + i] = context_lens.i32()[i] + a + static_cast<int32_t>(d) + 1;
    }
  }
}

TokenLogprobs token_logprobs(std::span<const float> logits, int32_t token, int32_t k) {
  CHIMERA_CHECK(!logits.empty() && token >= 0 && static_cast<size_t>(token) < logits.size(),
                "token_logprobs: token {} outside a row of {} logits", token, logits.size());
  TokenLogprobs out;
  const double lse = log_sum_exp(logits);
  const float l = logits[static_cast<size_t>(token)];
  out.logprob = static_cast<float>(static_cast<double>(l) - lse);
  for (float v : logits) out.rank += v > l ? 1 : 0;
  out.top = top_logprobs(logits, k, lse);
  return out;
}

}  // namespace chimera::cpu
