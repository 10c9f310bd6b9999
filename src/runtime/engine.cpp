#include "runtime/engine.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <unordered_map>

#include <fmt/core.h>

#include "core/error.h"
#include "runtime/cache_sizing.h"
#include "runtime/memory_plan.h"

namespace chimera {
namespace {
// A sequence's prompt and generated tokens, for the sampling penalties.
std::span<const int32_t> prompt_of(const Sequence& s) {
  return std::span<const int32_t>(s.tokens).first(static_cast<size_t>(s.prompt_len));
}
std::span<const int32_t> generated_of(const Sequence& s) {
  return std::span<const int32_t>(s.tokens).subspan(static_cast<size_t>(s.prompt_len));
}

bool uses_graphs(const EngineConfig& c, Device device) { return device == Device::kCuda && c.cuda_graphs; }

// The graph buckets: vLLM's sizes up to the largest decode batch the scheduler can form.
std::vector<int32_t> graph_buckets(const EngineConfig& c, Device device) {
  if (!uses_graphs(c, device)) return {};
  return cuda_graph_batch_sizes(std::min(c.scheduler.max_num_seqs, c.cache.max_seqs));
}

// The caches as configured, plus a scratch slot and block for each pad row a bucket can carry.
CacheSizes with_pad_scratch(const EngineConfig& c, Device device) {
  CacheSizes sizes = c.cache;
  sizes.num_pad = cuda_graph_pad_rows(graph_buckets(c, device));
  return sizes;
}
}  // namespace

Engine::Engine(const Model& model, const ops::Context& ctx, const EngineConfig& config)
    : model_(model),
      ctx_(ctx),
      config_(config),
      cache_(model.config(), with_pad_scratch(config, ctx.device), ctx.device, model.activation_dtype()),
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
  if (uses_graphs(config_, ctx_.device)) capture_decode_graphs();
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
  if (!graphs_.empty() && decode_only) return replay_decode(b);
  return model_.forward_device(ctx_, b, cache_.state());
}

StepBatch::DeviceMeta Engine::DecodeGraph::device_meta() const {
  const int64_t n = meta_device.numel() / 4;  // 4n + 1 entries
  const int32_t* d = meta_device.i32();
  return StepBatch::DeviceMeta{d, d + n, d + 2 * n + 1, d + 3 * n + 1, tables_device};
}

void Engine::stage_decode(DecodeGraph& g, int32_t n, const StepBatch& b) const {
  const int32_t B = b.num_seqs();
  CHIMERA_CHECK(B <= n && n - B <= cache_.sizes().num_pad, "a decode step of {} rows on the graph of {} rows ({} pad "
                "slots)", B, n, cache_.sizes().num_pad);
  const int64_t max_blocks = g.tables_host.dim(1);
  CHIMERA_CHECK(b.block_tables.dim(1) == max_blocks, "block tables of {} columns for a graph of {}",
                b.block_tables.dim(1), max_blocks);
  int32_t* tokens = g.meta_host.i32();
  int32_t* cu = tokens + n;
  int32_t* context = cu + n + 1;
  int32_t* slots = context + n;
  int32_t* tables = g.tables_host.i32();
  std::copy(b.token_ids.begin(), b.token_ids.end(), tokens);
  std::copy(b.cu_seqlens.begin(), b.cu_seqlens.end(), cu);
  std::copy(b.context_lens.begin(), b.context_lens.end(), context);
  std::copy(b.state_slots.begin(), b.state_slots.end(), slots);
  std::copy(b.block_tables.i32(), b.block_tables.i32() + b.block_tables.numel(), tables);
  // Pad rows: token 0, one new token on no context (so one block holds it at any block size), each its own
  // zero-started scratch slot and block, so no two rows of the step share state and every value they make is
  // finite. Their block-table rows are zero past the first entry, as a real row's unused entries are.
  std::fill(tables + int64_t{B} * max_blocks, tables + int64_t{n} * max_blocks, 0);
  for (int32_t r = B; r < n; ++r) {
    tokens[r] = 0;
    cu[r + 1] = cu[r] + 1;
    context[r] = 0;
    slots[r] = cache_.pad_slot(r - B);
    tables[int64_t{r} * max_blocks] = cache_.pad_block(r - B);
  }
  device::copy_async(g.meta_device, g.meta_host, ctx_.stream);
  device::copy_async(g.tables_device, g.tables_host, ctx_.stream);
}

