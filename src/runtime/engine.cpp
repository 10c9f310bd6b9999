#include "runtime/engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <unordered_map>

#include <fmt/core.h>

#include "backends/cpu/cpu_ops.h"
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

// CUDA graphs at all. Not with tensor parallelism: its ranks run on their own threads and streams, and a graph of one
// stream would hold only rank 0's work (per-rank graphs are not built yet).
bool graphs_allowed(const EngineConfig& c, Device device, const Model& model) {
  return device == Device::kCuda && c.cuda_graphs && model.tensor_parallel_size() == 1;
}

// The graph buckets: vLLM's sizes up to the largest decode batch the scheduler can form, or with speculative
// decoding the speculative steps' buckets (runtime/cache_sizing.h).
std::vector<int32_t> graph_buckets(const EngineConfig& c, Device device, const Model& model) {
  if (!graphs_allowed(c, device, model)) return {};
  const int32_t most = std::min(c.scheduler.max_num_seqs, c.cache.max_seqs);
  if (!c.speculative.enabled()) return cuda_graph_batch_sizes(most);
  return speculative_graph_batch_sizes(most, c.speculative.num_speculative_tokens, c.cache.block_size);
}

// The caches as configured, plus a scratch slot and block for each pad row a bucket can carry, and with speculative
// decoding the draft head's KV and K + 1 spare Mamba slots per sequence.
CacheSizes engine_cache_sizes(const EngineConfig& c, Device device, const Model& model) {
  CacheSizes sizes = c.cache;
  sizes.tensor_parallel_size = model.local_tensor_parallel_size();
  sizes.log_state_ops = sizes.tensor_parallel_size != model.tensor_parallel_size();
  sizes.rank_devices = model.tensor_parallel_devices();
  sizes.num_pad = cuda_graph_pad_rows(graph_buckets(c, device, model));
  if (c.speculative.enabled()) {
    sizes.mtp = true;
    sizes.spare_slots = c.speculative.num_speculative_tokens + 1;
  }
  // Every prompt row's logits are asked for: nothing may be skipped.
  if (c.return_prompt_logits) sizes.prefix_caching = false;
  return sizes;
}

SchedulerConfig engine_scheduler_config(const EngineConfig& c) {
  SchedulerConfig s = c.scheduler;
  s.num_speculative_tokens = c.speculative.num_speculative_tokens;
  return s;
}
}  // namespace

Engine::Engine(const Model& model, const ops::Context& ctx, const EngineConfig& config)
    : model_(model),
      ctx_(ctx),
      config_(config),
      cache_(model.config(), engine_cache_sizes(config, ctx.device, model), ctx.device, model.activation_dtype()),
      scheduler_(engine_scheduler_config(config), cache_),
      stop_ids_(model.config().eos_token_ids) {
  if (ctx.device != model.device()) {
    runtime_error("Engine: the model was loaded for the {} but the context is the {}",
                  model.device() == Device::kCpu ? "CPU" : "GPU", ctx.device == Device::kCpu ? "CPU" : "GPU");
  }
  if (config_.speculative.enabled()) {
    if (model.mtp_blocks() == 0) {
      invalid_input(
          "--speculative-config: method \"mtp\" drafts with the checkpoint's multi-token-prediction head, "
          "and this model has none (num_nextn_predict_layers = 0 or no mtp.* tensors)");
    }
    spec_stats_.accepted_per_position.assign(static_cast<size_t>(config_.speculative.num_speculative_tokens), 0);
  }
  // Graph capture needs a stream of our own (the legacy default stream cannot be captured).
  if (ctx_.device == Device::kCuda && ctx_.stream == nullptr) {
    own_stream_ = device::Stream::create();
    ctx_.stream = own_stream_.get();
  }
  if (!graph_buckets(config_, ctx_.device, model_).empty()) {
    if (speculative()) {
      capture_spec_graphs();
    } else {
      capture_decode_graphs();
    }
  }
}

