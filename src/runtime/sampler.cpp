#include "runtime/sampler.h"

#include <algorithm>
#include <cmath>
#include <unordered_map>

#include "backends/cpu/cpu_ops.h"
#include "core/error.h"

namespace chimera {

void SamplingParams::validate() const {
  if (!(temperature >= 0.0f) || !std::isfinite(temperature)) {
    invalid_input("temperature (--temperature) must be a finite number >= 0, got {}", temperature);
  }
  if (top_k < 0) invalid_input("top_k (--top-k) must be >= 0 (0 disables it), got {}", top_k);
  if (!(top_p > 0.0f && top_p <= 1.0f)) invalid_input("top_p (--top-p) must be in (0, 1], got {}", top_p);
  if (!(min_p >= 0.0f && min_p <= 1.0f)) invalid_input("min_p (--min-p) must be in [0, 1], got {}", min_p);
  // The OpenAI API's ranges for the additive penalties; vLLM's (> 0, finite) for the multiplicative one.
  if (!(presence_penalty >= -2.0f && presence_penalty <= 2.0f)) {
    invalid_input("presence_penalty (--presence-penalty) must be in [-2, 2], got {}", presence_penalty);
  }
  if (!(frequency_penalty >= -2.0f && frequency_penalty <= 2.0f)) {
    invalid_input("frequency_penalty (--frequency-penalty) must be in [-2, 2], got {}", frequency_penalty);
  }
  if (!(repetition_penalty > 0.0f) || !std::isfinite(repetition_penalty)) {
    invalid_input("repetition_penalty (--repetition-penalty) must be a finite number > 0, got {}",
                  repetition_penalty);
  }
  if (max_new_tokens < 0) invalid_input("max_tokens (--max-tokens) must be >= 0, got {}", max_new_tokens);
  if (logprobs < -1 || logprobs > kMaxLogprobs) {
    invalid_input("logprobs (--logprobs) must be in [0, {}] (or -1 for none), got {}", kMaxLogprobs, logprobs);
  }
  if (prompt_logprobs < -1 || prompt_logprobs > kMaxLogprobs) {
    invalid_input("prompt_logprobs must be in [0, {}] (or -1 for none), got {}", kMaxLogprobs, prompt_logprobs);
  }
  for (size_t i = 0; i < stop_token_ids.size(); ++i) {
    if (stop_token_ids[i] < 0) {
      invalid_input("stop_token_ids (--stop-token-ids): entry {} is {}, not a token id", i, stop_token_ids[i]);
    }
  }
}

ops::SamplingRow sampling_row(const SamplingParams& p, uint64_t step) {
  ops::SamplingRow r;
  r.temperature = p.temperature;
  r.top_k = p.top_k;
  r.top_p = p.top_p;
  r.seed = p.seed;
  r.step = step;
  r.min_p = p.min_p;
  r.presence_penalty = p.presence_penalty;
  r.frequency_penalty = p.frequency_penalty;
  r.repetition_penalty = p.repetition_penalty;
  r.num_top_logprobs = std::max(0, p.logprobs);
  return r;
}

void append_penalty_tokens(const SamplingParams& p, std::span<const int32_t> prompt,
                           std::span<const int32_t> generated, std::vector<ops::PenaltyToken>& out) {
  if (!p.has_penalties()) return;
  std::unordered_map<int32_t, size_t> at;  // token id -> its entry in out
  auto entry = [&](int32_t id) -> ops::PenaltyToken& {
    const auto [it, fresh] = at.try_emplace(id, out.size());
    if (fresh) out.push_back(ops::PenaltyToken{id, 0, 0});
    return out[it->second];
  };
  // Only the repetition penalty looks at the prompt.
  if (p.repetition_penalty != 1.0f) {
    for (int32_t id : prompt) entry(id).in_prompt = 1;
  }
  for (int32_t id : generated) ++entry(id).output_count;
}

SampledToken sample_token(std::span<const float> logits, const SamplingParams& params, uint64_t step,
                          std::span<const int32_t> prompt, std::span<const int32_t> generated) {
  std::vector<ops::PenaltyToken> pen;
  append_penalty_tokens(params, prompt, generated, pen);
  const ops::SamplingRow row = sampling_row(params, step);
  cpu::SampledRow s = cpu::sample_row(logits, row, pen, params.logprobs >= 0);
  return SampledToken{s.id, s.logprob, std::move(s.top), s.nonfinite};
}

PromptLogprob prompt_logprob(std::span<const float> logits, int32_t token, int32_t num_top) {
  cpu::TokenLogprobs t = cpu::token_logprobs(logits, token, num_top);
  return PromptLogprob{token, t.logprob, t.rank, std::move(t.top)};
}

int32_t sample_token(std::span<const float> logits, const SamplingParams& params, uint64_t step) {
  return sample_token(logits, params, step, {}, {}).id;
}

}  // namespace chimera
