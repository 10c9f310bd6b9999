#include "bench_serve/dataset.h"

#include <cmath>
#include <random>

#include "core/error.h"

namespace chimera::bench_serve {

std::vector<SampleRequest> random_dataset(const RandomDatasetParams& p, const std::vector<int32_t>& allowed_ids) {
  if (!(p.range_ratio >= 0.0 && p.range_ratio < 1.0)) {
    invalid_input("--random-range-ratio must be in [0, 1), got {}", p.range_ratio);
  }
  if (p.num_prompts < 1) invalid_input("--num-prompts must be at least 1, got {}", p.num_prompts);
  if (p.prefix_len < 0) invalid_input("--random-prefix-len must be >= 0, got {}", p.prefix_len);
  if (p.output_len < 1) invalid_input("--random-output-len must be at least 1, got {}", p.output_len);
  if (allowed_ids.empty()) invalid_input("the tokenizer leaves no non-special token ids to draw prompts from");
  const auto in_lo = static_cast<int64_t>(std::floor(static_cast<double>(p.input_len) * (1.0 - p.range_ratio)));
  const auto in_hi = static_cast<int64_t>(std::ceil(static_cast<double>(p.input_len) * (1.0 + p.range_ratio)));
  const int64_t out_lo =
      std::max<int64_t>(1, static_cast<int64_t>(std::floor(static_cast<double>(p.output_len) * (1.0 - p.range_ratio))));
  const int64_t out_hi =
      std::max<int64_t>(1, static_cast<int64_t>(std::ceil(static_cast<double>(p.output_len) * (1.0 + p.range_ratio))));
  if (p.prefix_len + in_lo < 1) {
    invalid_input("--random-input-len {} with --random-range-ratio {} and --random-prefix-len {} allows empty prompts",
                  p.input_len, p.range_ratio, p.prefix_len);
  }

  std::mt19937_64 rng(p.seed);
  std::uniform_int_distribution<int64_t> in_dist(in_lo, in_hi), out_dist(out_lo, out_hi);
  std::uniform_int_distribution<size_t> id_dist(0, allowed_ids.size() - 1);
  std::vector<int64_t> in_lens(static_cast<size_t>(p.num_prompts)), out_lens(in_lens.size());
  std::vector<size_t> offsets(in_lens.size());
  for (auto& v : in_lens) v = in_dist(rng);
  for (auto& v : out_lens) v = out_dist(rng);
  for (auto& v : offsets) v = id_dist(rng);
  std::vector<int32_t> prefix(static_cast<size_t>(p.prefix_len));
  for (auto& v : prefix) v = allowed_ids[id_dist(rng)];

  std::vector<SampleRequest> out(in_lens.size());
  for (size_t i = 0; i < out.size(); ++i) {
    SampleRequest& r = out[i];
    r.prompt_ids = prefix;
    r.prompt_ids.reserve(prefix.size() + static_cast<size_t>(in_lens[i]));
    for (int64_t k = 0; k < in_lens[i]; ++k) {
      r.prompt_ids.push_back(allowed_ids[(offsets[i] + i + static_cast<size_t>(k)) % allowed_ids.size()]);
    }
    r.prompt_len = static_cast<int64_t>(r.prompt_ids.size());
    r.output_len = out_lens[i];
  }
  return out;
}

std::vector<MultiTurnRequest> multi_turn_dataset(const MultiTurnParams& p, const std::vector<int32_t>& allowed_ids) {
  if (p.conversations < 1) invalid_input("--multi-turn-conversations must be at least 1, got {}", p.conversations);
  if (p.turns < 1) invalid_input("--multi-turn-turns must be at least 1, got {}", p.turns);
  if (p.input_len < 1) invalid_input("--random-input-len must be at least 1, got {}", p.input_len);
  if (p.output_len < 1) invalid_input("--random-output-len must be at least 1, got {}", p.output_len);
  if (p.prefix_len < 0) invalid_input("--random-prefix-len must be >= 0, got {}", p.prefix_len);
  if (allowed_ids.empty()) invalid_input("the tokenizer leaves no non-special token ids to draw prompts from");
  std::mt19937_64 rng(p.seed);
  std::uniform_int_distribution<size_t> id_dist(0, allowed_ids.size() - 1);
  auto draw = [&](int64_t n) {
    std::vector<int32_t> v(static_cast<size_t>(n));
    for (auto& x : v) x = allowed_ids[id_dist(rng)];
    return v;
  };
  const std::vector<int32_t> prefix = draw(p.prefix_len);
  std::vector<std::vector<int32_t>> history(static_cast<size_t>(p.conversations), prefix);
  std::vector<MultiTurnRequest> out;
  for (int64_t t = 0; t < p.turns; ++t) {
    for (int64_t c = 0; c < p.conversations; ++c) {
      std::vector<int32_t>& h = history[static_cast<size_t>(c)];
      const std::vector<int32_t> user = draw(p.input_len);
      h.insert(h.end(), user.begin(), user.end());
      MultiTurnRequest r;
      r.sample.prompt_ids = h;
      r.sample.prompt_len = static_cast<int64_t>(h.size());
      r.sample.output_len = p.output_len;
      r.after = t == 0 ? -1 : static_cast<int64_t>(out.size()) - p.conversations;
      out.push_back(std::move(r));
      const std::vector<int32_t> reply = draw(p.output_len);  // the recorded answer the next turn resends
      h.insert(h.end(), reply.begin(), reply.end());
    }
  }
  return out;
}

std::vector<double> arrival_times(int64_t n, double request_rate, double burstiness, uint64_t seed) {
  if (!(request_rate > 0.0)) invalid_input("--request-rate must be > 0 (or inf), got {}", request_rate);
  if (!(burstiness > 0.0)) invalid_input("--burstiness must be > 0, got {}", burstiness);
  std::vector<double> t(static_cast<size_t>(std::max<int64_t>(n, 0)), 0.0);
  if (t.empty() || std::isinf(request_rate)) return t;
  std::mt19937_64 rng(seed);
  double acc = 0.0;
  if (std::isinf(burstiness)) {
    for (auto& v : t) v = (acc += 1.0 / request_rate);
  } else {
    std::gamma_distribution<double> gap(burstiness, 1.0 / (request_rate * burstiness));
    for (auto& v : t) v = (acc += gap(rng));
  }
  if (acc > 0.0) {
    // As vLLM: rescale so that n requests span n / rate, so runs with different seeds offer the same load.
    const double scale = (static_cast<double>(n) / request_rate) / acc;
    for (auto& v : t) v *= scale;
  }
  return t;
}

}  // namespace chimera::bench_serve
