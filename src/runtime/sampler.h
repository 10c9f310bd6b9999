// Token sampling on the host: greedy, temperature, top-k, top-p, with a counter-based RNG so a sequence's
// draws depend only on (seed, step), never on batch composition or thread timing.
#pragma once

#include <cstdint>
#include <span>

#include "core/counter_rng.h"  // counter_uniform(seed, step): the same uniform on every backend

namespace chimera {

struct SamplingParams {
  float temperature = 0.0f;  // 0: greedy (argmax, ties -> lowest id)
  int32_t top_k = 0;         // 0: off
  float top_p = 1.0f;        // 1: off
  uint64_t seed = 0;
  int32_t max_new_tokens = 32;
  bool ignore_eos = false;
  // kInvalidInput naming the flag on bad values (negative temperature, top_p outside (0, 1], ...).
  void validate() const;
};

// Samples one token id from fp32 logits. `step`: index of the token being generated in its sequence.
int32_t sample_token(std::span<const float> logits, const SamplingParams& params, uint64_t step);

}  // namespace chimera
