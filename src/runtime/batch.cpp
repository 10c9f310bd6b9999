#include "runtime/batch.h"

#include "core/error.h"

namespace chimera {

void StepBatch::validate() const {
  const size_t s = context_lens.size();
  CHIMERA_CHECK(cu_seqlens.size() == s + 1, "cu_seqlens has {} entries for {} sequences", cu_seqlens.size(), s);
  CHIMERA_CHECK(state_slots.size() == s, "state_slots has {} entries for {} sequences", state_slots.size(), s);
  CHIMERA_CHECK(cu_seqlens.front() == 0 && cu_seqlens.back() == num_tokens(), "cu_seqlens must span [0, {}]",
                num_tokens());
  CHIMERA_CHECK(num_prefill_seqs >= 0 && static_cast<size_t>(num_prefill_seqs) <= s, "num_prefill_seqs {}",
                num_prefill_seqs);
  CHIMERA_CHECK(num_spec_seqs >= 0 && num_spec_seqs <= num_prefill_seqs, "num_spec_seqs {} of {} multi-token sequences",
                num_spec_seqs, num_prefill_seqs);
  const size_t spec_rows = static_cast<size_t>(num_prefill_tokens() - num_chunk_tokens());
  CHIMERA_CHECK(spec_slots.size() == spec_rows, "spec_slots has {} entries for {} spec rows", spec_slots.size(),
                spec_rows);
  for (size_t i = 0; i < s; ++i) {
    const int32_t n = cu_seqlens[i + 1] - cu_seqlens[i];
    CHIMERA_CHECK(n >= 1, "sequence {} has {} new tokens", i, n);
    CHIMERA_CHECK(context_lens[i] >= 0, "sequence {} has context {}", i, context_lens[i]);
    if (static_cast<int32_t>(i) >= num_prefill_seqs) {
      CHIMERA_CHECK(n == 1, "sequence {} of the single-token group has {} new tokens", i, n);
    }
  }
  if (s > 0) {
    CHIMERA_CHECK(block_tables.ndim() == 2 && block_tables.dim(0) == static_cast<int64_t>(s) &&
                      block_tables.dtype() == DType::kI32,
                  "block_tables must be I32 [{}, max_blocks], got {}", s, block_tables.describe());
  }
  for (int32_t r : logit_rows) CHIMERA_CHECK(r >= 0 && r < num_tokens(), "logit row {} out of range", r);
  const int32_t chunk_seqs = num_prefill_seqs - num_spec_seqs;
  for (size_t j = 0; j < mamba_checkpoints.size(); ++j) {
    const MambaCheckpoint& m = mamba_checkpoints[j];
    CHIMERA_CHECK(m.seq >= 0 && m.seq < chunk_seqs, "Mamba checkpoint {} of sequence {}: not a prompt chunk", j, m.seq);
    const int32_t n = cu_seqlens[static_cast<size_t>(m.seq) + 1] - cu_seqlens[static_cast<size_t>(m.seq)];
    CHIMERA_CHECK(m.rows > 0 && m.rows < n, "Mamba checkpoint {} after {} of {} rows", j, m.rows, n);
    if (j > 0) {
      const MambaCheckpoint& p = mamba_checkpoints[j - 1];
      CHIMERA_CHECK(p.seq < m.seq || (p.seq == m.seq && p.rows < m.rows), "Mamba checkpoints out of order at {}", j);
    }
  }
  if (device_meta != nullptr) {
    CHIMERA_CHECK(num_prefill_seqs == 0, "device-side metadata is for decode-only steps ({} prefill sequences)",
                  num_prefill_seqs);
    CHIMERA_CHECK(logit_rows.size() == token_ids.size(), "device-side metadata needs a logits row per token");
    for (size_t r = 0; r < logit_rows.size(); ++r) {
      CHIMERA_CHECK(logit_rows[r] == static_cast<int32_t>(r), "device-side metadata needs logit rows in order");
    }
    CHIMERA_CHECK(device_meta->block_tables.device() == Device::kCuda &&
                      device_meta->block_tables.shape() == block_tables.shape(),
                  "device block_tables {} must mirror {}", device_meta->block_tables.describe(),
                  block_tables.describe());
  }
}

}  // namespace chimera
