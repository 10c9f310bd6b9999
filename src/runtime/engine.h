// The engine loop: schedule -> execute -> update (docs/architecture.md "The engine loop"). One Engine runs one
// model on one backend.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "backends/device_api.h"
#include "runtime/model.h"
#include "runtime/scheduler.h"
#include "runtime/speculative.h"
#include "runtime/state_cache.h"

namespace chimera {

struct EngineConfig {
  CacheSizes cache;
  SchedulerConfig scheduler;
  // Return logits for every prompt position (scoring, --logits-out), not just the last one.
  bool return_prompt_logits = false;
  // CUDA: decode-only steps replay CUDA graphs captured when the engine is built, one per padded batch-size
  // bucket: cuda_graph_batch_sizes (runtime/cache_sizing.h) of the largest decode batch, min(scheduler.max_num_seqs,
  // cache.max_seqs). Each bucket, largest first, runs one eager step (warming the kernels' per-shape caches:
  // cuBLASLt plans, MoE pointer tables) and is then captured into one shared graph pool. A step of B sequences
  // replays the smallest bucket >= B after one copy of its metadata, the bucket - B rows past the real ones being
  // pad rows (token 0, no context, each its own scratch Mamba slot and KV block: the engine sets cache.num_pad
  // to cuda_graph_pad_rows of the buckets); only the B real rows' logits are returned and sampled. Prefill and
  // mixed steps stay eager.
  bool cuda_graphs = true;
  // Speculative decoding with the model's MTP head (--speculative-config; needs a head: kInvalidInput otherwise).
  // After each step the head drafts up to K tokens per decoding sequence: one head step over the step's rows (which
  // also fills the head's KV cache, prompt chunks included), then K - 1 single-token steps, the block applied to its
  // own output. The next step verifies the drafts: the sequence's last token and its drafts as K + 1 rows, attention
  // over context + rows, the Mamba layers stepping token by token into the sequence's spare slots
  // (StepBatch::num_spec_seqs). Greedy requests accept the longest prefix equal to the target's argmax, then its
  // token after it, so they emit exactly what they would without speculation; sampling requests use rejection
  // sampling (runtime/speculative.h), which leaves the output distribution the target's. The accepted row's slot
  // becomes the sequence's Mamba state. Drafts are capped by max_model_len and max_tokens.
  // With CUDA graphs, a speculative engine captures whole speculative steps instead of decode steps, one per bucket
  // of n sequences (the decode buckets whose n (K + 1) rows are at most 512): the verify forward, the greedy
  // targets, the acceptance (ops::accept_drafts_greedy) and the head's K draft steps on the device, one copy of the
  // step's token ids back. A step replays one when every sequence verifies K drafts, all greedy without penalties or
  // logprobs, and its blocks reach K - 1 tokens past the verify; pad sequences fill the bucket as in decode graphs.
  // Every other step (prompts, the first decode after a prompt, sampling requests) runs eagerly.
  SpeculativeConfig speculative;
};

struct TokenEvent {
  int32_t seq_id;
  int32_t token;        // -1 when the event only finishes the sequence (max_tokens 0, kError)
  FinishReason finish;  // kNone while the sequence goes on
  // When the request asked for logprobs (>= 0): the token's log-probability under the raw logits (log-softmax
  // before penalties and temperature, vLLM's default "raw_logprobs"), and the `logprobs` most likely tokens
  // with theirs, most likely first (ties: lower id first).
  float logprob = 0.0f;
  std::vector<std::pair<int32_t, float>> top_logprobs;
  // The sequence's first event (its first token, or the finish without one) when it asked for prompt_logprobs:
  // one entry per prompt position 1 .. prompt_len - 1 (the first prompt token has none).
  std::vector<PromptLogprob> prompt_logprobs;
  std::string error;  // kError: what went wrong ("non-finite logits at step N of sequence S")
};

class Engine {
 public:
  // ctx.device must be the model's device; the caches are allocated there in the model's activation dtype.
  Engine(const Model& model, const ops::Context& ctx, const EngineConfig& config);
  const Model& model() const { return model_; }

  // Queues a request; returns its sequence id. Bad prompts / parameters -> kInvalidInput; a full waiting queue
  // (SchedulerConfig::max_waiting) -> kOverloaded.
  int32_t add_request(std::vector<int32_t> prompt, const SamplingParams& sampling);
  bool has_unfinished() const { return scheduler_.has_unfinished(); }
  // One step; returns the tokens sampled in it, in batch order.
  std::vector<TokenEvent> step();
  // Sequences finished so far (tokens = prompt + generated), removed from the engine.
  std::vector<Sequence> take_finished();
  // Removes a waiting or running sequence now: its Mamba slot and KV blocks are free for the next step, and it
  // appears in take_finished() with FinishReason::kAbort. False (a no-op) for an unknown or finished id.
  // Call it between steps, on the thread that steps.
  bool abort_request(int32_t seq_id);

