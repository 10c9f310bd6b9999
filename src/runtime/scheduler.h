// The scheduler decides, as plain data, which sequences run in the next step and how many new tokens each
// (docs/architecture.md "The engine loop"). It speaks in tokens: a sequence's computed tokens catch up with its tokens,
// so one step may give a sequence one token (a decode), many (a prompt chunk, or a preempted sequence
// recomputing its prompt and generated tokens) or, later, a decode token plus drafts. Priority: running
// sequences past their prompt first, then running sequences in their prompt, then waiting sequences in
// arrival order, while the token budget, the Mamba slots and the KV blocks last. When a running sequence
// needs a KV block and none is free, the most recently admitted running sequence is preempted (recompute,
// as vLLM v1): its slot and blocks are freed and it goes back to the front of the waiting queue with its
// generated tokens, to be prefilled again on readmission. It never touches tensors, so it is tested
// without a model.
#pragma once

#include <cstdint>
#include <deque>
#include <span>
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
  // The largest num_computed reached so far: a preempted sequence recomputes up to here without producing
  // (or reporting) logits rows again.
  int32_t num_computed_max = 0;
  int32_t num_preemptions = 0;
  std::string error;  // kError: the message
  // sampling.prompt_logprobs >= 0: those of prompt positions 1.. computed so far (every prefill chunk adds
  // its rows); handed out with the sequence's first sampling event.
  std::vector<PromptLogprob> prompt_logprobs;
  // Speculative decoding (runtime/engine.h): the draft tokens proposed to follow `tokens`, which the next step
  // verifies (scheduled as 1 + drafts.size() tokens), and when sampling each one's draft distribution (dense over
  // the vocabulary) for rejection sampling. Cleared by a preemption.
  std::vector<int32_t> drafts;
  std::vector<std::vector<float>> draft_probs;
  // CacheSizes::spare_slots Mamba slots the verify step writes its rows' states to; held and released with `slot`.
  std::vector<int32_t> spare_slots;
  // Prefix caching (runtime/prefix_cache.h): the chain hashes of the full blocks of `tokens` computed so far (they
  // depend on the tokens alone), and how many of `blocks` are published.
  std::vector<uint64_t> block_hashes;
  int32_t num_published = 0;
  // Admission found published KV blocks of this prompt up to here but no Mamba checkpoint that far (0: none): the
  // prompt leaves one there, where it parts from the prompt computed before it.
  int32_t shared_kv_end = 0;

  int32_t num_generated() const { return static_cast<int32_t>(tokens.size()) - prompt_len; }
  // Tokens not yet in the caches (the next step's candidates).
  int32_t num_pending() const { return static_cast<int32_t>(tokens.size()) - num_computed; }
  bool finished() const { return finish != FinishReason::kNone; }
  bool in_prefill() const { return num_computed < prompt_len; }
};

struct ScheduledSeq {
  int32_t seq_id;
  int32_t num_tokens;  // new tokens this step, >= 1
};

// A Mamba state copy between slots: a checkpoint restored into a sequence's slot before the step, or a sequence's
// state saved into a checkpoint slot after it.
struct SlotCopy {
  int32_t dst;
  int32_t src;
};

struct SchedulerOutput {
  std::vector<ScheduledSeq> seqs;  // in priority order; the engine arranges them into the step batch
  std::vector<int32_t> preempted;  // ids preempted while scheduling this step (now waiting)
  // Prefix caching: sequences admitted on a cached prefix, whose slot the engine fills from the checkpoint before
  // the step runs (their num_computed already counts the prefix).
  std::vector<SlotCopy> restores;
  // Prefix caching: checkpoint boundaries inside the step's chunks (StepBatch::mamba_checkpoints): sequence seq_id
  // leaves its Mamba state after `rows` of its new tokens in checkpoint slot `slot`.
  struct Checkpoint {
    int32_t seq_id;
    int32_t rows;
    int32_t slot;
  };
  std::vector<Checkpoint> checkpoints;
  bool empty() const { return seqs.empty(); }
};

