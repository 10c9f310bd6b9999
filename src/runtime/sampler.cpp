#include "runtime/sampler.h"

#include <cmath>

#include "backends/cpu/cpu_ops.h"
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

// The algorithm lives in the CPU backend (backends/cpu/sampling.cpp), shared with ops::sample_tokens.
int32_t sample_token(std::span<const float> logits, const SamplingParams& p, uint64_t step) {
  return cpu::sample_row(logits, ops::SamplingRow{p.temperature, p.top_k, p.top_p, p.seed, step});
}

}  // namespace chimera
