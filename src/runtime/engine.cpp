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
  // Graph capture needs a stream of our own (the legacy default stream cannot be captured).
  if (ctx_.device == Device::kCuda && ctx_.stream == nullptr) {
    own_stream_ = device::Stream::create();
    ctx_.stream = own_stream_.get();
  }
}

std::vector<int32_t> Engine::graph_batch_sizes() const {
  std::vector<int32_t> sizes;
  for (const auto& [b, g] : graphs_) sizes.push_back(b);
  return sizes;
}

size_t Engine::graph_pool_bytes() const { return graph_pool_ ? graph_pool_->bytes() : 0; }

Tensor Engine::execute(StepBatch& b) {
  if (ctx_.device == Device::kCpu) return model_.forward(ctx_, b, cache_.state());
  const bool decode_only = b.num_prefill_seqs == 0 && b.logit_rows.size() == b.token_ids.size();
  if (config_.cuda_graphs && decode_only) {
    const int32_t B = b.num_seqs();
    if (graphs_.count(B) != 0 || ++decode_steps_seen_[B] >= 2) return replay_decode(b);
  }
  return model_.forward_device(ctx_, b, cache_.state());
}

Tensor Engine::replay_decode(StepBatch& b) {
  const int32_t B = b.num_seqs();
  const int64_t max_blocks = b.block_tables.dim(1);
  auto it = graphs_.find(B);
  const bool capture = it == graphs_.end();
  if (capture) {
    DecodeGraph g;
    g.meta_host = device::empty_pinned(DType::kI32, {4 * int64_t{B} + 1});
    g.meta_device = device::empty(Device::kCuda, DType::kI32, {4 * int64_t{B} + 1});
    g.tables_host = device::empty_pinned(DType::kI32, {B, max_blocks});
    g.tables_device = device::empty(Device::kCuda, DType::kI32, {B, max_blocks});
    it = graphs_.emplace(B, std::move(g)).first;
  }
  DecodeGraph& g = it->second;
  // Stage this step's metadata and copy it to the graph's fixed device inputs (ordered before the replay).
  int32_t* m = g.meta_host.i32();
  std::copy(b.token_ids.begin(), b.token_ids.end(), m);
  std::copy(b.cu_seqlens.begin(), b.cu_seqlens.end(), m + B);
  std::copy(b.context_lens.begin(), b.context_lens.end(), m + 2 * B + 1);
  std::copy(b.state_slots.begin(), b.state_slots.end(), m + 3 * B + 1);
  std::copy(b.block_tables.i32(), b.block_tables.i32() + b.block_tables.numel(), g.tables_host.i32());
  device::copy_async(g.meta_device, g.meta_host, ctx_.stream);
  device::copy_async(g.tables_device, g.tables_host, ctx_.stream);
  if (capture) {
    const int32_t* d = g.meta_device.i32();
    const StepBatch::DeviceMeta dm{d, d + B, d + 2 * B + 1, d + 3 * B + 1, g.tables_device};
    b.device_meta = &dm;
    if (!graph_pool_) graph_pool_.emplace();
    const device::ScopedAllocPool scope(*graph_pool_);
    g.graph = device::Graph::capture(ctx_.stream, [&] { g.logits = model_.forward_device(ctx_, b, cache_.state()); });
    b.device_meta = nullptr;
  }
  g.graph.launch(ctx_.stream);
  return g.logits;
}

std::vector<int32_t> Engine::sample_on_device(const Tensor& logits, const std::vector<ops::SamplingRow>& rows) {
  Tensor f32 = logits;
  if (logits.dtype() != DType::kF32) {
    f32 = device::empty(Device::kCuda, DType::kF32, logits.shape());
    ops::convert(ctx_, f32, logits);
  }
  const Tensor ids = device::empty(Device::kCuda, DType::kI32, {logits.dim(0)});
  ops::sample_tokens(ctx_, ids, f32, rows);
  const Tensor host = device::to_host(ids);  // waits for the step
  return std::vector<int32_t>(host.i32(), host.i32() + host.numel());
}

int32_t Engine::add_request(std::vector<int32_t> prompt, const SamplingParams& sampling) {
  sampling.validate();
  const int64_t V = model_.config().vocab_size;
  for (size_t i = 0; i < prompt.size(); ++i) {
    if (prompt[i] < 0 || prompt[i] >= V) {
      invalid_input("prompt token {} at position {} is outside the vocabulary [0, {})", prompt[i], i, V);
    }
  }
  if (static_cast<int64_t>(prompt.size()) > cache_.sizes().max_model_len) {
    invalid_input("the prompt is {} tokens, longer than the maximum model length {}", prompt.size(),
                  cache_.sizes().max_model_len);
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
  Tensor logits = execute(b);

  // ---- update ----
  for (size_t i = 0; i < order.size(); ++i) {
    Sequence& s = scheduler_.get(order[i]->seq_id);
    s.num_computed += order[i]->num_tokens;
  }
  // On the GPU, when every logits row samples and nobody asked for the rows themselves, sampling runs there and
  // only the token ids come back; otherwise the rows come to the host (fp32) and are sampled there.
  std::vector<int32_t> device_tokens;
  if (ctx_.device == Device::kCuda) {
    bool all_sample = !on_logits;
    std::vector<ops::SamplingRow> rows;
    for (size_t r = 0; all_sample && r < row_owner.size(); ++r) {
      const Sequence& s = scheduler_.get(row_owner[r].seq_id);
      all_sample = row_owner[r].samples && s.sampling.max_new_tokens > 0;
      rows.push_back({s.sampling.temperature, s.sampling.top_k, s.sampling.top_p, s.sampling.seed,
                      static_cast<uint64_t>(s.num_generated())});
    }
    if (all_sample && !rows.empty()) {
      device_tokens = sample_on_device(logits, rows);
    } else {
      logits = device::to_host_f32(logits);
    }
  }
  const int64_t V = model_.config().vocab_size;
  for (size_t r = 0; r < row_owner.size(); ++r) {
    Sequence& s = scheduler_.get(row_owner[r].seq_id);
    const bool on_host = device_tokens.empty();
    const std::span<const float> row(on_host ? logits.f32() + static_cast<int64_t>(r) * V : nullptr,
                                     on_host ? static_cast<size_t>(V) : 0);
    if (on_logits) on_logits(s.id, row);
    if (!row_owner[r].samples) continue;
    if (s.sampling.max_new_tokens == 0) {
      s.finish = FinishReason::kLength;
      events.push_back({s.id, -1, s.finish});
      continue;
    }
    const int32_t tok = on_host ? sample_token(row, s.sampling, static_cast<uint64_t>(s.num_generated()))
                                : device_tokens[r];
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
