// CPU reference backend: the ground truth every other backend is tested against (docs/style.md 2).
// Same contracts as ops/ops.h; shapes, dtypes and devices are already validated by the entry points there,
// so these functions trust their arguments. All math in fp32; activations F32; weights F32/BF16/F16.
#pragma once

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "ops/ops.h"

namespace chimera::cpu {

void embedding(const Tensor& out, const Tensor& table, std::span<const int32_t> ids);
// ops::embedding_shard: table holds vocabulary rows [first, first + V); other ids give zero rows.
void embedding_shard(const Tensor& out, const Tensor& table, std::span<const int32_t> ids, int64_t first);
void convert(const Tensor& out, const Tensor& in);  // F32 copy (CPU activations are F32)
void rms_norm(const Tensor& out, const Tensor& x, const Tensor& weight, float eps);
void add_rms_norm(const Tensor& residual, const Tensor& out, const Tensor& x, const Tensor& weight, float eps);
void add2_rms_norm(const Tensor& residual, const Tensor& out, const Tensor& a, const Tensor& b, const Tensor& weight,
                   float eps);
// A spanned gated norm's two halves (ops::SpannedNorm): sums[t, group] = sum over row t of (y * silu(z))^2 (sums'
// other columns untouched); then out = weight * u * rsqrt(sums[t, group] / count + eps).
void gated_square_sums(const Tensor& sums, const Tensor& y, const Tensor& z, int64_t group);
void gated_rms_norm_from_sums(const Tensor& out, const Tensor& y, const Tensor& z, const Tensor& weight,
                              const Tensor& sums, int64_t group, int64_t count, float eps);
void gated_rms_norm(const Tensor& out, const Tensor& y, const Tensor& z, const Tensor& weight, int64_t n_groups,
                    float eps);

void linear(const Tensor& out, const Tensor& x, const Tensor& weight, const Tensor& bias);
void relu2(const Tensor& x);
void relu2_mlp(const Tensor& out, const Tensor& x, const Tensor& up_proj, const Tensor& down_proj);

void causal_conv1d(const Tensor& out, const Tensor& x, const Tensor& weight, const Tensor& bias,
                   const Tensor& conv_state, std::span<const int32_t> cu_seqlens, std::span<const int32_t> slots,
                   bool silu, std::span<const ops::StateCheckpoint> checkpoints = {});
void causal_conv1d_update(const Tensor& out, const Tensor& x, const Tensor& weight, const Tensor& bias,
                          const Tensor& conv_state, std::span<const int32_t> slots, bool silu,
                          std::span<const int32_t> dst_slots = {});

void ssd_chunk_scan(const Tensor& y, const Tensor& x, const Tensor& dt_raw, const Tensor& B, const Tensor& C,
                    const ops::SsmParams& p, const Tensor& ssm_state, std::span<const int32_t> cu_seqlens,
                    std::span<const int32_t> slots, int64_t chunk_size,
                    std::span<const ops::StateCheckpoint> checkpoints = {});
void ssm_recurrence(const Tensor& y, const Tensor& x, const Tensor& dt_raw, const Tensor& B, const Tensor& C,
                    const ops::SsmParams& p, const Tensor& ssm_state, std::span<const int32_t> cu_seqlens,
                    std::span<const int32_t> slots);
// dst_slots empty: in place; else sequence b's new state goes to slot dst_slots[b] (ops.h).
void selective_state_update(const Tensor& y, const Tensor& x, const Tensor& dt_raw, const Tensor& B, const Tensor& C,
                            const ops::SsmParams& p, const Tensor& ssm_state, std::span<const int32_t> slots,
                            std::span<const int32_t> dst_slots = {});

void attention(const Tensor& out, const Tensor& q, const Tensor& k, const Tensor& v, const ops::KvCacheView& cache,
               std::span<const int32_t> cu_seqlens, std::span<const int32_t> context_lens, const Tensor& block_tables,
               float scale);

void router_topk(const Tensor& topk_ids, const Tensor& topk_weights, const Tensor& logits,
                 const Tensor& correction_bias, const ops::RouterParams& p);
void router_gate_topk(const Tensor& topk_ids, const Tensor& topk_weights, const Tensor& x, const Tensor& gate,
                      const Tensor& correction_bias, const ops::RouterParams& p);
// ops::local_expert_ids: ids in place to the rank's experts (-1 for another rank's).
void local_expert_ids(const Tensor& ids, int64_t first, int64_t count);
void moe_experts(const Tensor& out, const Tensor& x, const Tensor& topk_ids, const Tensor& topk_weights,
                 std::span<const Tensor> up_proj, std::span<const Tensor> down_proj);

// Sampling (sampling.cpp): sample_row is the whole algorithm for one row, also used by runtime's sample_token.
struct SampledRow {
  int32_t id = -1;
  float logprob = 0.0f;                             // raw log-softmax of the sampled token
  std::vector<std::pair<int32_t, float>> top;       // the num_top_logprobs most likely raw tokens
  bool nonfinite = false;                           // the row holds a NaN or an infinity
};
// `penalties`: this row's distinct tokens (the row's penalty range already applied). with_logprob: compute
// `logprob` (top is computed when p.num_top_logprobs > 0).
SampledRow sample_row(std::span<const float> logits, const ops::SamplingRow& p,
                      std::span<const ops::PenaltyToken> penalties, bool with_logprob);
// The distribution sample_row draws from, dense over the vocabulary and normalised (0 outside the tokens it keeps;
// a greedy row: 1 at the argmax): for speculative decoding's rejection sampling (runtime/speculative.h).
std::vector<float> sampling_probs(std::span<const float> logits, const ops::SamplingRow& p,
                                  std::span<const ops::PenaltyToken> penalties);
void sample_tokens(const ops::SamplingOutputs& out, const Tensor& logits, std::span<const ops::SamplingRow> rows,
                   std::span<const ops::PenaltyToken> penalty_tokens);
void accept_drafts_greedy(const Tensor& accepted, const Tensor& head_rows, const Tensor& draft_context,
                          const Tensor& tokens, const Tensor& targets, const Tensor& context_lens);
// The raw log-softmax of one given token of a row (sample_row's logprob for that token), its rank (1 + the number
// of tokens with a larger logit) and the row's k most likely tokens with theirs (ties: lower id first).
struct TokenLogprobs {
  float logprob = 0.0f;
  int32_t rank = 1;
  std::vector<std::pair<int32_t, float>> top;
};
TokenLogprobs token_logprobs(std::span<const float> logits, int32_t token, int32_t k);

void add(const Tensor& out, const Tensor& a, const Tensor& b);
void copy_columns(const Tensor& out, const Tensor& in, int64_t col_begin);
void write_columns(const Tensor& out, const Tensor& in, int64_t col_begin);

}  // namespace chimera::cpu
