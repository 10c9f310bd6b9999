// Speculative decoding with the model's multi-token-prediction (MTP) head (docs/architecture.md "Speculative
// decoding"): the configuration (vLLM's --speculative-config), the acceptance rules and the counters a server and a
// benchmark report. The engine (runtime/engine.h) drafts, verifies and rolls the Mamba state back; this file holds
// the parts that need no model, so they are tested alone.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "runtime/sampler.h"

namespace chimera {

struct SpeculativeConfig {
  // "mtp": drafts from the checkpoint's own MTP head, its one block applied again for each further draft.
  std::string method;
  // Draft tokens per sequence and step (K); 0: speculative decoding off.
  int32_t num_speculative_tokens = 0;
  bool enabled() const { return num_speculative_tokens > 0; }
};

// The JSON object of --speculative-config, vLLM's spelling: {"method": "mtp", "num_speculative_tokens": K}
// (vLLM's "nemotron_h_mtp" / "deepseek_mtp" method names are taken as "mtp"). `what` names the flag or field in
// errors. Unknown keys, another method, K outside [1, kMaxSpeculativeTokens] or malformed JSON -> kInvalidInput.
SpeculativeConfig parse_speculative_config(const std::string& json, const std::string& what);
inline constexpr int32_t kMaxSpeculativeTokens = 8;

// What speculative decoding did so far, as vLLM's spec-decode metrics count it: a draft is one sequence's proposal
// in one step (of up to K tokens), verified in the next.
struct SpeculativeStats {
  int64_t num_drafts = 0;
  int64_t num_draft_tokens = 0;
  int64_t num_accepted_tokens = 0;
  // accepted_per_position[i]: drafts whose token at position i (0-based) was accepted; K entries.
  std::vector<int64_t> accepted_per_position;

  // What was counted after `before` (an earlier copy of these counters).
  SpeculativeStats since(const SpeculativeStats& before) const;
  // Accepted / proposed draft tokens (0 before any draft).
  double acceptance_rate() const;
  // Tokens a verify step emits on average: 1 + accepted draft tokens per draft (1 before any draft).
  double mean_acceptance_length() const;
  // "drafts 120, draft tokens 360, accepted 251 (69.7 %), mean acceptance length 3.09, per position 0.91 0.70 0.48"
  std::string summary() const;
};

// Greedy acceptance: `targets[i]` is the target model's token after the verify row i (row 0 is the sequence's last
// token, row i > 0 its draft i - 1), drafts.size() + 1 of them. The tokens the step emits: the longest prefix of the
// drafts that equals the targets, then the target after it (the correction, or the bonus when all were accepted).
std::vector<int32_t> accept_greedy(std::span<const int32_t> drafts, std::span<const int32_t> targets);

// One draft position of rejection sampling (Leviathan et al.; Chen et al.): draft token x was drawn from q and the
// target's distribution is p (both dense, normalised). Accepted with probability min(1, p[x] / q[x]), decided by
// uniform u_accept; on rejection the token is drawn from norm(max(p - q, 0)) by uniform u_resample (from p itself
// when that is empty: p equals q up to rounding). The emitted tokens are then distributed exactly as p.
struct RejectionResult {
  bool accepted = false;
  int32_t token = -1;  // x when accepted, else the resampled token
};
RejectionResult rejection_step(std::span<const float> p, std::span<const float> q, int32_t x, double u_accept,
                               double u_resample);

// Draws a token from a dense normalised distribution by inverse CDF with uniform u in [0, 1).
int32_t sample_from_probs(std::span<const float> probs, double u);

// The independent uniform streams of one sequence (counter_uniform of a key derived from its seed, at the index of
// the token being generated), apart from the one ordinary sampling uses.
enum class SpecStream : uint64_t { kDraft = 1, kAccept = 2, kResample = 3 };
double spec_uniform(uint64_t seed, SpecStream stream, uint64_t step);

}  // namespace chimera
