// StepBatch: the one description of a forward step, the same for every backend, prefill and decode
// (docs/architecture.md "One batch description"). Plain data: the scheduler builds it, the model
// reads it, nothing else is needed to run a step.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "ops/ops.h"

namespace chimera {

struct StepBatch {
  // Packed token ids of all sequences of the step: the multi-token group first, then the single-token group.
  std::vector<int32_t> token_ids;
  // Per sequence s: rows [cu_seqlens[s], cu_seqlens[s+1]) of the packed tokens. Size num_seqs + 1.
  std::vector<int32_t> cu_seqlens{0};
  // Tokens of sequence s already in its context (cached) before this step.
  std::vector<int32_t> context_lens;
  // Mamba state slot of sequence s (conv + SSM state of every Mamba layer).
  std::vector<int32_t> state_slots;
  // KV block table: [num_seqs, max_blocks_per_seq] I32 host tensor; row s lists sequence s's blocks.
  Tensor block_tables;
  // Which kernels a sequence runs; any sequence may carry any context. The first num_prefill_seqs sequences
  // run the multi-token kernels (varlen causal conv, chunked SSD scan, attention of the new rows over context +
  // new rows) with any number >= 1 of new tokens: a prompt chunk, a preempted sequence recomputing its tokens,
  // a decode token with drafts. The rest run the single-token kernels (conv update, selective state update,
  // decode attention), one new token each. The engine puts a sequence with one new token after a non-empty
  // context in the second group, every other in the first.
  int32_t num_prefill_seqs = 0;
  // Speculative verify steps (runtime/engine.h): the last num_spec_seqs sequences of the multi-token group are each
  // a decode token followed by its draft tokens. Their Mamba layers step token by token (the single-token update)
  // instead of running the chunked scan, out of place: the conv and SSM state after row i of such a sequence go to
  // slot spec_slots[j] (j: the row's index among all spec rows, so spec_slots has one entry per spec row), row i + 1
  // reads them there (row 0 reads state_slots[s]), and state_slots[s] keeps the state before the step. The engine
  // then adopts the slot of the last accepted row: a rejected draft costs no replay. Every other op sees ordinary
  // multi-token rows (attention over context + new rows).
  int32_t num_spec_seqs = 0;
  std::vector<int32_t> spec_slots;
  // Prefix caching's Mamba checkpoints inside prompt chunks: sequence `seq` (one of the chunk sequences, the first
  // num_prefill_seqs - num_spec_seqs) leaves its Mamba state after its first `rows` new rows in slot `slot` too. The
  // Mamba layers' conv and scan write that state as they pass the cut (ops::StateCheckpoint); every other op sees the
  // chunk whole. Sorted by seq, then rows; 0 < rows < the sequence's new rows.
  using MambaCheckpoint = ops::StateCheckpoint;
  std::vector<MambaCheckpoint> mamba_checkpoints;
  // Packed rows whose logits the step returns, in this order (the last row of each sequence when
  // generating; every row when scoring a prompt).
  std::vector<int32_t> logit_rows;

  // Optional: the same metadata already in device memory (the engine's graph-captured steps keep it there, so the
  // captured ops read it instead of uploading the host vectors above, which must still have the same sizes; their
  // values are read only by checks). Decode-only batches, or batches of verify sequences alone (num_spec_seqs ==
  // num_prefill_seqs, no prompt chunks) with the `spec` arrays set.
  struct DeviceMeta {
    const int32_t* token_ids = nullptr;     // [num_tokens]
    const int32_t* cu_seqlens = nullptr;    // [num_seqs + 1]
    const int32_t* context_lens = nullptr;  // [num_seqs]
    const int32_t* state_slots = nullptr;   // [num_seqs]
    Tensor block_tables;                    // [num_seqs, max_blocks] I32 on the device
    // The verify rows' plans, in the layouts spec_plan and attention_rows (below) return.
    struct Spec {
      const int32_t* gather = nullptr;  // SpecPlan::gather, scatter, src, dst, pos: [verify rows] each
      const int32_t* scatter = nullptr;
      const int32_t* src = nullptr;
      const int32_t* dst = nullptr;
      const int32_t* pos = nullptr;
      const int32_t* attn_cu_seqlens = nullptr;    // AttentionRows::cu_seqlens [attention rows + 1]
      const int32_t* attn_context_lens = nullptr;  // AttentionRows::context_lens [attention rows]
      Tensor attn_block_tables;                    // [attention rows, max_blocks]: row r is table_rows[r]'s
    } spec;
    // [logit_rows.size()]: the rows to return, when they are not every row in order (a draft head's step).
    const int32_t* logit_rows = nullptr;
  };
  const DeviceMeta* device_meta = nullptr;

  int32_t num_seqs() const { return static_cast<int32_t>(context_lens.size()); }
  int32_t num_tokens() const { return static_cast<int32_t>(token_ids.size()); }
  int32_t num_prefill_tokens() const { return cu_seqlens[static_cast<size_t>(num_prefill_seqs)]; }
  // Rows of the multi-token group before the spec sequences' (prompt chunks and recomputation).
  int32_t num_chunk_tokens() const { return cu_seqlens[static_cast<size_t>(num_prefill_seqs - num_spec_seqs)]; }
  // Checks internal consistency (sizes, monotone offsets, one token per sequence of the single-token group,
  // contexts >= 0); kRuntime on error.
  void validate() const;
};

// The step-major order of a step's speculative verify rows (StepBatch::num_spec_seqs), the same for every Mamba layer
// of the step: step j is row j of every verify sequence longer than j (longest sequences first), its rows
// [step_begin[j], step_begin[j + 1]) of the gathered order, each with the Mamba slot it reads (row 0: the sequence's
// state_slots entry, row i: row i - 1's spec slot), the slot it writes (its spec slot) and its token's position.
struct SpecPlan {
  std::vector<int32_t> gather;   // step-major position -> row of the step
  std::vector<int32_t> scatter;  // verify row (from the first one) -> its step-major position
  std::vector<int32_t> src, dst, pos;
  std::vector<size_t> step_begin;
};
SpecPlan spec_plan(const StepBatch& batch);

// The rows as attention sees them. A verify sequence's n rows are n single-token rows at positions context, ...,
// context + n - 1 of the sequence (each its own entry, all with the sequence's block table), so a verify step is a
// decode batch to the attention kernels; the attention op then appends every row's k / v before any row attends
// (the rows read each other's keys). Every other sequence is itself.
struct AttentionRows {
  std::vector<int32_t> cu_seqlens{0};
  std::vector<int32_t> context_lens;
  std::vector<int32_t> table_rows;  // the batch sequence whose block-table row each entry uses
};
AttentionRows attention_rows(const StepBatch& batch);

}  // namespace chimera