  // Load figures a server reports (all between steps).
  int32_t num_running() const { return static_cast<int32_t>(scheduler_.num_running()); }
  int32_t num_waiting() const { return static_cast<int32_t>(scheduler_.num_waiting()); }
  int32_t num_total_blocks() const { return cache_.sizes().num_blocks; }
  int32_t num_free_blocks() const { return cache_.free_blocks(); }
  int32_t num_total_slots() const { return cache_.sizes().max_seqs; }
  int32_t num_free_slots() const { return cache_.free_slots(); }
  // Sequences preempted so far (each counted once per preemption) for want of KV blocks.
  int64_t num_preemptions() const { return scheduler_.num_preemptions(); }
  // Fraction of the KV pool's blocks held by sequences, in [0, 1].
  double kv_cache_usage() const {
    return 1.0 - static_cast<double>(num_free_blocks()) / static_cast<double>(num_total_blocks());
  }

  // Called with each logits row the engine produces, in order per sequence: prompt rows (when
  // return_prompt_logits) then one row per generated token. (Rows computed only for a sequence's
  // prompt_logprobs are not passed here.) On CUDA a step with such rows, or with this set, samples on the host.
  std::function<void(int32_t seq_id, std::span<const float> logits)> on_logits;

  const StateCache& cache() const { return cache_; }
  // Decode batch sizes that have a captured CUDA graph (ascending), device bytes the graphs' private pool holds,
  // and the seconds the start-up warm-up and capture of all of them took (0 without graphs).
  std::vector<int32_t> graph_batch_sizes() const;
  size_t graph_pool_bytes() const;
  double graph_capture_seconds() const { return graph_capture_seconds_; }
  // Whether the graphs are whole speculative steps (EngineConfig::speculative) rather than decode steps.
  bool speculative_graphs() const { return !spec_graphs_.empty(); }
  // Steps that ran as a CUDA graph replay so far.
  int64_t num_graph_steps() const { return num_graph_steps_; }
  // What the last step() computed (zeros before the first, and for a step that found nothing to run).
  struct StepStats {
    int32_t prefill_tokens = 0;  // tokens of sequences in their prompt (or recomputing after a preemption)
    int32_t decode_tokens = 0;   // rows of sequences past their prompt (a verify step's last token and drafts)
    bool graph = false;          // ran as a CUDA graph replay
    // Speculative engines: the backbone's part of the step (the verify forward, sampling, acceptance) and the draft
    // head's (its K forwards and draws), host seconds; each part ends on a device-to-host copy of token ids, so its
    // device work is inside. 0 without speculation.
    double verify_seconds = 0.0;
    double draft_seconds = 0.0;
  };
  const StepStats& last_step() const { return last_step_; }
  // Prefix caching's token counts so far (zero without it), and the Mamba checkpoint pool's use.
  const PrefixCacheStats& prefix_cache_stats() const { return scheduler_.prefix_cache_stats(); }
  int32_t num_checkpoints() const { return cache_.checkpoints().size(); }
  int32_t checkpoint_capacity() const { return cache_.checkpoints().capacity(); }
  // Speculative decoding's counters so far (all zero without it).
  const SpeculativeStats& speculative_stats() const { return spec_stats_; }