void Engine::capture_decode_graphs() {
  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<int32_t> buckets = graph_buckets(config_, ctx_.device);
  const int32_t max_blocks = cache_.blocks_per_seq();
  const int32_t total_blocks = cache_.sizes().num_blocks + cache_.sizes().num_pad;
  graph_pool_.emplace();
  // Largest first: a smaller bucket's activations may reuse blocks the larger captures returned to the pool.
  for (auto it = buckets.rbegin(); it != buckets.rend(); ++it) {
    const int32_t n = *it;
    // The warm-up and capture batch: n rows shaped like pad rows (token 0, one token on no context), row i in
    // slot i and block i of the caches, which no sequence holds yet (n <= max_seqs; a sequence's slot is zeroed
    // when it is handed out, and its KV positions are written before they are read). Only a pool smaller than n
    // blocks makes rows share a block, in this discarded warm-up alone.
    StepBatch b;
    b.token_ids.assign(static_cast<size_t>(n), 0);
    b.block_tables = Tensor::zeros(DType::kI32, {n, max_blocks});
    for (int32_t r = 0; r < n; ++r) {
      b.cu_seqlens.push_back(r + 1);
      b.context_lens.push_back(0);
      b.state_slots.push_back(r);
      b.block_tables.i32()[int64_t{r} * max_blocks] = r % total_blocks;
      b.logit_rows.push_back(r);
    }
    DecodeGraph g;
    g.meta_host = device::empty_pinned(DType::kI32, {4 * int64_t{n} + 1});
    g.meta_device = device::empty(Device::kCuda, DType::kI32, {4 * int64_t{n} + 1});
    g.tables_host = device::empty_pinned(DType::kI32, {n, max_blocks});
    g.tables_device = device::empty(Device::kCuda, DType::kI32, {n, max_blocks});
    stage_decode(g, n, b);
    const StepBatch::DeviceMeta dm = g.device_meta();
    b.device_meta = &dm;
    // The warm-up runs the very launches the capture records (same inputs, same addresses), so every per-shape
    // cache they fill on first use is filled outside the capture.
    const Tensor warm = model_.forward_device(ctx_, b, cache_.state());
    // Every graph leaves its logits in one buffer of the largest bucket's rows (the first captured), outside the
    // pool: the forward's own logits block then returns to the pool at the end of the capture like any other
    // activation, and the next (smaller) capture reuses it. Kept per graph, the logits of all buckets would be
    // the pool's largest part (sum of n x vocab over the buckets).
    if (!graph_logits_) graph_logits_ = device::empty(Device::kCuda, warm.dtype(), {n, warm.dim(1)});
    g.logits = graph_logits_.rows(0, n);
    {
      const device::ScopedAllocPool scope(*graph_pool_);
      g.graph = device::Graph::capture(ctx_.stream, [&] {
        const Tensor logits = model_.forward_device(ctx_, b, cache_.state());
        device::copy_async(g.logits, logits, ctx_.stream);
      });
    }
    graphs_.emplace(n, std::move(g));
  }
  device::synchronize(Device::kCuda);
  graph_capture_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

Tensor Engine::replay_decode(const StepBatch& b) {
  const int32_t B = b.num_seqs();
  auto it = graphs_.lower_bound(B);
  // The scheduler never runs more than max_num_seqs (and max_seqs) sequences, the largest bucket.
  CHIMERA_CHECK(it != graphs_.end(), "a decode step of {} sequences is above the largest CUDA graph bucket {}", B,
                graphs_.rbegin()->first);
  DecodeGraph& g = it->second;
  stage_decode(g, it->first, b);
  g.graph.launch(ctx_.stream);
  ++num_graph_steps_;
  return B == it->first ? g.logits : g.logits.rows(0, B);
}

std::vector<SampledToken> Engine::sample_on_device(const Tensor& logits, const std::vector<ops::SamplingRow>& rows,
                                                   const std::vector<ops::PenaltyToken>& penalty_tokens,
                                                   bool want_logprobs) {
  Tensor f32 = logits;
  if (logits.dtype() != DType::kF32) {
    f32 = device::empty(Device::kCuda, DType::kF32, logits.shape());
    ops::convert(ctx_, f32, logits);
  }
  const int64_t R = logits.dim(0);
  int32_t K = 0;
  for (const ops::SamplingRow& r : rows) K = std::max(K, r.num_top_logprobs);
  // ids and non-finite flags share one buffer (one copy back); logprobs only when asked.
  const Tensor ints = device::empty(Device::kCuda, DType::kI32, {2 * R});
  ops::SamplingOutputs out;
  out.ids = ints.rows(0, R);
  out.nonfinite = ints.rows(R, 2 * R);
  if (want_logprobs) out.logprobs = device::empty(Device::kCuda, DType::kF32, {R});
  if (K > 0) {
    out.top_ids = device::empty(Device::kCuda, DType::kI32, {R, K});
    out.top_logprobs = device::empty(Device::kCuda, DType::kF32, {R, K});
  }
  ops::sample_tokens(ctx_, out, f32, rows, penalty_tokens);
  const Tensor host = device::to_host(ints);  // waits for the step
  std::vector<SampledToken> tokens(static_cast<size_t>(R));
  for (int64_t r = 0; r < R; ++r) {
    tokens[r].id = host.i32()[r];
    tokens[r].nonfinite = host.i32()[R + r] != 0;
  }
  if (want_logprobs) {
    const Tensor lp = device::to_host(out.logprobs);
    for (int64_t r = 0; r < R; ++r) tokens[r].logprob = lp.f32()[r];
  }
  if (K > 0) {
    const Tensor ti = device::to_host(out.top_ids), tl = device::to_host(out.top_logprobs);
    for (int64_t r = 0; r < R; ++r) {
      for (int32_t j = 0; j < rows[r].num_top_logprobs; ++j) {
        tokens[r].top_logprobs.emplace_back(ti.i32()[r * K + j], tl.f32()[r * K + j]);
      }
    }
  }
  return tokens;
}

int32_t Engine::add_request(std::vector<int32_t> prompt, const SamplingParams& sampling) {
  sampling.validate();
  const int64_t V = model_.config().vocab_size;
  for (size_t i = 0; i < prompt.size(); ++i) {
    if (prompt[i] < 0 || prompt[i] >= V) {
      invalid_input("prompt token {} at position {} is outside the vocabulary [0, {})", prompt[i], i, V);
    }
  }
  for (size_t i = 0; i < sampling.stop_token_ids.size(); ++i) {
    if (sampling.stop_token_ids[i] >= V) {
      invalid_input("stop_token_ids (--stop-token-ids): entry {} is {}, outside the vocabulary [0, {})", i,
                    sampling.stop_token_ids[i], V);
    }
  }
  if (static_cast<int64_t>(prompt.size()) > cache_.sizes().max_model_len) {
    invalid_input("the prompt is {} tokens, longer than the maximum model length {}", prompt.size(),
                  cache_.sizes().max_model_len);
  }
  Sequence s;
  s.id = next_id_;
  s.prompt_len = static_cast<int32_t>(prompt.size());
  s.tokens = std::move(prompt);
  s.sampling = sampling;
  scheduler_.add(std::move(s));  // may refuse it: the id is spent only once it is queued
  return next_id_++;
}

std::vector<TokenEvent> Engine::step() {
  std::vector<TokenEvent> events;
  last_step_ = StepStats{};
  const SchedulerOutput plan = scheduler_.schedule();
  if (plan.empty()) {
    if (scheduler_.has_unfinished() && scheduler_.num_running() == 0) {
      runtime_error("scheduler made no progress: {} waiting request(s) do not fit the caches",
                    scheduler_.num_waiting());
    }
    return events;
  }

  // ---- build the step batch ----
  // Sequences with several new tokens, or none in context, run the multi-token kernels (varlen conv, chunked
  // scan, attention over context + new rows) and come first; sequences with one new token after a context run
  // the single-token kernels (conv update, selective state update, decode attention).
  // The step's sequences by id, looked up once (a step of a thousand decodes must not search the running list per
  // lookup); the pointers stay valid until the scheduler next changes its lists, after this step's update.
  std::unordered_map<int32_t, Sequence*> by_id;
  by_id.reserve(plan.seqs.size());
  for (Sequence& s : scheduler_.running()) by_id.emplace(s.id, &s);
  auto seq = [&by_id](int32_t id) -> Sequence& {
    auto it = by_id.find(id);
    CHIMERA_CHECK(it != by_id.end(), "scheduled sequence {} is not running", id);
    return *it->second;
  };
  StepBatch b;
  std::vector<ScheduledSeq> order;
  for (const ScheduledSeq& p : plan.seqs) {
    if (p.num_tokens > 1 || seq(p.seq_id).num_computed == 0) order.push_back(p);
  }
  b.num_prefill_seqs = static_cast<int32_t>(order.size());
  for (const ScheduledSeq& p : plan.seqs) {
    if (p.num_tokens == 1 && seq(p.seq_id).num_computed > 0) order.push_back(p);
  }
  const int32_t max_blocks = cache_.blocks_per_seq();
  b.block_tables = Tensor::zeros(DType::kI32, {static_cast<int64_t>(order.size()), max_blocks});
  // For each logits row: its sequence, whether this step samples from it, whether on_logits sees it, and the
  // prompt position whose token it scores for the sequence's prompt_logprobs (-1: none).
  struct RowOwner {
    int32_t seq_id;
    bool samples;
    bool reported;
    int32_t scores = -1;
  };
  std::vector<RowOwner> row_owner;
  for (size_t i = 0; i < order.size(); ++i) {
    Sequence& s = seq(order[i].seq_id);
    const int32_t n = order[i].num_tokens;
    const int32_t start = b.num_tokens();
    b.token_ids.insert(b.token_ids.end(), s.tokens.begin() + s.num_computed, s.tokens.begin() + s.num_computed + n);
    b.cu_seqlens.push_back(b.num_tokens());
    b.context_lens.push_back(s.num_computed);
    b.state_slots.push_back(s.slot);
    std::copy(s.blocks.begin(), s.blocks.end(), b.block_tables.i32() + static_cast<int64_t>(i) * max_blocks);
    // Row r holds the logits after token s.num_computed + r. A row is reported once: a preempted sequence
    // recomputing its tokens reports only rows past num_computed_max; the last row samples the next token.
    // A sequence asking for prompt_logprobs gets the rows of its prompt positions 0 .. prompt_len - 2, chunk by
    // chunk: row r scores prompt token s.num_computed + r + 1.
    const bool reaches_end = s.num_computed + n == static_cast<int32_t>(s.tokens.size());
    for (int32_t r = 0; r < n; ++r) {
      const int32_t pos = s.num_computed + r;
      const bool last = reaches_end && r == n - 1;
      const bool fresh = pos >= s.num_computed_max;
      const bool scores = s.sampling.prompt_logprobs >= 0 && fresh && pos + 1 < s.prompt_len;
      const bool reported = last || (config_.return_prompt_logits && fresh);
      if (reported || scores) {
        b.logit_rows.push_back(start + r);
        row_owner.push_back({s.id, last, reported, scores ? pos + 1 : -1});
      }
    }
  }

  // ---- execute ----
  const int64_t graph_steps_before = num_graph_steps_;
  Tensor logits = execute(b);
  last_step_.prefill_tokens = b.num_prefill_tokens();
  last_step_.decode_tokens = b.num_tokens() - b.num_prefill_tokens();
  last_step_.graph = num_graph_steps_ != graph_steps_before;

  // ---- update ----
  for (const ScheduledSeq& p : order) {
    Sequence& s = seq(p.seq_id);
    s.num_computed += p.num_tokens;
    s.num_computed_max = std::max(s.num_computed_max, s.num_computed);
  }
  // On the GPU, when every logits row samples and nobody asked for the rows themselves, sampling runs there and
  // only the token ids come back; otherwise the rows come to the host (fp32) and are sampled there.
  std::vector<SampledToken> device_tokens;
  if (ctx_.device == Device::kCuda) {
    bool all_sample = !on_logits;
    bool want_logprobs = false;
    std::vector<ops::SamplingRow> rows;
    std::vector<ops::PenaltyToken> penalty_tokens;
    for (size_t r = 0; all_sample && r < row_owner.size(); ++r) {
      const Sequence& s = seq(row_owner[r].seq_id);
      all_sample = row_owner[r].samples && s.sampling.max_new_tokens > 0;
      ops::SamplingRow row = sampling_row(s.sampling, static_cast<uint64_t>(s.num_generated()));
      row.penalty_begin = static_cast<int32_t>(penalty_tokens.size());
      append_penalty_tokens(s.sampling, prompt_of(s), generated_of(s), penalty_tokens);
      row.penalty_end = static_cast<int32_t>(penalty_tokens.size());
      want_logprobs = want_logprobs || s.sampling.logprobs >= 0;
      rows.push_back(row);
    }
    if (all_sample && !rows.empty()) {
      device_tokens = sample_on_device(logits, rows, penalty_tokens, want_logprobs);
    } else {
      logits = device::to_host_f32(logits);
    }
  }
  const int64_t V = model_.config().vocab_size;
  for (size_t r = 0; r < row_owner.size(); ++r) {
    Sequence& s = seq(row_owner[r].seq_id);
    const bool on_host = device_tokens.empty();
    const std::span<const float> row(on_host ? logits.f32() + static_cast<int64_t>(r) * V : nullptr,
                                     on_host ? static_cast<size_t>(V) : 0);
    if (on_logits && row_owner[r].reported) on_logits(s.id, row);
    if (row_owner[r].scores >= 0) {
      const int32_t at = row_owner[r].scores;
      s.prompt_logprobs.push_back(prompt_logprob(row, s.tokens[static_cast<size_t>(at)], s.sampling.prompt_logprobs));
    }
    if (!row_owner[r].samples) continue;
    // The first sampling event of a sequence hands out its prompt logprobs (all chunks' rows are in by now).
    auto with_prompt_logprobs = [&s](TokenEvent ev) {
      if (s.sampling.prompt_logprobs >= 0 && s.num_generated() == 0) ev.prompt_logprobs = std::move(s.prompt_logprobs);
      return ev;
    };
    if (s.sampling.max_new_tokens == 0) {
      s.finish = FinishReason::kLength;
      events.push_back(with_prompt_logprobs({s.id, -1, s.finish}));
      continue;
    }
    const uint64_t step = static_cast<uint64_t>(s.num_generated());
    SampledToken t = on_host ? sample_token(row, s.sampling, step, prompt_of(s), generated_of(s))
                             : std::move(device_tokens[r]);
    if (t.nonfinite) {
      // NaN / Inf logits (broken weights or an overflow): sampling them gives plausible-looking garbage.
      s.finish = FinishReason::kError;
      s.error = fmt::format("non-finite logits at step {} of sequence {} (a NaN or an infinity among them)", step, s.id);
      TokenEvent ev{s.id, -1, s.finish};
      ev.error = s.error;
      events.push_back(with_prompt_logprobs(std::move(ev)));
      continue;
    }
    const int32_t tok = t.id;
    TokenEvent ev = with_prompt_logprobs({s.id, tok, FinishReason::kNone});
    s.tokens.push_back(tok);
    const bool eos = !s.sampling.ignore_eos && std::find(stop_ids_.begin(), stop_ids_.end(), tok) != stop_ids_.end();
    const auto& stop_tokens = s.sampling.stop_token_ids;
    if (eos || std::find(stop_tokens.begin(), stop_tokens.end(), tok) != stop_tokens.end()) {
      s.finish = FinishReason::kStop;
    } else if (s.num_generated() >= s.sampling.max_new_tokens ||
               static_cast<int32_t>(s.tokens.size()) >= cache_.sizes().max_model_len) {
      s.finish = FinishReason::kLength;
    }
    ev.finish = s.finish;
    if (s.sampling.logprobs >= 0) {
      ev.logprob = t.logprob;
      ev.top_logprobs = std::move(t.top_logprobs);
    }
    events.push_back(std::move(ev));
  }
  for (Sequence& s : scheduler_.collect_finished()) finished_.push_back(std::move(s));
  return events;
}

bool Engine::abort_request(int32_t seq_id) {
  std::optional<Sequence> s = scheduler_.abort(seq_id);
  if (!s) return false;
  finished_.push_back(std::move(*s));
  return true;
}

std::vector<Sequence> Engine::take_finished() {
  std::vector<Sequence> out;
  out.swap(finished_);
  return out;
}

std::string format_graph_capture(const Engine& engine) {
  const std::vector<int32_t> sizes = engine.graph_batch_sizes();
  if (sizes.empty()) return "";
  return fmt::format("CUDA graphs: {} decode batch sizes ({} to {}) captured in {:.2f} s, {}", sizes.size(),
                     sizes.front(), sizes.back(), engine.graph_capture_seconds(), gib(engine.graph_pool_bytes()));
}

std::vector<std::vector<int32_t>> generate_all(const Model& model, const ops::Context& ctx,
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
