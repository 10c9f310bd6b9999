// The engine loop: schedule -> execute -> update (design.md). One Engine runs one model on one backend.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "models/nemotron_h.h"
#include "runtime/scheduler.h"
#include "runtime/state_cache.h"

namespace chimera {

struct EngineConfig {
  CacheSizes cache;
  SchedulerConfig scheduler;
  // Return logits for every prompt position (scoring, --logits-out), not just the last one.
  bool return_prompt_logits = false;
};

struct TokenEvent {
  int32_t seq_id;
  int32_t token;
  FinishReason finish;  // kNone while the sequence goes on
};

class Engine {
 public:
  // ctx.device must be the model's device; the caches are allocated there in the model's activation dtype.
  Engine(const NemotronH& model, const ops::Context& ctx, const EngineConfig& config);

  // Queues a request; returns its sequence id. Bad prompts / parameters -> kInvalidInput.
  int32_t add_request(std::vector<int32_t> prompt, const SamplingParams& sampling);
  bool has_unfinished() const { return scheduler_.has_unfinished(); }
  // One step; returns the tokens sampled in it, in batch order.
  std::vector<TokenEvent> step();
  // Sequences finished so far (tokens = prompt + generated), removed from the engine.
  std::vector<Sequence> take_finished();

  // Called with each logits row the engine produces, in order per sequence: prompt rows (when
  // return_prompt_logits) then one row per generated token.
  std::function<void(int32_t seq_id, std::span<const float> logits)> on_logits;

  const StateCache& cache() const { return cache_; }

 private:
  const NemotronH& model_;
  ops::Context ctx_;
  EngineConfig config_;
  StateCache cache_;
  Scheduler scheduler_;
  std::vector<int64_t> stop_ids_;
  std::vector<Sequence> finished_;
  int32_t next_id_ = 0;
};

// Convenience: runs the engine to completion over several prompts; returns each generated token list.
std::vector<std::vector<int32_t>> generate_all(const NemotronH& model, const ops::Context& ctx,
                                               const EngineConfig& config,
                                               const std::vector<std::vector<int32_t>>& prompts,
                                               const SamplingParams& sampling);

}  // namespace chimera
