#include "runtime/batch.h"

#include <algorithm>

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
    const bool verify = num_spec_seqs > 0 && num_spec_seqs == num_prefill_seqs;
    CHIMERA_CHECK(num_prefill_seqs == 0 || verify,
                  "device-side metadata is for decode-only or verify-only steps ({} prefill sequences, {} verifying)",
                  num_prefill_seqs, num_spec_seqs);
    if (verify) {
      const DeviceMeta::Spec& sp = device_meta->spec;
      CHIMERA_CHECK(sp.gather && sp.scatter && sp.src && sp.dst && sp.pos && sp.attn_cu_seqlens &&
                        sp.attn_context_lens && sp.attn_block_tables.device() == Device::kCuda &&
                        sp.attn_block_tables.dim(1) == block_tables.dim(1),
                    "device-side metadata of a verify step needs every plan array");
    }
    if (device_meta->logit_rows == nullptr) {
      CHIMERA_CHECK(logit_rows.size() == token_ids.size(), "device-side metadata needs a logits row per token");
      for (size_t r = 0; r < logit_rows.size(); ++r) {
        CHIMERA_CHECK(logit_rows[r] == static_cast<int32_t>(r), "device-side metadata needs logit rows in order");
      }
    }
    CHIMERA_CHECK(device_meta->block_tables.device() == Device::kCuda &&
                      device_meta->block_tables.shape() == block_tables.shape(),
                  "device block_tables {} must mirror {}", device_meta->block_tables.describe(),
                  block_tables.describe());
  }
}

SpecPlan spec_plan(const StepBatch& b) {
  SpecPlan p;
  const size_t np = static_cast<size_t>(b.num_prefill_seqs), nc = np - static_cast<size_t>(b.num_spec_seqs);
  if (nc == np) return p;
  const int32_t Tc = b.num_chunk_tokens();
  // Longest sequences first, so step j's rows are the first n_j of its block.
  std::vector<size_t> seqs(np - nc);
  for (size_t i = 0; i < seqs.size(); ++i) seqs[i] = nc + i;
  const auto len = [&](size_t s) { return b.cu_seqlens[s + 1] - b.cu_seqlens[s]; };
  std::stable_sort(seqs.begin(), seqs.end(), [&](size_t x, size_t y) { return len(x) > len(y); });
  p.scatter.resize(static_cast<size_t>(b.num_prefill_tokens() - Tc));
  for (int32_t j = 0; j < len(seqs.front()); ++j) {
    p.step_begin.push_back(p.gather.size());
    for (size_t s : seqs) {
      if (len(s) <= j) break;
      const int32_t row = b.cu_seqlens[s] + j;
      p.scatter[static_cast<size_t>(row - Tc)] = static_cast<int32_t>(p.gather.size());
      p.gather.push_back(row);
      p.src.push_back(j == 0 ? b.state_slots[s] : b.spec_slots[static_cast<size_t>(row - 1 - Tc)]);
      p.dst.push_back(b.spec_slots[static_cast<size_t>(row - Tc)]);
      p.pos.push_back(b.context_lens[s] + j);
    }
  }
  p.step_begin.push_back(p.gather.size());
  return p;
}

AttentionRows attention_rows(const StepBatch& b) {
  AttentionRows a;
  const size_t S = static_cast<size_t>(b.num_seqs());
  const size_t spec0 = static_cast<size_t>(b.num_prefill_seqs - b.num_spec_seqs);
  const size_t spec1 = static_cast<size_t>(b.num_prefill_seqs);
  for (size_t s = 0; s < S; ++s) {
    const int32_t n = b.cu_seqlens[s + 1] - b.cu_seqlens[s];
    const bool verify = s >= spec0 && s < spec1;
    for (int32_t r = 0; r < (verify ? n : 1); ++r) {
      a.cu_seqlens.push_back(a.cu_seqlens.back() + (verify ? 1 : n));
      a.context_lens.push_back(b.context_lens[s] + (verify ? r : 0));
      a.table_rows.push_back(static_cast<int32_t>(s));
    }
  }
  return a;
}

}  // namespace chimera