 private:
  // A captured decode step of one bucket of n rows: its inputs live at fixed device addresses (refilled before each
  // replay from pinned staging), its logits are the first n rows of graph_logits_.
  struct DecodeGraph {
    device::Graph graph;
    Tensor meta_host, meta_device;  // I32 [4n + 1]: token_ids [n] | cu_seqlens [n + 1] | context_lens [n] | slots [n]
    Tensor tables_host, tables_device;  // I32 [n, max_blocks]
    Tensor logits;                      // [n, vocab] in the activation dtype: a view of graph_logits_
    StepBatch::DeviceMeta device_meta() const;
  };
  // A captured speculative step of one bucket of n verify sequences of K + 1 rows (R = n (K + 1) rows): its inputs
  // at fixed device addresses (refilled from pinned staging before each replay), its outputs copied by the graph
  // itself into pinned host memory.
  struct SpecGraph {
    device::Graph graph;
    int32_t n = 0;
    // I32: tokens [R] | cu_seqlens [n + 1] | context_lens [n] | slots [n] | the SpecPlan's gather, scatter, src,
    // dst, pos [R each] | the attention rows' cu_seqlens [R + 1] and context_lens [R] | the draft steps'
    // cu_seqlens [n + 1]
    Tensor meta_host, meta_device;
    Tensor tables_host, tables_device;  // I32 [n + R, max_blocks]: the sequences' rows, then the attention rows'
    // I32 targets [R] | target non-finite flags [R] | accepted [n] | drafts [K, n], then on the device only:
    // head_rows [n] | draft_context [K - 1, n]
    Tensor out_device, out_host;
    StepBatch::DeviceMeta verify_meta(int32_t K) const;
  };
  // What a replayed speculative step hands back, for the real (unpadded) sequences of the batch.
  struct SpecStepOut {
    std::vector<int32_t> targets, nonfinite;  // [R] per packed row
    std::vector<int32_t> accepted;            // [n]
    std::vector<int32_t> drafts;              // [K, n]: row d holds every sequence's draft d
  };
  // The step's logits on the model's device (host fp32 on the CPU).
  Tensor execute(StepBatch& b);
  // Start-up: a warm-up step and a capture per speculative bucket, largest first.
  void capture_spec_graphs();
  // Whether verify batch b (its sequences `seqs`, in batch order) can replay a speculative graph (see EngineConfig).
  bool spec_graph_fits(const StepBatch& b, const std::vector<Sequence*>& seqs) const;
  // Copies verify batch b into bucket g's staging (pad sequences past its real ones) and that to g's device inputs.
  void stage_spec(SpecGraph& g, const StepBatch& b) const;
  // The captured body over g's inputs (vb: a batch of g.n verify sequences of K + 1 rows, for the shapes).
  void spec_graph_body(const SpecGraph& g, const StepBatch& vb);
  SpecStepOut replay_spec(const StepBatch& b);
  // Start-up: a warm-up step and a capture per bucket, largest first.
  void capture_decode_graphs();
  // Copies the B rows of a decode-only batch into bucket g's staging, the rows past them as pad rows, and that to
  // g's device inputs (ordered before the replay).
  void stage_decode(DecodeGraph& g, int32_t n, const StepBatch& b) const;
  // A decode-only step of B rows on the smallest bucket >= B: logits [B, vocab] (the pad rows' left out).
  Tensor replay_decode(const StepBatch& b);
  // The rows of `logits` (device, activation dtype) sampled on the GPU: ids, non-finite flags and (when a row
  // asks) logprobs come back in a few small copies.
  std::vector<SampledToken> sample_on_device(const Tensor& logits, const std::vector<ops::SamplingRow>& rows,
                                             const std::vector<ops::PenaltyToken>& penalty_tokens,
                                             bool want_logprobs);

  bool speculative() const { return config_.speculative.enabled(); }
  // A sequence's token: appended to it, its finish decided (stop ids, max_tokens, the model length), as an event.
  TokenEvent append_token(Sequence& s, SampledToken& t);
  // Finishes s with kError for non-finite logits at `step`; the event goes through `decorate` (prompt logprobs).
  void fail_nonfinite(Sequence& s, uint64_t step, std::vector<TokenEvent>& events,
                      const std::function<TokenEvent(TokenEvent)>& decorate);
  // After a step of batch b (seqs: its sequences in batch order, hidden: the backbone's output of every row): the
  // MTP head's step over those rows, then its further depths, leaving each decoding sequence's drafts in it.
  void propose_drafts(const StepBatch& b, const std::vector<Sequence*>& seqs, const Tensor& hidden);
  // Drafts the next verify step of s can use: within the model length and the tokens still to generate (<= 0: none).
  int32_t draft_depth(const Sequence& s) const;
  // One draft per sequence from row i of `logits` (the head's): the argmax, or drawn from the draft distribution.
  void draw_drafts(const Tensor& logits, const std::vector<Sequence*>& seqs);

  const Model& model_;
  ops::Context ctx_;
  EngineConfig config_;
  StateCache cache_;
  Scheduler scheduler_;
  std::vector<int64_t> stop_ids_;
  std::vector<Sequence> finished_;
  int32_t next_id_ = 0;
  StepStats last_step_;
  // CUDA only. The stream every op of this engine runs on (owned unless the caller's context names one).
  device::Stream own_stream_;
  std::optional<device::AllocPool> graph_pool_;  // declared before graphs_: outlives them
  std::map<int32_t, DecodeGraph> graphs_;  // by bucket size
  std::map<int32_t, SpecGraph> spec_graphs_;  // by bucket size (sequences)
  Tensor graph_logits_;  // [largest bucket, vocab]: every graph's logits (one replay at a time)
  double graph_capture_seconds_ = 0.0;
  int64_t num_graph_steps_ = 0;
  SpeculativeStats spec_stats_;
};

// The start-up line of an engine's CUDA graphs, as vLLM prints it ("" when it has none):
//   "CUDA graphs: 35 decode batch sizes (1 to 256) captured in 4.21 s, 0.62 GiB"
// ("speculative step batch sizes" for a speculative engine's).
std::string format_graph_capture(const Engine& engine);

// Convenience: runs the engine to completion over several prompts; returns each generated token list.
std::vector<std::vector<int32_t>> generate_all(const Model& model, const ops::Context& ctx,
                                               const EngineConfig& config,
                                               const std::vector<std::vector<int32_t>>& prompts,
                                               const SamplingParams& sampling);

}  // namespace chimera