struct SchedulerConfig {
  int32_t max_num_seqs = 8;               // sequences in flight
  int32_t max_num_batched_tokens = 2048;  // tokens per step (prefill chunks + decodes)
  // Requests that may wait for admission; add() past it throws ErrorKind::kOverloaded. 0: no bound.
  // Preempted sequences return to the queue whatever its length.
  int32_t max_waiting = 0;
  // Speculative decoding's K (the engine sets it): a running sequence past its prompt is scheduled with its drafts,
  // and every sequence's KV blocks cover K - 1 tokens past the step's (the draft steps after it write there).
  int32_t num_speculative_tokens = 0;
};

class Scheduler {
 public:
  Scheduler(const SchedulerConfig& config, StateCache& cache);

  // Takes ownership of the sequence; it waits until a slot and blocks are free. kInvalidInput for an empty or
  // too long prompt, kOverloaded when the waiting queue is full.
  void add(Sequence seq);
  SchedulerOutput schedule();
  // Frees the slot and blocks of finished sequences and forgets them; returns them.
  std::vector<Sequence> collect_finished();
  // Prefix caching, after each step for each of its sequences (num_computed updated): publishes the blocks it
  // completed, and when its computed tokens end on a checkpoint boundary returns the copy that saves its Mamba
  // state as a checkpoint (the engine issues it before anything else touches the slot).
  std::optional<SlotCopy> commit(Sequence& s);
  const PrefixCacheStats& prefix_cache_stats() const { return prefix_stats_; }

  // Removes a waiting or running, unfinished sequence at once, freeing its slot and blocks; it comes back with
  // finish = kAbort. nullopt (and nothing changes) for an unknown or already finished id.
  std::optional<Sequence> abort(int32_t id);

  Sequence& get(int32_t id);  // linear in the number of sequences: for one lookup, not a loop over a step
  // The admitted sequences (valid until the next schedule, abort or collect_finished).
  std::span<Sequence> running() { return running_; }
  bool has_unfinished() const { return !waiting_.empty() || !running_.empty(); }
  size_t num_running() const { return running_.size(); }
  size_t num_waiting() const { return waiting_.size(); }
  int64_t num_preemptions() const { return num_preemptions_; }

 private:
  // Moves running_.back() (the most recently admitted) back to the front of the waiting queue.
  void preempt_last(SchedulerOutput& out, int32_t& budget);
  // Frees a sequence's Mamba slots (its own and the spare ones) and KV blocks.
  void release(Sequence& s);
  // KV positions a sequence given n new tokens this step needs blocks for (capped at the model length).
  int32_t tokens_to_reserve(const Sequence& s, int32_t n) const;
  // Prefix caching applies to s (the cache has it on and s does not score its prompt).
  bool caches(const Sequence& s) const;
  // Extends s.block_hashes over the full blocks of its first num_tokens tokens.
  void hash_blocks(Sequence& s, int32_t num_tokens) const;
  // Where s's prompt leaves a Mamba checkpoint besides every checkpoint_interval tokens: the last block boundary
  // short of its last prompt token (0: a prompt of one block or less), so that a request resending the prompt, or
  // extending it as the next turn of a chat does, resumes within a block of its end.
  int32_t prompt_checkpoint(const Sequence& s) const;
  // s leaves a checkpoint after its first m tokens: m is a multiple of the interval, its prompt_checkpoint or its
  // shared_kv_end.
  bool is_checkpoint_boundary(const Sequence& s, int32_t m) const;
  // Admission on a cached prefix: the longest block-aligned prefix, short of the last token, whose blocks are
  // published and (with Mamba layers) whose end has a checkpoint. Takes references to its blocks (into `blocks`);
  // returns its length (0: none) and the checkpoint's slot in `checkpoint`.
  int32_t match_prefix(Sequence& s, std::vector<int32_t>& blocks, int32_t& checkpoint);
  // The checkpoint boundaries strictly inside the step's chunks, each given a checkpoint slot unless it is saved
  // already (after every preemption of the step is decided, so no slot is promised for a chunk that does not run).
  void plan_checkpoints(SchedulerOutput& out);

  SchedulerConfig config_;
  StateCache& cache_;
  std::deque<Sequence> waiting_;
  std::vector<Sequence> running_;  // admitted (own a slot), in admission order
  int64_t num_preemptions_ = 0;
  PrefixCacheStats prefix_stats_;
};

}  // namespace chimera