std::vector<int32_t> Engine::graph_batch_sizes() const {
  std::vector<int32_t> sizes;
  for (const auto& [b, g] : graphs_) sizes.push_back(b);
  for (const auto& [b, g] : spec_graphs_) sizes.push_back(b);
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
  const std::vector<int32_t> buckets = graph_buckets(config_, ctx_.device, model_);
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

// ---- captured speculative steps -------------------------------------------------------------------------------

StepBatch::DeviceMeta Engine::SpecGraph::verify_meta(int32_t K) const {
  const int64_t R = int64_t{n} * (K + 1);
  const int32_t* d = meta_device.i32();
  StepBatch::DeviceMeta m;
  m.token_ids = d;
  m.cu_seqlens = d += R;
  m.context_lens = d += n + 1;
  m.state_slots = d += n;
  m.spec.gather = d += n;
  m.spec.scatter = d += R;
  m.spec.src = d += R;
  m.spec.dst = d += R;
  m.spec.pos = d += R;
  m.spec.attn_cu_seqlens = d += R;
  m.spec.attn_context_lens = d += R + 1;
  m.block_tables = tables_device.rows(0, n);
  m.spec.attn_block_tables = tables_device.rows(n, n + R);
  return m;
}

void Engine::stage_spec(SpecGraph& g, const StepBatch& b) const {
  const int32_t K = config_.speculative.num_speculative_tokens, w = K + 1, n = g.n, B = b.num_seqs();
  CHIMERA_CHECK(B <= n && n - B <= cache_.sizes().num_pad,
                "a verify step of {} sequences on the graph of {} ({} pad slots)", B, n, cache_.sizes().num_pad);
  const int64_t max_blocks = cache_.blocks_per_seq();
  // The batch padded to n sequences: pad sequence j is K + 1 rows of token 0 on no context, every row stepping its
  // own scratch slot in place (source and destination alike) and writing its scratch block only (2K <= block_size).
  StepBatch pb;
  pb.token_ids = b.token_ids;
  pb.cu_seqlens = b.cu_seqlens;
  pb.context_lens = b.context_lens;
  pb.state_slots = b.state_slots;
  pb.spec_slots = b.spec_slots;
  for (int32_t j = 0; j < n - B; ++j) {
    pb.token_ids.insert(pb.token_ids.end(), static_cast<size_t>(w), 0);
    pb.cu_seqlens.push_back(pb.cu_seqlens.back() + w);
    pb.context_lens.push_back(0);
    pb.state_slots.push_back(cache_.pad_slot(j));
    pb.spec_slots.insert(pb.spec_slots.end(), static_cast<size_t>(w), cache_.pad_slot(j));
  }
  pb.num_prefill_seqs = pb.num_spec_seqs = n;
  const SpecPlan plan = spec_plan(pb);
  const AttentionRows rows = attention_rows(pb);
  int32_t* m = g.meta_host.i32();
  const auto put = [&m](const std::vector<int32_t>& v) { m = std::copy(v.begin(), v.end(), m); };
  put(pb.token_ids);
  put(pb.cu_seqlens);
  put(pb.context_lens);
  put(pb.state_slots);
  for (const std::vector<int32_t>* v : {&plan.gather, &plan.scatter, &plan.src, &plan.dst, &plan.pos}) put(*v);
  put(rows.cu_seqlens);
  put(rows.context_lens);
  for (int32_t i = 0; i <= n; ++i) *m++ = i;  // the draft steps: one row a sequence
  CHIMERA_CHECK(m == g.meta_host.i32() + g.meta_host.numel(), "speculative graph staging: {} of {} entries written",
                m - g.meta_host.i32(), g.meta_host.numel());
  int32_t* tables = g.tables_host.i32();
  std::copy(b.block_tables.i32(), b.block_tables.i32() + b.block_tables.numel(), tables);
  std::fill(tables + int64_t{B} * max_blocks, tables + g.tables_host.numel(), 0);
  for (int32_t j = 0; j < n - B; ++j) tables[int64_t{B + j} * max_blocks] = cache_.pad_block(j);
  for (size_t r = 0; r < rows.table_rows.size(); ++r) {
    const int32_t* row = tables + int64_t{rows.table_rows[r]} * max_blocks;
    std::copy(row, row + max_blocks, tables + (int64_t{n} + static_cast<int64_t>(r)) * max_blocks);
  }
  device::copy_async(g.meta_device, g.meta_host, ctx_.stream);
  device::copy_async(g.tables_device, g.tables_host, ctx_.stream);
}

void Engine::spec_graph_body(const SpecGraph& g, const StepBatch& vb) {
  const int32_t K = config_.speculative.num_speculative_tokens, n = g.n;
  const int64_t R = int64_t{n} * (K + 1);
  const StepBatch::DeviceMeta& vm = *vb.device_meta;
  // The sampler's greedy rows need no parameters, so these launches upload nothing (ops::sample_tokens).
  const std::vector<ops::SamplingRow> greedy(static_cast<size_t>(R));
  const auto argmax = [&](const Tensor& ids, const Tensor& nonfinite, const Tensor& logits) {
    Tensor f32 = logits;
    if (logits.dtype() != DType::kF32) {
      f32 = device::empty(Device::kCuda, DType::kF32, logits.shape());
      ops::convert(ctx_, f32, logits);
    }
    ops::SamplingOutputs out;
    out.ids = ids;
    out.nonfinite = nonfinite;
    ops::sample_tokens(ctx_, out, f32, std::span(greedy).first(static_cast<size_t>(logits.dim(0))), {});
  };
  const Tensor& o = g.out_device;
  const Tensor targets = o.rows(0, R), nonfinite = o.rows(R, 2 * R), accepted = o.rows(2 * R, 2 * R + n);
  const int64_t drafts0 = 2 * R + n, head0 = drafts0 + int64_t{K} * n, context0 = head0 + n;
  const Tensor head_rows = o.rows(head0, context0);
  const Tensor draft_context = K > 1 ? o.rows(context0, context0 + int64_t{K - 1} * n).reshape({K - 1, n}) : Tensor();
  const auto drafts = [&](int32_t d) { return o.rows(drafts0 + int64_t{d} * n, drafts0 + int64_t{d + 1} * n); };

  // The verify forward and its greedy targets, then which drafts they accept.
  Tensor hidden;
  argmax(targets, nonfinite, model_.forward_device(ctx_, vb, cache_.state(), hidden));
  const int64_t context_at = R + n + 1;  // the meta layout's context_lens
  ops::accept_drafts_greedy(ctx_, accepted, head_rows, draft_context, g.meta_device.rows(0, R), targets,
                            g.meta_device.rows(context_at, context_at + n));

  // The head's step over the verify rows: row j carries the token after it, which is target j wherever it matters
  // (the accepted drafts equal their targets; rows past the correction are rewritten before they are read), and
  // its logits are each sequence's head_rows row.
  StepBatch hb = vb;
  hb.logit_rows.clear();
  for (int32_t i = 0; i < n; ++i) hb.logit_rows.push_back(i * (K + 1));  // the host values are not read
  StepBatch::DeviceMeta hm = vm;
  hm.token_ids = targets.i32();
  hm.logit_rows = head_rows.i32();
  hb.device_meta = &hm;
  Tensor mtp_hidden;
  const Tensor none;
  argmax(drafts(0), none,
         model_.mtp_forward_device(ctx_, hb, hidden, cache_.state(), 0, K > 1 ? &mtp_hidden : nullptr));

  // Draft d + 1 of each sequence: one row on the previous draft at context + accepted + d (draft_context row d - 1),
  // the head applied to its own output there.
  StepBatch db;
  db.token_ids.assign(static_cast<size_t>(n), 0);
  db.cu_seqlens.clear();
  for (int32_t i = 0; i <= n; ++i) db.cu_seqlens.push_back(i);
  db.context_lens.assign(static_cast<size_t>(n), 0);
  db.state_slots = std::vector<int32_t>(vb.state_slots.begin(), vb.state_slots.begin() + n);
  db.block_tables = vb.block_tables;
  for (int32_t i = 0; i < n; ++i) db.logit_rows.push_back(i);
  const int32_t* draft_cu = vm.spec.attn_context_lens + R;  // the meta layout's last part
  for (int32_t d = 1; d < K; ++d) {
    StepBatch::DeviceMeta dm;
    dm.token_ids = drafts(d - 1).i32();
    dm.cu_seqlens = draft_cu;
    dm.context_lens = draft_context.i32() + int64_t{d - 1} * n;
    dm.state_slots = vm.state_slots;
    dm.block_tables = vm.block_tables;
    db.device_meta = &dm;
    Tensor h = mtp_hidden;
    if (d == 1) {  // the rows the first drafts came from
      h = device::empty(Device::kCuda, mtp_hidden.dtype(), {n, mtp_hidden.dim(1)});
      ops::embedding(ctx_, h, mtp_hidden, ops::Indices(hb.logit_rows, head_rows.i32()));
    }
    Tensor out_hidden;
    const Tensor logits = model_.mtp_forward_device(ctx_, db, h, cache_.state(), d % model_.mtp_blocks(),
                                                    d + 1 < K ? &out_hidden : nullptr);
    argmax(drafts(d), none, logits);
    mtp_hidden = out_hidden;
  }
  device::copy_async(g.out_host, o.rows(0, g.out_host.numel()), ctx_.stream);
}

void Engine::capture_spec_graphs() {
  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<int32_t> buckets = graph_buckets(config_, ctx_.device, model_);
  const int32_t K = config_.speculative.num_speculative_tokens, w = K + 1;
  const int32_t max_blocks = cache_.blocks_per_seq();
  const int32_t total_blocks = cache_.sizes().num_blocks + cache_.sizes().num_pad;
  graph_pool_.emplace();
  for (auto it = buckets.rbegin(); it != buckets.rend(); ++it) {
    const int32_t n = *it;
    const int64_t R = int64_t{n} * w;
    // The warm-up and capture batch: n verify sequences of token 0 on no context, sequence i stepping slot i in place
    // and writing block i (as the decode graphs' capture: no sequence holds them yet).
    StepBatch b;
    b.token_ids.assign(static_cast<size_t>(R), 0);
    b.block_tables = Tensor::zeros(DType::kI32, {n, max_blocks});
    for (int32_t i = 0; i < n; ++i) {
      b.cu_seqlens.push_back((i + 1) * w);
      b.context_lens.push_back(0);
      b.state_slots.push_back(i);
      b.spec_slots.insert(b.spec_slots.end(), static_cast<size_t>(w), i);
      b.block_tables.i32()[int64_t{i} * max_blocks] = i % total_blocks;
    }
    for (int64_t r = 0; r < R; ++r) b.logit_rows.push_back(static_cast<int32_t>(r));
    b.num_prefill_seqs = b.num_spec_seqs = n;
    SpecGraph g;
    g.n = n;
    const int64_t meta = 8 * R + 4 * int64_t{n} + 3;
    g.meta_host = device::empty_pinned(DType::kI32, {meta});
    g.meta_device = device::empty(Device::kCuda, DType::kI32, {meta});
    g.tables_host = device::empty_pinned(DType::kI32, {n + R, max_blocks});
    g.tables_device = device::empty(Device::kCuda, DType::kI32, {n + R, max_blocks});
    const int64_t out = 2 * R + int64_t{n} * (K + 1);
    g.out_device = device::empty(Device::kCuda, DType::kI32, {out + int64_t{n} * K});
    g.out_host = device::empty_pinned(DType::kI32, {out});
    stage_spec(g, b);
    const StepBatch::DeviceMeta dm = g.verify_meta(K);
    b.device_meta = &dm;
    spec_graph_body(g, b);  // the warm-up: every per-shape cache filled outside the capture
    {
      const device::ScopedAllocPool scope(*graph_pool_);
      g.graph = device::Graph::capture(ctx_.stream, [&] { spec_graph_body(g, b); });
    }
    spec_graphs_.emplace(n, std::move(g));
  }
  device::synchronize(Device::kCuda);
  graph_capture_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

bool Engine::spec_graph_fits(const StepBatch& b, const std::vector<Sequence*>& seqs) const {
  const int32_t S = b.num_seqs();
  if (spec_graphs_.empty() || on_logits || S == 0 || S > spec_graphs_.rbegin()->first) return false;
  if (b.num_spec_seqs != S || b.num_prefill_seqs != S || !b.mamba_checkpoints.empty()) return false;
  const int32_t K = config_.speculative.num_speculative_tokens;
  for (int32_t i = 0; i < S; ++i) {
    const Sequence& s = *seqs[static_cast<size_t>(i)];
    if (b.cu_seqlens[i + 1] - b.cu_seqlens[i] != K + 1) return false;  // the token budget cut its drafts
    if (!s.sampling.greedy() || s.sampling.has_penalties() || s.sampling.logprobs >= 0) return false;
    // The last draft step writes the head's KV at context + 2K - 1 at most.
    if (static_cast<int64_t>(s.blocks.size()) * cache_.sizes().block_size < int64_t{b.context_lens[i]} + 2 * K) {
      return false;
    }
  }
  return true;
}

Engine::SpecStepOut Engine::replay_spec(const StepBatch& b) {
  const int32_t B = b.num_seqs(), K = config_.speculative.num_speculative_tokens;
  SpecGraph& g = spec_graphs_.lower_bound(B)->second;
  stage_spec(g, b);
  g.graph.launch(ctx_.stream);
  device::synchronize_stream(ctx_.stream);
  ++num_graph_steps_;
  const int64_t R = int64_t{g.n} * (K + 1), Rb = int64_t{B} * (K + 1);
  const int32_t* out = g.out_host.i32();
  SpecStepOut r;
  r.targets.assign(out, out + Rb);
  r.nonfinite.assign(out + R, out + R + Rb);
  r.accepted.assign(out + 2 * R, out + 2 * R + B);
  for (int32_t d = 0; d < K; ++d) {
    const int32_t* row = out + 2 * R + g.n + int64_t{d} * g.n;
    r.drafts.insert(r.drafts.end(), row, row + B);
  }
  return r;
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
  // Sequences admitted on a cached prefix start from its Mamba checkpoint (ordered before the step's ops).
  for (const SlotCopy& c : plan.restores) cache_.copy_mamba_state(c.dst, c.src, ctx_.stream);

  // ---- build the step batch ----
  // Sequences with several new tokens, or none in context, run the multi-token kernels (varlen conv, chunked
  // scan, attention over context + new rows) and come first, prompt chunks before verify steps (a decode token with
  // drafts: its Mamba layers step token by token, StepBatch::num_spec_seqs); sequences with one new token after a
  // context run the single-token kernels (conv update, selective state update, decode attention).
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
  // A verify step: a decode (one pending token past the prompt) scheduled with some of its drafts.
  auto verifies = [&](const ScheduledSeq& p) {
    const Sequence& s = seq(p.seq_id);
    return p.num_tokens > 1 && s.num_computed > 0 && !s.in_prefill() && s.num_pending() == 1;
  };
  StepBatch b;
  std::vector<ScheduledSeq> order;
  for (const ScheduledSeq& p : plan.seqs) {
    if ((p.num_tokens > 1 || seq(p.seq_id).num_computed == 0) && !verifies(p)) order.push_back(p);
  }
  for (const ScheduledSeq& p : plan.seqs) {
    if (verifies(p)) order.push_back(p);
  }
  b.num_prefill_seqs = static_cast<int32_t>(order.size());
  for (const ScheduledSeq& p : plan.seqs) {
    if (p.num_tokens == 1 && seq(p.seq_id).num_computed > 0) order.push_back(p);
  }
  const int32_t max_blocks = cache_.blocks_per_seq();
  b.block_tables = Tensor::zeros(DType::kI32, {static_cast<int64_t>(order.size()), max_blocks});
  // For each logits row: its sequence, whether this step samples from it, whether on_logits sees it, the prompt
  // position whose token it scores for the sequence's prompt_logprobs (-1: none), and in a verify step its row
  // (0: after the last token, i: after draft i - 1; -1: not a verify row).
  struct RowOwner {
    int32_t seq_id;
    bool samples;
    bool reported;
    int32_t scores = -1;
    int32_t verify_row = -1;
  };
  std::vector<RowOwner> row_owner;
  for (size_t i = 0; i < order.size(); ++i) {
    Sequence& s = seq(order[i].seq_id);
    const int32_t n = order[i].num_tokens;
    const int32_t start = b.num_tokens();
    const bool verify = verifies(order[i]);
    if (verify) {
      // The last token, then the first n - 1 drafts (all of them unless the token budget cut the step short).
      s.drafts.resize(static_cast<size_t>(n - 1));
      if (!s.draft_probs.empty()) s.draft_probs.resize(static_cast<size_t>(n - 1));
      b.token_ids.push_back(s.tokens[static_cast<size_t>(s.num_computed)]);
      b.token_ids.insert(b.token_ids.end(), s.drafts.begin(), s.drafts.end());
      b.spec_slots.insert(b.spec_slots.end(), s.spare_slots.begin(), s.spare_slots.begin() + n);
      ++b.num_spec_seqs;
    } else {
      b.token_ids.insert(b.token_ids.end(), s.tokens.begin() + s.num_computed, s.tokens.begin() + s.num_computed + n);
    }
    b.cu_seqlens.push_back(b.num_tokens());
    b.context_lens.push_back(s.num_computed);
    b.state_slots.push_back(s.slot);
    std::copy(s.blocks.begin(), s.blocks.end(), b.block_tables.i32() + static_cast<int64_t>(i) * max_blocks);
    if (verify) {
      for (int32_t r = 0; r < n; ++r) {
        b.logit_rows.push_back(start + r);
        row_owner.push_back({s.id, true, true, -1, r});
      }
      continue;
    }
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

  // Prefix caching's checkpoints inside the chunks, by batch index (StepBatch::mamba_checkpoints).
  if (!plan.checkpoints.empty()) {
    std::unordered_map<int32_t, int32_t> index;
    for (size_t i = 0; i < order.size(); ++i) index.emplace(order[i].seq_id, static_cast<int32_t>(i));
    for (const SchedulerOutput::Checkpoint& c : plan.checkpoints) {
      b.mamba_checkpoints.push_back({index.at(c.seq_id), c.rows, c.slot});
    }
    std::sort(b.mamba_checkpoints.begin(), b.mamba_checkpoints.end(),
              [](const auto& x, const auto& y) { return x.seq != y.seq ? x.seq < y.seq : x.rows < y.rows; });
  }

  // ---- execute ----
  const int64_t graph_steps_before = num_graph_steps_;
  const auto t_execute = std::chrono::steady_clock::now();
  std::vector<Sequence*> seqs;  // the batch's sequences, in batch order
  for (const ScheduledSeq& p : order) seqs.push_back(&seq(p.seq_id));
  // A speculative step of verify sequences alone may replay a captured one, which also drafts (spec_out).
  const bool spec_graph = speculative() && spec_graph_fits(b, seqs);
  SpecStepOut spec_out;
  Tensor hidden;  // speculative decoding: the backbone's output of every row, the draft head's input
  Tensor logits;
  if (spec_graph) {
    spec_out = replay_spec(b);
  } else {
    logits = speculative() ? model_.forward_device(ctx_, b, cache_.state(), hidden) : execute(b);
  }
  last_step_.prefill_tokens = b.num_chunk_tokens();
  last_step_.decode_tokens = b.num_tokens() - b.num_chunk_tokens();  // verify rows included
  last_step_.graph = num_graph_steps_ != graph_steps_before;

  // ---- update ----
  for (const ScheduledSeq& p : order) {
    Sequence& s = seq(p.seq_id);
    s.num_computed += p.num_tokens;  // a verify step's sequence steps back to its accepted prefix below
    s.num_computed_max = std::max(s.num_computed_max, s.num_computed);
  }
  // The history a row's penalties see: the generated tokens, and in a verify step the drafts before the row (only
  // the penalties read it, so without them nothing is copied).
  std::vector<int32_t> history;
  auto history_of = [&](const Sequence& s, int32_t verify_row) -> std::span<const int32_t> {
    if (verify_row <= 0 || !s.sampling.has_penalties()) return generated_of(s);
    history.assign(s.tokens.begin() + s.prompt_len, s.tokens.end());
    history.insert(history.end(), s.drafts.begin(), s.drafts.begin() + verify_row);
    return history;
  };
  // On the GPU, when every logits row samples and nobody asked for the rows themselves, sampling runs there and
  // only the token ids come back; otherwise the rows come to the host (fp32) and are sampled there. Verify rows of a
  // sampling (temperature > 0) request need the rows: rejection sampling compares distributions.
  std::vector<SampledToken> device_tokens;
  if (spec_graph) {  // every row is a verify row, in order
    for (size_t r = 0; r < spec_out.targets.size(); ++r) {
      SampledToken t;
      t.id = spec_out.targets[r];
      t.nonfinite = spec_out.nonfinite[r] != 0;
      device_tokens.push_back(std::move(t));
    }
  } else if (ctx_.device == Device::kCuda) {
    bool all_sample = !on_logits;
    bool want_logprobs = false;
    std::vector<ops::SamplingRow> rows;
    std::vector<ops::PenaltyToken> penalty_tokens;
    for (size_t r = 0; all_sample && r < row_owner.size(); ++r) {
      const Sequence& s = seq(row_owner[r].seq_id);
      const int32_t vr = row_owner[r].verify_row;
      all_sample = row_owner[r].samples && s.sampling.max_new_tokens > 0 && (vr < 0 || s.sampling.greedy());
      ops::SamplingRow row = sampling_row(s.sampling, static_cast<uint64_t>(s.num_generated() + std::max(vr, 0)));
      row.penalty_begin = static_cast<int32_t>(penalty_tokens.size());
      append_penalty_tokens(s.sampling, prompt_of(s), history_of(s, vr), penalty_tokens);
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
  const bool on_host = device_tokens.empty();
  auto host_row = [&](size_t r) {
    return std::span<const float>(on_host ? logits.f32() + static_cast<int64_t>(r) * V : nullptr,
                                  on_host ? static_cast<size_t>(V) : 0);
  };
  std::map<int32_t, std::vector<size_t>> verify_rows;  // sequence -> its verify rows, in order
  for (size_t r = 0; r < row_owner.size(); ++r) {
    Sequence& s = seq(row_owner[r].seq_id);
    if (row_owner[r].verify_row >= 0) {
      verify_rows[s.id].push_back(r);
      continue;
    }
    const std::span<const float> row = host_row(r);
    if (on_logits && row_owner[r].reported) on_logits(s.id, row);
    if (row_owner[r].scores >= 0) {
      const int32_t at = row_owner[r].scores;
      s.prompt_logprobs.push_back(prompt_logprob(row, s.tokens[static_cast<size_t>(at)], s.sampling.prompt_logprobs));
    }
    if (!row_owner[r].samples) continue;
    // The first sampling event of a sequence hands out its prompt logprobs (all chunks' rows are in by now).
    const bool first_event = s.num_generated() == 0;
    auto with_prompt_logprobs = [&s, first_event](TokenEvent ev) {
      if (s.sampling.prompt_logprobs >= 0 && first_event) ev.prompt_logprobs = std::move(s.prompt_logprobs);
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
      fail_nonfinite(s, step, events, with_prompt_logprobs);
      continue;
    }
    events.push_back(with_prompt_logprobs(append_token(s, t)));
  }

  // ---- speculative decoding: accept each verify step's longest valid prefix, then draft for the next step ----
  for (auto& [id, rows] : verify_rows) {
    Sequence& s = seq(id);
    const int32_t n = static_cast<int32_t>(rows.size());
    const int32_t context = s.num_computed - n;  // before this step
    const uint64_t g = static_cast<uint64_t>(s.num_generated());
    // The tokens the step emits: accepted drafts, then the correction (or the bonus token after all of them).
    std::vector<int32_t> emitted;
    bool nonfinite = false;
    if (s.sampling.greedy()) {
      std::vector<int32_t> targets;
      for (int32_t j = 0; j < n; ++j) {
        const size_t r = rows[static_cast<size_t>(j)];
        const SampledToken t = on_host ? sample_token(host_row(r), s.sampling, g + static_cast<uint64_t>(j),
                                                      prompt_of(s), history_of(s, j))
                                       : device_tokens[r];
        targets.push_back(t.id);
        nonfinite = nonfinite || t.nonfinite;
      }
      emitted = accept_greedy(s.drafts, targets);
      if (spec_graph) {  // the graph drafted on from its own acceptance, which must be this one
        // Every row of a captured step is a verify row, K + 1 a sequence in batch order.
        const size_t i = rows.front() / static_cast<size_t>(config_.speculative.num_speculative_tokens + 1);
        CHIMERA_CHECK(static_cast<int32_t>(emitted.size()) - 1 == spec_out.accepted[i],
                      "sequence {}: the captured step accepted {} drafts, the host {}", s.id, spec_out.accepted[i],
                      emitted.size() - 1);
      }
    } else {
      for (int32_t j = 0; j < n; ++j) {
        const std::span<const float> row = host_row(rows[static_cast<size_t>(j)]);
        nonfinite = nonfinite || !std::all_of(row.begin(), row.end(), [](float v) { return std::isfinite(v); });
        const uint64_t step = g + static_cast<uint64_t>(j);
        if (j == n - 1) {  // every draft accepted: the bonus token, sampled as without speculation
          emitted.push_back(sample_token(row, s.sampling, step, prompt_of(s), history_of(s, j)).id);
          break;
        }
        std::vector<ops::PenaltyToken> pen;
        append_penalty_tokens(s.sampling, prompt_of(s), history_of(s, j), pen);
        const std::vector<float> p = cpu::sampling_probs(row, sampling_row(s.sampling, step), pen);
        const RejectionResult res =
            rejection_step(p, s.draft_probs[static_cast<size_t>(j)], s.drafts[static_cast<size_t>(j)],
                           spec_uniform(s.sampling.seed, SpecStream::kAccept, step),
                           spec_uniform(s.sampling.seed, SpecStream::kResample, step));
        emitted.push_back(res.token);
        if (!res.accepted) break;
      }
    }
    const int32_t accepted = static_cast<int32_t>(emitted.size()) - 1;
    spec_stats_.num_drafts += 1;
    spec_stats_.num_draft_tokens += n - 1;
    spec_stats_.num_accepted_tokens += accepted;
    for (int32_t j = 0; j < accepted; ++j) ++spec_stats_.accepted_per_position[static_cast<size_t>(j)];
    // The state after the last accepted row becomes the sequence's; the KV past it is overwritten by later steps.
    s.num_computed = context + accepted + 1;
    std::swap(s.slot, s.spare_slots[static_cast<size_t>(accepted)]);
    s.drafts.clear();
    s.draft_probs.clear();
    if (nonfinite) {
      fail_nonfinite(s, g, events, [](TokenEvent ev) { return ev; });
      continue;
    }
    for (size_t j = 0; j < emitted.size() && !s.finished(); ++j) {
      const size_t r = rows[j];
      if (on_logits) on_logits(s.id, host_row(r));
      SampledToken t;
      t.id = emitted[j];
      if (s.sampling.logprobs >= 0) {
        if (on_host) {
          PromptLogprob lp = prompt_logprob(host_row(r), t.id, s.sampling.logprobs);
          t.logprob = lp.logprob;
          t.top_logprobs = std::move(lp.top);
        } else {  // greedy on the device: the emitted token is the row's sampled one
          t.logprob = device_tokens[r].logprob;
          t.top_logprobs = device_tokens[r].top_logprobs;
        }
      }
      events.push_back(append_token(s, t));
    }
    s.num_computed = std::min(s.num_computed, static_cast<int32_t>(s.tokens.size()));
  }
  if (spec_graph) {
    // The drafts came with the step. A replay cannot be split in time: it all counts as the verify.
    last_step_.verify_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_execute).count();
    const size_t n = seqs.size();
    for (size_t i = 0; i < n; ++i) {
      Sequence& s = *seqs[i];
      const int32_t len = static_cast<int32_t>(s.tokens.size());
      if (s.finished() || s.num_computed != len - 1) continue;
      const int32_t depth = draft_depth(s);
      for (int32_t d = 0; d < depth; ++d) s.drafts.push_back(spec_out.drafts[static_cast<size_t>(d) * n + i]);
    }
  } else if (speculative()) {
    const auto t_draft = std::chrono::steady_clock::now();
    last_step_.verify_seconds = std::chrono::duration<double>(t_draft - t_execute).count();
    propose_drafts(b, seqs, hidden);
    last_step_.draft_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_draft).count();
  }
  // Prefix caching: publish the blocks the step completed and save the Mamba checkpoints it reached, before a
  // finished sequence's slot is handed on.
  for (const ScheduledSeq& p : order) {
    if (const std::optional<SlotCopy> c = scheduler_.commit(seq(p.seq_id))) {
      cache_.copy_mamba_state(c->dst, c->src, ctx_.stream);
    }
  }
  for (Sequence& s : scheduler_.collect_finished()) finished_.push_back(std::move(s));
  return events;
}

void Engine::fail_nonfinite(Sequence& s, uint64_t step, std::vector<TokenEvent>& events,
                            const std::function<TokenEvent(TokenEvent)>& decorate) {
  // NaN / Inf logits (broken weights or an overflow): sampling them gives plausible-looking garbage.
  s.finish = FinishReason::kError;
  s.error = fmt::format("non-finite logits at step {} of sequence {} (a NaN or an infinity among them)", step, s.id);
  TokenEvent ev{s.id, -1, s.finish};
  ev.error = s.error;
  events.push_back(decorate(std::move(ev)));
}

TokenEvent Engine::append_token(Sequence& s, SampledToken& t) {
  const int32_t tok = t.id;
  TokenEvent ev{s.id, tok, FinishReason::kNone};
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
  return ev;
}

void Engine::propose_drafts(const StepBatch& b, const std::vector<Sequence*>& seqs, const Tensor& hidden) {
  const int32_t K = config_.speculative.num_speculative_tokens;
  // The draft head's step over the backbone step's rows: row r (position t) carries the token at t + 1 where it is
  // known (a prompt token, an accepted draft, the token just sampled), else 0 (rejected rows: the head's KV there is
  // rewritten before anything reads it). Every row runs, so the head's KV cache follows the backbone's; the logits
  // are those of each drafting sequence's last computed row, which predict the token after the one just sampled.
  StepBatch m = b;  // its verify sequences' rows stay single-token rows to the head's attention, as to the backbone's
  m.logit_rows.clear();
  m.device_meta = nullptr;
  struct Drafting {
    Sequence* s;
    int32_t depth;  // drafts it wants this step (>= 1)
  };
  std::vector<Drafting> drafting;
  for (size_t i = 0; i < seqs.size(); ++i) {
    Sequence& s = *seqs[i];
    const int32_t begin = b.cu_seqlens[i], n = b.cu_seqlens[i + 1] - begin, context = b.context_lens[i];
    for (int32_t r = 0; r < n; ++r) {
      const size_t next = static_cast<size_t>(context + r + 1);
      m.token_ids[static_cast<size_t>(begin + r)] = next < s.tokens.size() ? s.tokens[next] : 0;
    }
    const int32_t len = static_cast<int32_t>(s.tokens.size());
    if (s.finished() || s.in_prefill() || s.num_computed != len - 1) continue;
    const int32_t depth = draft_depth(s);
    if (depth <= 0) continue;
    m.logit_rows.push_back(begin + (s.num_computed - 1 - context));
    drafting.push_back({&s, depth});
  }
  const bool any = !drafting.empty();
  if (!any) m.logit_rows.push_back(0);  // the head still runs for its cache; the row is dropped
  const int blocks = model_.mtp_blocks();
  Tensor mtp_hidden;
  Tensor logits = model_.mtp_forward_device(ctx_, m, hidden, cache_.state(), 0, any && K > 1 ? &mtp_hidden : nullptr);
  if (!any) return;
  // Row d of `logits` is drafting[d]'s; hidden_row[d] its row of mtp_hidden (the head's output there).
  std::vector<int32_t> hidden_row(m.logit_rows.begin(), m.logit_rows.end());
  for (int32_t depth = 1;; ++depth) {
    std::vector<Sequence*> live;
    for (const Drafting& d : drafting) live.push_back(d.s);
    draw_drafts(logits, live);
    if (depth == K) break;
    // The next depth: one token per sequence that wants more (its last draft), at the position after the previous
    // depth's, the block applied again (or the next block of a head with several) on its own previous output.
    std::vector<Drafting> next;
    std::vector<int32_t> next_hidden_row;
    for (size_t d = 0; d < drafting.size(); ++d) {
      if (drafting[d].depth <= depth) continue;
      next.push_back(drafting[d]);
      next_hidden_row.push_back(hidden_row[d]);
    }
    if (next.empty()) break;
    StepBatch db;
    const int32_t max_blocks = cache_.blocks_per_seq();
    db.block_tables = Tensor::zeros(DType::kI32, {static_cast<int64_t>(next.size()), max_blocks});
    for (size_t i = 0; i < next.size(); ++i) {
      const Sequence& s = *next[i].s;
      db.token_ids.push_back(s.drafts.back());
      db.cu_seqlens.push_back(static_cast<int32_t>(i + 1));
      db.context_lens.push_back(s.num_computed + depth - 1);
      db.state_slots.push_back(s.slot);
      std::copy(s.blocks.begin(), s.blocks.end(), db.block_tables.i32() + static_cast<int64_t>(i) * max_blocks);
      db.logit_rows.push_back(static_cast<int32_t>(i));
    }
    const Tensor h =
        device::empty(ctx_.device, mtp_hidden.dtype(), {static_cast<int64_t>(next.size()), mtp_hidden.dim(1)});
    ops::embedding(ctx_, h, mtp_hidden, next_hidden_row);
    Tensor out_hidden;
    logits =
        model_.mtp_forward_device(ctx_, db, h, cache_.state(), depth % blocks, depth + 1 < K ? &out_hidden : nullptr);
    mtp_hidden = out_hidden;
    drafting = std::move(next);
    hidden_row.resize(drafting.size());
    for (size_t d = 0; d < drafting.size(); ++d) hidden_row[d] = static_cast<int32_t>(d);
  }
}

int32_t Engine::draft_depth(const Sequence& s) const {
  const int32_t len = static_cast<int32_t>(s.tokens.size());
  return std::min({config_.speculative.num_speculative_tokens, cache_.sizes().max_model_len - len,
                   s.sampling.max_new_tokens - s.num_generated() - 1});
}

void Engine::draw_drafts(const Tensor& logits, const std::vector<Sequence*>& seqs) {
  const int64_t R = static_cast<int64_t>(seqs.size());
  bool all_greedy = true;
  for (const Sequence* s : seqs) all_greedy = all_greedy && s->sampling.greedy();
  if (ctx_.device == Device::kCuda && all_greedy) {  // argmax on the device: only the ids come back
    const std::vector<ops::SamplingRow> rows(static_cast<size_t>(R));
    const std::vector<SampledToken> ids = sample_on_device(logits, rows, {}, false);
    for (int64_t i = 0; i < R; ++i) seqs[static_cast<size_t>(i)]->drafts.push_back(ids[static_cast<size_t>(i)].id);
    return;
  }
  const Tensor host = ctx_.device == Device::kCpu ? logits : device::to_host_f32(logits);
  const int64_t V = host.dim(1);
  for (int64_t i = 0; i < R; ++i) {
    Sequence& s = *seqs[static_cast<size_t>(i)];
    const std::span<const float> row(host.f32() + i * V, static_cast<size_t>(V));
    if (s.sampling.greedy()) {
      s.drafts.push_back(static_cast<int32_t>(std::max_element(row.begin(), row.end()) - row.begin()));
      continue;
    }
    // Drawn from the draft distribution q: the request's temperature, top-k, top-p and min-p, no penalties (any q
    // keeps the output exact; this one is close to the target's). q is kept for the verify's rejection test.
    const uint64_t step = static_cast<uint64_t>(s.num_generated()) + s.drafts.size();
    std::vector<float> q = cpu::sampling_probs(row, sampling_row(s.sampling, step), {});
    s.drafts.push_back(sample_from_probs(q, spec_uniform(s.sampling.seed, SpecStream::kDraft, step)));
    s.draft_probs.push_back(std::move(q));
  }
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
  return fmt::format("CUDA graphs: {} {} batch sizes ({} to {}) captured in {:.2f} s, {}", sizes.size(),
                     engine.speculative_graphs() ? "speculative step" : "decode", sizes.front(), sizes.back(),
                     engine.graph_capture_seconds(), gib(engine.graph_pool_bytes()));
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
