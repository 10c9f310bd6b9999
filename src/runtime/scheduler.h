// The scheduler decides, as plain data, which sequences run in the next step and how many tokens each
// (design.md "The engine loop"): every running decode sequence gets one token; then waiting or partly
// prefilled prompts fill the remaining token budget (chunked prefill), while Mamba slots and KV blocks last.
// It never touches tensors, so it is tested without a model.
#pragma once

#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <vector>

#include "runtime/sampler.h"
#include "runtime/state_cache.h"

namespace chimera {

// kAbort: the caller removed the sequence (Engine::abort_request) before it stopped or reached its length.
// kError: the sequence cannot go on (non-finite logits); Sequence::error / TokenEvent::error say why.
enum class FinishReason { kNone, kStop, kLength, kAbort, kError };

struct Sequence {
  int32_t id = 0;
  std::vector<int32_t> tokens;  // prompt followed by generated tokens
  int32_t prompt_len = 0;
  int32_t num_computed = 0;     // tokens whose state is in the caches
  int32_t slot = -1;            // Mamba state slot
  std::vector<int32_t> blocks;  // KV blocks
  SamplingParams sampling;
  FinishReason finish = FinishReason::kNone;
  std::string error;  // kError: the message

  int32_t num_generated() const { return static_cast<int32_t>(tokens.size()) - prompt_len; }
  bool finished() const { return finish != FinishReason::kNone; }
  bool in_prefill() const { return num_computed < prompt_len; }
};

struct ScheduledSeq {
  int32_t seq_id;
  int32_t num_tokens;  // new tokens this step
};

struct SchedulerOutput {
  std::vector<ScheduledSeq> prefill;  // first in the packed batch
  std::vector<ScheduledSeq> decode;   // one token each
  bool empty() const { return prefill.empty() && decode.empty(); }
};

struct SchedulerConfig {
  int32_t max_num_seqs = 8;               // sequences in flight
  int32_t max_num_batched_tokens = 2048;  // tokens per step (prefill chunks + decodes)
};

class Scheduler {
 public:
  Scheduler(const SchedulerConfig& config, StateCache& cache);

  // Takes ownership of the sequence; it waits until a slot and blocks are free.
  void add(Sequence seq);
  SchedulerOutput schedule();
  // Frees the slot and blocks of finished sequences and forgets them; returns them.
  std::vector<Sequence> collect_finished();
  // Removes a waiting or running, unfinished sequence at once, freeing its slot and blocks; it comes back with
  // finish = kAbort. nullopt (and nothing changes) for an unknown or already finished id.
  std::optional<Sequence> abort(int32_t id);

  Sequence& get(int32_t id);
  bool has_unfinished() const { return !waiting_.empty() || !running_.empty(); }
  size_t num_running() const { return running_.size(); }
  size_t num_waiting() const { return waiting_.size(); }

 private:
  SchedulerConfig config_;
  StateCache& cache_;
  std::deque<Sequence> waiting_;
  std::vector<Sequence> running_;  // admitted: own a slot; prefilling or decoding
};

}  // namespace chimera
