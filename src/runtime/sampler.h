// Token sampling on the host: the per-request parameters, their validation, and the host path of one row (the
// algorithm is the CPU backend's, ops/ops.h sample_tokens). A counter-based RNG makes a sequence's draws depend
// only on (seed, step), never on batch composition, thread timing or the backend.
#pragma once

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "core/counter_rng.h"  // counter_uniform(seed, step): the same uniform on every backend
#include "ops/ops.h"

namespace chimera {

struct SamplingParams {
  float temperature = 0.0f;  // 0: greedy (argmax, ties -> lowest id)
  int32_t top_k = 0;         // 0: off
  float top_p = 1.0f;        // 1: off
  float min_p = 0.0f;        // 0: off; else keep tokens with p >= min_p * p_max (after the temperature)
  // OpenAI semantics over the generated tokens: l -= frequency_penalty * count + presence_penalty * (count > 0).
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  // HF / vLLM semantics over prompt + generated tokens: l > 0 ? l / r : l * r. 1: off.
  float repetition_penalty = 1.0f;
  uint64_t seed = 0;
  int32_t max_new_tokens = 32;
  bool ignore_eos = false;
  // Generating one of these finishes the sequence with kStop (as vLLM: the id is part of the output tokens).
  // Not affected by ignore_eos.
  std::vector<int32_t> stop_token_ids;
  // -1: none; 0: the sampled token's log-probability; k (<= 20): that and the k most likely tokens'. Always of
  // the raw logits (log-softmax before penalties and temperature: vLLM's default "raw_logprobs" mode).
  int32_t logprobs = -1;
  // -1: none; k (<= 20): for every prompt position after the first, the prompt token's raw log-probability
  // given the tokens before it, its rank, and the k most likely tokens' (vLLM's prompt_logprobs). Only this
  // sequence's prompt rows are computed for it.
  int32_t prompt_logprobs = -1;

  static constexpr int32_t kMaxLogprobs = ops::kMaxTopLogprobs;

  // kInvalidInput naming the field and its CLI flag on bad values (negative temperature, top_p outside (0, 1],
  // min_p outside [0, 1], a penalty out of range, logprobs outside [-1, 20], a negative stop token id, ...).
  void validate() const;
  // Greedy: the argmax of the (penalised) logits, the sampler's rule (temperature 0 or top_k 1).
  bool greedy() const { return temperature == 0.0f || top_k == 1; }
  bool has_penalties() const {
    return presence_penalty != 0.0f || frequency_penalty != 0.0f || repetition_penalty != 1.0f;
  }
};

// One sampled token: its id, its raw log-probability and the top ones (when asked), and whether the row was
// non-finite (a NaN or an infinity among the logits: the id is then meaningless).
struct SampledToken {
  int32_t id = -1;
  float logprob = 0.0f;
  std::vector<std::pair<int32_t, float>> top_logprobs;
  bool nonfinite = false;
};

// One prompt token's log-probability given the tokens before it (the raw log-softmax of the previous
// position's logits, as a generated token's), its rank among the vocabulary (1 = most likely) and the
// SamplingParams::prompt_logprobs most likely tokens with theirs, most likely first (ties: lower id first).
struct PromptLogprob {
  int32_t token = -1;
  float logprob = 0.0f;
  int32_t rank = 1;
  std::vector<std::pair<int32_t, float>> top;
};
// The PromptLogprob of `token` following the position whose fp32 logits are `logits`.
PromptLogprob prompt_logprob(std::span<const float> logits, int32_t token, int32_t num_top);

// The op-level parameters of a sequence's row at `step` (index of the token being generated).
ops::SamplingRow sampling_row(const SamplingParams& params, uint64_t step);
// Appends the distinct tokens of prompt + generated with their output counts (nothing when no penalty is on).
void append_penalty_tokens(const SamplingParams& params, std::span<const int32_t> prompt,
                           std::span<const int32_t> generated, std::vector<ops::PenaltyToken>& out);

// Samples one token from fp32 logits given the sequence so far (for the penalties).
SampledToken sample_token(std::span<const float> logits, const SamplingParams& params, uint64_t step,
                          std::span<const int32_t> prompt, std::span<const int32_t> generated);
// Without history (no penalties apply): the id only.
int32_t sample_token(std::span<const float> logits, const SamplingParams& params, uint64_t step);

}  // namespace chimera
