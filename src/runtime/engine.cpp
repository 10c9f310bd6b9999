#include "runtime/engine.h"

#include <algorithm>
#include <map>

#include "core/error.h"

namespace chimera {

Engine::Engine(const NemotronH& model, const ops::Context& ctx, const EngineConfig& config)
    : model_(model),
      ctx_(ctx),
      config_(config),
      cache_(model.config(), config.cache, ctx.device, model.activation_dtype()),
      scheduler_(config.scheduler, cache_),
      stop_ids_(model.config().eos_token_ids) {
  if (ctx.device != model.device()) {
    runtime_error("Engine: the model was loaded for the {} but the context is the {}",
                  model.device() == Device::kCpu ? "CPU" : "GPU", ctx.device == Device::kCpu ? "CPU" : "GPU");
  }
}

int32_t Engine::add_request(std::vector<int32_t> prompt, const SamplingParams& sampling) {
  sampling.validate();
  const int64_t V = model_.config().vocab_size;
  for (size_t i = 0; i < prompt.size(); ++i) {
    if (prompt[i] < 0 || prompt[i] >= V) {
      invalid_input("prompt token {} at position {} is outside the vocabulary [0, {})", prompt[i], i, V);
    }
  }
  Sequence s;
  s.id = next_id_++;
  s.prompt_len = static_cast<int32_t>(prompt.size());
  s.tokens = std::move(prompt);
  s.sampling = sampling;
  scheduler_.add(std::move(s));
  return next_id_ - 1;
}

std::vector<TokenEvent> Engine::step() {
  std::vector<TokenEvent> events;
  const SchedulerOutput plan = scheduler_.schedule();
  if (plan.empty()) {
    if (scheduler_.has_unfinished() && scheduler_.num_running() == 0) {
      runtime_error("scheduler made no progress: {} waiting request(s) do not fit the caches",
                    scheduler_.num_waiting());
    }
    return events;
  }

  // ---- build the step batch (prefill sequences first, then decodes) ----
  StepBatch b;
  std::vector<const ScheduledSeq*> order;
  for (const ScheduledSeq& s : plan.prefill) order.push_back(&s);
  for (const ScheduledSeq& s : plan.decode) order.push_back(&s);
  b.num_prefill_seqs = static_cast<int32_t>(plan.prefill.size());
  const int32_t max_blocks = cache_.blocks_per_seq();
  b.block_tables = Tensor::zeros(DType::kI32, {static_cast<int64_t>(order.size()), max_blocks});
  // For each sequence: does this step produce a token for it, and which logits rows belong to it.
  struct RowOwner {
    int32_t seq_id;
    bool samples;
  };
  std::vector<RowOwner> row_owner;
  for (size_t i = 0; i < order.size(); ++i) {
    Sequence& s = scheduler_.get(order[i]->seq_id);
    const int32_t n = order[i]->num_tokens;
    const int32_t start = b.num_tokens();
    b.token_ids.insert(b.token_ids.end(), s.tokens.begin() + s.num_computed, s.tokens.begin() + s.num_computed + n);
    b.cu_seqlens.push_back(b.num_tokens());
    b.context_lens.push_back(s.num_computed);
    b.state_slots.push_back(s.slot);
    std::copy(s.blocks.begin(), s.blocks.end(), b.block_tables.i32() + static_cast<int64_t>(i) * max_blocks);
    const bool reaches_end = s.num_computed + n == static_cast<int32_t>(s.tokens.size());
    if (config_.return_prompt_logits && s.in_prefill()) {
      for (int32_t r = 0; r < n; ++r) {
        b.logit_rows.push_back(start + r);
        row_owner.push_back({s.id, reaches_end && r == n - 1});
      }
    } else if (reaches_end) {
      b.logit_rows.push_back(start + n - 1);
      row_owner.push_back({s.id, true});
    }
  }

  // ---- execute ----
  Tensor logits = model_.forward(ctx_, b, cache_.state());

  // ---- update ----
  for (size_t i = 0; i < order.size(); ++i) {
    Sequence& s = scheduler_.get(order[i]->seq_id);
    s.num_computed += order[i]->num_tokens;
  }
  const int64_t V = model_.config().vocab_size;
  for (size_t r = 0; r < row_owner.size(); ++r) {
    const std::span<const float> row(logits.f32() + static_cast<int64_t>(r) * V, static_cast<size_t>(V));
    Sequence& s = scheduler_.get(row_owner[r].seq_id);
    if (on_logits) on_logits(s.id, row);
    if (!row_owner[r].samples) continue;
    if (s.sampling.max_new_tokens == 0) {
      s.finish = FinishReason::kLength;
      events.push_back({s.id, -1, s.finish});
      continue;
    }
    const int32_t tok = sample_token(row, s.sampling, static_cast<uint64_t>(s.num_generated()));
    s.tokens.push_back(tok);
    const bool eos = !s.sampling.ignore_eos && std::find(stop_ids_.begin(), stop_ids_.end(), tok) != stop_ids_.end();
    if (eos) {
      s.finish = FinishReason::kStop;
    } else if (s.num_generated() >= s.sampling.max_new_tokens ||
               static_cast<int32_t>(s.tokens.size()) >= cache_.sizes().max_model_len) {
      s.finish = FinishReason::kLength;
    }
    events.push_back({s.id, tok, s.finish});
  }
  for (Sequence& s : scheduler_.collect_finished()) finished_.push_back(std::move(s));
  return events;
}

std::vector<Sequence> Engine::take_finished() {
  std::vector<Sequence> out;
  out.swap(finished_);
  return out;
}

std::vector<std::vector<int32_t>> generate_all(const NemotronH& model, const ops::Context& ctx,
                                               const EngineConfig& config,
                                               const std::vector<std::vector<int32_t>>& prompts,
                                               const SamplingParams& sampling) {
  Engine engine(model, ctx, config);
  std::vector<int32_t> ids;
  for (const auto& p : prompts) ids.push_back(engine.add_request(p, sampling));
  while (engine.has_unfinished()) engine.step();
  std::map<int32_t, std::vector<int32_t>> by_id;
  for (Sequence& s : engine.take_finished()) {
    by_id[s.id] = std::vector<int32_t>(s.tokens.begin() + s.prompt_len, s.tokens.end());
  }
  std::vector<std::vector<int32_t>> out;
  for (int32_t id : ids) out.push_back(by_id[id]);
  return out;
}

}  // namespace chimera
