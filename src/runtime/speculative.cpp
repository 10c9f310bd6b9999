#include "runtime/speculative.h"

#include <algorithm>
#include <cmath>

#include <fmt/core.h>

#include "core/counter_rng.h"
#include "core/error.h"
#include "io/json_file.h"

namespace chimera {

SpeculativeConfig parse_speculative_config(const std::string& text, const std::string& what) {
  const nlohmann::json j = parse_json(text, what);
  if (!j.is_object())
    invalid_input("{}: expected a JSON object such as {{\"method\": \"mtp\", \"num_speculative_tokens\": 3}}", what);
  SpeculativeConfig c;
  bool has_k = false;
  for (const auto& [key, value] : j.items()) {
    if (key == "method") {
      if (!value.is_string()) invalid_input("{}: \"method\" must be a string", what);
      const std::string m = value.get<std::string>();
      if (m != "mtp" && m != "nemotron_h_mtp" && m != "deepseek_mtp") {
        invalid_input("{}: method \"{}\" is not supported (supported: \"mtp\", the checkpoint's own MTP head)", what,
                      m);
      }
      c.method = "mtp";
    } else if (key == "num_speculative_tokens") {
      if (!value.is_number_integer()) invalid_input("{}: \"num_speculative_tokens\" must be an integer", what);
      const int64_t k = value.get<int64_t>();
      if (k < 1 || k > kMaxSpeculativeTokens) {
        invalid_input("{}: num_speculative_tokens must be in [1, {}], got {}", what, kMaxSpeculativeTokens, k);
      }
      c.num_speculative_tokens = static_cast<int32_t>(k);
      has_k = true;
    } else {
      invalid_input("{}: unknown key \"{}\" (supported: \"method\", \"num_speculative_tokens\")", what, key);
    }
  }
  if (c.method.empty()) invalid_input("{}: \"method\" is missing (\"mtp\")", what);
  if (!has_k) invalid_input("{}: \"num_speculative_tokens\" is missing", what);
  return c;
}

SpeculativeStats SpeculativeStats::since(const SpeculativeStats& before) const {
  SpeculativeStats d = *this;
  d.num_drafts -= before.num_drafts;
  d.num_draft_tokens -= before.num_draft_tokens;
  d.num_accepted_tokens -= before.num_accepted_tokens;
  for (size_t i = 0; i < d.accepted_per_position.size() && i < before.accepted_per_position.size(); ++i) {
    d.accepted_per_position[i] -= before.accepted_per_position[i];
  }
  return d;
}

double SpeculativeStats::acceptance_rate() const {
  return num_draft_tokens == 0 ? 0.0 : static_cast<double>(num_accepted_tokens) / static_cast<double>(num_draft_tokens);
}

double SpeculativeStats::mean_acceptance_length() const {
  return num_drafts == 0 ? 1.0 : 1.0 + static_cast<double>(num_accepted_tokens) / static_cast<double>(num_drafts);
}

std::string SpeculativeStats::summary() const {
  std::string per;
  for (int64_t a : accepted_per_position) {
    per += fmt::format(" {:.3f}", num_drafts == 0 ? 0.0 : static_cast<double>(a) / static_cast<double>(num_drafts));
  }
  return fmt::format(
      "drafts {}, draft tokens {}, accepted {} ({:.1f} %), mean acceptance length {:.2f}, per position{}", num_drafts,
      num_draft_tokens, num_accepted_tokens, 100.0 * acceptance_rate(), mean_acceptance_length(), per);
}

std::vector<int32_t> accept_greedy(std::span<const int32_t> drafts, std::span<const int32_t> targets) {
  CHIMERA_CHECK(targets.size() == drafts.size() + 1, "accept_greedy: {} targets for {} drafts", targets.size(),
                drafts.size());
  size_t a = 0;
  while (a < drafts.size() && drafts[a] == targets[a]) ++a;
  return std::vector<int32_t>(targets.begin(), targets.begin() + static_cast<long>(a + 1));
}

int32_t sample_from_probs(std::span<const float> probs, double u) {
  CHIMERA_CHECK(!probs.empty(), "sample_from_probs: empty distribution");
  double total = 0.0;
  for (float v : probs) total += v;
  const double target = u * total;
  double cum = 0.0;
  int32_t last = -1;
  for (size_t i = 0; i < probs.size(); ++i) {
    if (probs[i] <= 0.0f) continue;
    cum += probs[i];
    last = static_cast<int32_t>(i);
    if (target < cum) return last;
  }
  CHIMERA_CHECK(last >= 0, "sample_from_probs: a distribution without mass");
  return last;  // rounding left u * total at the very top
}

RejectionResult rejection_step(std::span<const float> p, std::span<const float> q, int32_t x, double u_accept,
                               double u_resample) {
  CHIMERA_CHECK(p.size() == q.size() && x >= 0 && static_cast<size_t>(x) < p.size(),
                "rejection_step: distributions of {} and {} tokens, draft token {}", p.size(), q.size(), x);
  const double px = p[static_cast<size_t>(x)], qx = q[static_cast<size_t>(x)];
  // x was drawn from q, so qx > 0; accept when u < px / qx (always when px >= qx).
  if (qx > 0.0 && u_accept * qx < px) return {true, x};
  std::vector<float> residual(p.size());
  double mass = 0.0;
  for (size_t i = 0; i < p.size(); ++i) {
    residual[i] = std::max(p[i] - q[i], 0.0f);
    mass += residual[i];
  }
  return {false, sample_from_probs(mass > 0.0 ? std::span<const float>(residual) : p, u_resample)};
}

double spec_uniform(uint64_t seed, SpecStream stream, uint64_t step) {
  return counter_uniform(splitmix64(seed ^ (static_cast<uint64_t>(stream) * 0x9e3779b97f4a7c15ull)), step);
}

}  // namespace chimera
