// CUDA backend: the same contracts as ops/ops.h, entered from the validating entry points in ops/ops.cpp.
// Each function is the adapter between Tensors and a kernel launcher: it reads shapes and pointers into the
// op's plain params struct, picks the template instance from the dtypes (loudly failing on unsupported
// ones) and launches on ctx.stream. Host-side metadata (cu_seqlens, slots, context_lens) is uploaded to
// device scratch with a stream-ordered copy, unless the caller passes it in device memory (ops::Indices::device:
// the graph-captured decode step), in which case nothing is uploaded.
// Activations on CUDA may be F32, BF16 or F16 (one dtype per call); accumulation is always fp32.
#pragma once

#include <cstdint>
#include <span>

#include "ops/ops.h"

namespace chimera::cuda {

// norm/ (norm_ops.cu)
// shard: ops::embedding_shard (table = vocabulary rows [first, first + V), other ids give zero rows).
void embedding(const ops::Context& ctx, const Tensor& out, const Tensor& table, const ops::Indices& ids,
               int64_t first = 0, bool shard = false);
void convert(const ops::Context& ctx, const Tensor& out, const Tensor& in);
void rms_norm(const ops::Context& ctx, const Tensor& out, const Tensor& x, const Tensor& weight, float eps);
void add_rms_norm(const ops::Context& ctx, const Tensor& residual, const Tensor& out, const Tensor& x,
                  const Tensor& weight, float eps);
void add2_rms_norm(const ops::Context& ctx, const Tensor& residual, const Tensor& out, const Tensor& a, const Tensor& b,
                   const Tensor& weight, float eps);
void gated_rms_norm(const ops::Context& ctx, const Tensor& out, const Tensor& y, const Tensor& z, const Tensor& weight,
                    int64_t n_groups, float eps);
// norm/ (elementwise.cu)
void relu2(const ops::Context& ctx, const Tensor& x);
void add(const ops::Context& ctx, const Tensor& out, const Tensor& a, const Tensor& b);
void copy_columns(const ops::Context& ctx, const Tensor& out, const Tensor& in, int64_t col_begin);
void write_columns(const ops::Context& ctx, const Tensor& out, const Tensor& in, int64_t col_begin);

// gemm/ (linear.cu: cuBLASLt)
void linear(const ops::Context& ctx, const Tensor& out, const Tensor& x, const Tensor& weight, const Tensor& bias);
void linear_multi(const ops::Context& ctx, std::span<const Tensor> outs, const Tensor& x,
                  std::span<const Tensor> weights);
void relu2_mlp(const ops::Context& ctx, const Tensor& out, const Tensor& x, const Tensor& up_proj,
               const Tensor& down_proj);
void residual_norm_linear(const ops::Context& ctx, const ops::ResidualNorm& rn, std::span<const Tensor> outs,
                          std::span<const Tensor> weights, const Tensor& bias);
void residual_rms_norm(const ops::Context& ctx, const ops::ResidualNorm& rn);

// mamba/ (conv1d.cu)
void causal_conv1d(const ops::Context& ctx, const Tensor& out, const Tensor& x, const Tensor& weight,
                   const Tensor& bias, const Tensor& conv_state, std::span<const int32_t> cu_seqlens,
                   std::span<const int32_t> slots, bool silu, std::span<const ops::StateCheckpoint> checkpoints = {});
void causal_conv1d_update(const ops::Context& ctx, const Tensor& out, const Tensor& x, const Tensor& weight,
                          const Tensor& bias, const Tensor& conv_state, const ops::Indices& slots, bool silu,
                          const ops::Indices& dst_slots = {});
// mamba/ (selective_state_update.cu)
void selective_state_update(const ops::Context& ctx, const Tensor& y, const Tensor& x, const Tensor& dt_raw,
                            const Tensor& B, const Tensor& C, const ops::SsmParams& p, const Tensor& ssm_state,
                            const ops::Indices& slots, const ops::Indices& dst_slots);
// mamba/ (mamba_decode_fused.cu): conv update + selective state update + gated norm in one kernel.
// mamba_decode_fusable: whether the fused kernel takes these sizes and dtypes on this device (else the caller
// composes the three ops); mamba_decode_update throws when it does not.
bool mamba_decode_fusable(const Tensor& zxbcdt, const Tensor& conv_weight, const Tensor& conv_state,
                          const Tensor& ssm_state, int64_t n_groups);
void mamba_decode_update(const ops::Context& ctx, const Tensor& out, const Tensor& zxbcdt, const Tensor& conv_weight,
                         const Tensor& conv_bias, const ops::SsmParams& p, const Tensor& norm_weight,
                         int64_t n_groups, float eps, const Tensor& conv_state, const Tensor& ssm_state,
                         const ops::Indices& slots, bool prefetch_states = false);
// mamba/ (ssd_*.cu)
void ssd_chunk_scan(const ops::Context& ctx, const Tensor& y, const Tensor& x, const Tensor& dt_raw, const Tensor& B,
                    const Tensor& C, const ops::SsmParams& p, const Tensor& ssm_state,
                    std::span<const int32_t> cu_seqlens, std::span<const int32_t> slots, int64_t chunk_size,
                    std::span<const ops::StateCheckpoint> checkpoints = {});
void ssm_recurrence(const ops::Context& ctx, const Tensor& y, const Tensor& x, const Tensor& dt_raw, const Tensor& B,
                    const Tensor& C, const ops::SsmParams& p, const Tensor& ssm_state,
                    std::span<const int32_t> cu_seqlens, std::span<const int32_t> slots);

// attention/ (attention.cu)
void attention(const ops::Context& ctx, const Tensor& out, const Tensor& q, const Tensor& k, const Tensor& v,
               const ops::KvCacheView& cache, const ops::Indices& cu_seqlens, const ops::Indices& context_lens,
               const Tensor& block_tables, float scale);

// moe/ (router.cu, experts.cu)
void router_topk(const ops::Context& ctx, const Tensor& topk_ids, const Tensor& topk_weights, const Tensor& logits,
                 const Tensor& correction_bias, const ops::RouterParams& p);
void router_gate_topk(const ops::Context& ctx, const Tensor& topk_ids, const Tensor& topk_weights, const Tensor& x,
                      const Tensor& gate, const Tensor& correction_bias, const ops::RouterParams& p);
void moe_experts(const ops::Context& ctx, const Tensor& out, const Tensor& x, const Tensor& topk_ids,
                 const Tensor& topk_weights, std::span<const Tensor> up_proj, std::span<const Tensor> down_proj);
void moe_experts_shared(const ops::Context& ctx, const Tensor& out, const Tensor& x, const Tensor& topk_ids,
                        const Tensor& topk_weights, std::span<const Tensor> up_proj, std::span<const Tensor> down_proj,
                        const ops::SharedExpert& shared);
void local_expert_ids(const ops::Context& ctx, const Tensor& ids, int64_t first, int64_t count);

// sampling/ (sampling.cu)
void sample_tokens(const ops::Context& ctx, const ops::SamplingOutputs& out, const Tensor& logits,
                   std::span<const ops::SamplingRow> rows, std::span<const ops::PenaltyToken> penalty_tokens);
void accept_drafts_greedy(const ops::Context& ctx, const Tensor& accepted, const Tensor& head_rows,
                          const Tensor& draft_context, const Tensor& tokens, const Tensor& targets,
                          const Tensor& context_lens);

}  // namespace chimera::cuda
