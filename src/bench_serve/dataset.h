// The random dataset of `chimera bench serve` (vLLM's `--dataset-name random`): per request an input length
// and an output length drawn uniformly from [floor(len * (1 - r)), ceil(len * (1 + r))] (output at least 1),
// a prefix of --random-prefix-len random token ids shared by every prompt, then input_len ids that run through
// the allowed vocabulary from a random offset: allowed[(offset + i + k) % allowed.size()], k = 0..input_len-1.
// Allowed ids are the vocabulary minus the tokenizer's special tokens. Prompts are sent as token-id lists, so
// every prompt's length is exact (vLLM decodes them to text and re-encodes, which can shift a few tokens).
// The generator is a seeded std::mt19937_64: runs with one seed repeat exactly, but the ids differ from
// numpy's for the same seed.
#pragma once

#include <cstdint>
#include <vector>

namespace chimera::bench_serve {

struct RandomDatasetParams {
  int64_t num_prompts = 1000;
  int64_t input_len = 1024;
  int64_t output_len = 128;
  double range_ratio = 0.0;  // [0, 1)
  int64_t prefix_len = 0;
  uint64_t seed = 0;
};

struct SampleRequest {
  std::vector<int32_t> prompt_ids;  // prefix + unique part
  int64_t prompt_len = 0;
  int64_t output_len = 0;
};

// Throws invalid_input naming the flag for a bad range ratio, lengths below 1 or an empty allowed vocabulary.
std::vector<SampleRequest> random_dataset(const RandomDatasetParams& p, const std::vector<int32_t>& allowed_ids);

// The multi-turn chat replay (--dataset-name multi-turn): `conversations` conversations of `turns` turns each. A
// conversation opens with the shared prefix (--random-prefix-len, a system prompt) and each turn adds a user
// message of input_len random ids; turn t's prompt is the whole conversation so far: the prefix, then every earlier
// turn's user message followed by its recorded assistant reply (output_len random ids, as a replayed chat log
// carries the original answers), then turn t's user message. Requests come turn by turn (every conversation's turn
// 0, then every turn 1, ...), each after the previous turn of its conversation (`after`, the client waits for it).
struct MultiTurnParams {
  int64_t conversations = 16;
  int64_t turns = 4;
  int64_t input_len = 256;
  int64_t output_len = 128;
  int64_t prefix_len = 0;
  uint64_t seed = 0;
};
struct MultiTurnRequest {
  SampleRequest sample;
  int64_t after = -1;  // the request of the conversation's previous turn
};
std::vector<MultiTurnRequest> multi_turn_dataset(const MultiTurnParams& p, const std::vector<int32_t>& allowed_ids);

// Offsets (seconds from the run's start) at which each of n requests arrives, as vLLM's get_request: for a
// finite rate the gaps are Gamma(shape = burstiness, scale = 1 / (rate * burstiness)) (burstiness 1: Poisson
// arrivals), cumulated, then rescaled so that the last arrival is at n / rate exactly; all 0 for rate = inf.
std::vector<double> arrival_times(int64_t n, double request_rate, double burstiness, uint64_t seed);

}  // namespace chimera::bench_serve
