// Backend-neutral entry points of every Nemotron-H operation.
//
// Each function checks shapes and dtypes once (an ErrorKind::kRuntime error naming the op and the tensor
// on mismatch), then dispatches on ctx.device to the CPU reference (backends/cpu) or CUDA (backends/cuda: which
// kernel runs for a shape is the backend's plan, docs/kernel_plan.md, with the switches of ctx.kernels).
// Conventions:
//   * Activations are F32 on the CPU backend (the reference computes everything in fp32).
//   * Weights may be F32, BF16 or F16 (converted on the fly, fp32 accumulation).
//   * Linear weights are [out_features, in_features]: y = x @ W^T (+ b).
//   * Batched ops take a packed token batch: rows of all sequences back to back, with
//     cu_seqlens [num_seqs + 1] (cu_seqlens[0] = 0) giving each sequence's row range, and per-sequence
//     state slots (a slot id < 0 means "pad: skip this sequence").
//   * Fused ops (add + RMSNorm, gated RMSNorm, router top-k, MoE) are first-class ops, not hidden
//     optimisations, so each has a CPU reference the CUDA version is tested against.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/tensor.h"
#include "ops/kernel_config.h"

namespace chimera {
class Profiler;  // runtime/profiler.h
}  // namespace chimera

namespace chimera::dist {
class HostCollectives;  // dist/host_collectives.h
class DeviceGroup;      // dist/device_group.h (CUDA + NCCL builds)
}  // namespace chimera::dist

namespace chimera::ops {

struct Context {
  Device device = Device::kCpu;
  void* stream = nullptr;  // cudaStream_t on the CUDA backend
  // When set and armed (Profiler::begin_step), every op is bracketed by an NVTX range and timed (CUDA events
  // on `stream`; steady_clock on the CPU). Null: no cost beyond one pointer test per op.
  Profiler* profiler = nullptr;
  // Which kernel variants the CUDA backend runs (ops/kernel_config.h); immutable for the context's lifetime.
  KernelConfig kernels = {};
};

// Int32 metadata of a step: token ids, state slots, sequence offsets, context lengths. `host` always holds the
// values: the checks and the CPU backend read them there. `device`, when set, is the same array already in device
// memory (the CUDA-graph decode path of runtime/engine.cpp keeps its inputs there): a CUDA op then reads it instead
// of uploading `host`, and takes nothing from the host values but their count, so the launch can be captured in a
// CUDA graph and replayed after new values are copied into the same device array.
struct Indices {
  std::span<const int32_t> host;
  const int32_t* device = nullptr;

  Indices() = default;
  Indices(std::span<const int32_t> h, const int32_t* d = nullptr) : host(h), device(d) {}  // NOLINT: implicit
  Indices(const std::vector<int32_t>& v) : host(v) {}                                      // NOLINT: implicit
  size_t size() const { return host.size(); }
  bool empty() const { return host.empty(); }
  int32_t operator[](size_t i) const { return host[i]; }
  Indices first(size_t n) const { return {host.first(n), device}; }
  Indices subspan(size_t offset) const { return {host.subspan(offset), device ? device + offset : nullptr}; }
};

// ---- embedding, norms ------------------------------------------------------------------------------
// out: [T, D] f32; table: [V, D]; ids: T token ids (each must be in [0, V): out of range -> kInvalidInput).
void embedding(const Context& ctx, const Tensor& out, const Tensor& table, const Indices& ids);
// A vocabulary-parallel rank's embedding: table [V, D] holds rows [first, first + V) of a vocabulary of
// vocab_size; ids must be in [0, vocab_size) (else kInvalidInput); a row whose id lies outside the shard is zero,
// so the sum over ranks is the whole lookup.
void embedding_shard(const Context& ctx, const Tensor& out, const Tensor& table, const Indices& ids, int64_t first,
                     int64_t vocab_size);
// out = in converted to out's dtype (same shape [T, D]); the identity row gather.
void convert(const Context& ctx, const Tensor& out, const Tensor& in);

// out = weight * (x * rsqrt(mean(x^2) + eps)); x, out: [T, D]; weight: [D]. out may alias x.
void rms_norm(const Context& ctx, const Tensor& out, const Tensor& x, const Tensor& weight, float eps);

// residual += x (in place), then out = rms_norm(residual). residual, x, out: [T, D]; weight [D].
void add_rms_norm(const Context& ctx, const Tensor& residual, const Tensor& out, const Tensor& x,
                  const Tensor& weight, float eps);

// residual += round(a + b) (in place), then out = rms_norm(residual). The MoE layer's two mixer outputs (shared
// expert and routed experts) summed inside the norm kernel: a + b is rounded to the activation dtype first, then
// added to the residual and rounded again, exactly add(mix, a, b) followed by add_rms_norm(residual, out, mix)
// (bit-identical to those two ops on every backend). residual, a, b, out: [T, D]; weight [D].
void add2_rms_norm(const Context& ctx, const Tensor& residual, const Tensor& out, const Tensor& a, const Tensor& b,
                   const Tensor& weight, float eps);

// ---- tensor parallelism (docs/architecture.md "Tensor parallelism") ----------------------------------
// A tensor-parallel rank: its communicators and its index in them. `group` (host memory) is always set; on CUDA,
// ranks on distinct GPUs also have `device` (NCCL and the fused AllReduce), and ranks without it (several ranks on
// one GPU: the tests) stage their CUDA collectives through host memory over `group`.
struct TpGroup {
  dist::HostCollectives* group = nullptr;
  int rank = 0;
  dist::DeviceGroup* device = nullptr;
};
// x (any shape, the same on every rank) = the sum of every rank's x. The host path adds in rank order 0..size-1 in
// fp32 (every rank holds identical bits); the device path sums as NCCL / the fused kernels do (identical on every
// rank too). The row-parallel layers' partial outputs go through it before the residual add.
void all_reduce(const Context& ctx, const Tensor& x, const TpGroup& tp);
// The row-parallel epilogue: residual += sum over ranks of x, then out = rms_norm(residual) * weight (x is
// overwritten). One fused kernel on the device path (the cross-layer AllReduce + residual + RMSNorm fusion);
// all_reduce then add_rms_norm elsewhere. residual, out, x: [T, D]; weight [D].
void all_reduce_add_rms_norm(const Context& ctx, const Tensor& residual, const Tensor& out, const Tensor& x,
                             const Tensor& weight, float eps, const TpGroup& tp);
// out [R, size * C] = every rank's in [R, C] side by side in rank order (vocabulary-parallel logits made whole).
void all_gather_columns(const Context& ctx, const Tensor& out, const Tensor& in, const TpGroup& tp);
// A gated norm group that spans ranks: with fewer groups than ranks each rank holds 1 / span of one group's
// channels (the group `group` of n_groups in the whole layer), so the sum of squares is summed over the ranks
// before the norm divides by it (vLLM's Mixer2RMSNormGated for n_groups = 1). Every rank must call the op.
struct SpannedNorm {
  TpGroup tp;
  int64_t n_groups = 1;  // the layer's groups (unsharded)
  int64_t group = 0;     // the rank's group
  int64_t span = 1;      // ranks per group
};

// Gated grouped RMSNorm (docs/model.md 3.3, norm_before_gate = false):
//   u = y * silu(z); per group of D/n_groups channels: u *= rsqrt(mean(u^2) + eps); out = weight * u
// y, z, out: [T, D]; weight: [D]; D % n_groups == 0. With `spanned` (then n_groups must be 1): the rank's D
// channels are one part of a group of D * span channels, mean(u^2) is taken over the whole group (one
// all_reduce of [T, spanned->n_groups] sums; on CUDA y and z go through host memory for it: a path only a rank
// count above the model's n_groups takes).
void gated_rms_norm(const Context& ctx, const Tensor& out, const Tensor& y, const Tensor& z, const Tensor& weight,
                    int64_t n_groups, float eps, const SpannedNorm* spanned = nullptr);

// ---- dense -----------------------------------------------------------------------------------------
// out: [T, out_features] f32; x: [T, in_features] f32; weight: [out_features, in_features] (F32/BF16/F16);
// bias: [out_features] or an undefined Tensor.
void linear(const Context& ctx, const Tensor& out, const Tensor& x, const Tensor& weight,
            const Tensor& bias = Tensor());

// The same x through 1..3 weights (no bias): exactly linear(outs[i], x, weights[i]) for each i (the CPU runs those).
// On CUDA at decode sizes (T <= 2, 16-bit) one GEMV launch streams all the weights: an attention layer's q, k and
// v projections as one launch instead of three dependent ones. outs[i]: [T, weights[i].dim(0)].
void linear_multi(const Context& ctx, std::span<const Tensor> outs, const Tensor& x, std::span<const Tensor> weights);

// The residual step between two layers folded into the next layer's first dense op:
//   residual_out = residual + a                 (add_rms_norm), or residual + round(a + b) when b is defined
//                                               (add2_rms_norm: a MoE layer's shared and routed outputs)
//   x = rms_norm(residual_out) * norm_weight
//   outs[i] = x @ weights[i]^T (+ bias, only with one weight)
// exactly add_rms_norm / add2_rms_norm then linear / linear_multi (the CPU runs those). residual_out must not overlap
// residual, a or b: the caller alternates two residual buffers. x is scratch: unspecified afterwards, since on CUDA
// at decode sizes (T <= 2, 16-bit, the norm weight in the activation dtype) one GEMV launch computes x per block
// (bit-identical to the norm kernel's output) and never stores it. residual, residual_out, a, b, x: [T, D];
// norm_weight: [D]; weights[i]: [N_i, D]; outs[i]: [T, N_i].
struct ResidualNorm {
  Tensor residual;
  Tensor residual_out;
  Tensor a;
  Tensor b;  // undefined: add_rms_norm
  Tensor norm_weight;
  float eps = 0.0f;
  Tensor x;
};
void residual_norm_linear(const Context& ctx, const ResidualNorm& rn, std::span<const Tensor> outs,
                          std::span<const Tensor> weights, const Tensor& bias = Tensor());
// The residual step alone, out of place: residual_out = residual + a (+ round(a + b)), x = rms_norm(residual_out) *
// norm_weight, stored. Exactly convert(residual_out, residual) then add_rms_norm / add2_rms_norm on residual_out,
// in one launch on CUDA (the norm kernel reads residual and writes residual_out). For the layers whose first dense
// op cannot take the norm (quantized weights).
void residual_rms_norm(const Context& ctx, const ResidualNorm& rn);

// x = relu(x)^2 in place (any shape).
void relu2(const Context& ctx, const Tensor& x);

// out = down(relu(up(x))^2). x: [T, D]; up: [I, D]; down: [D, I]; out: [T, D].
void relu2_mlp(const Context& ctx, const Tensor& out, const Tensor& x, const Tensor& up_proj,
               const Tensor& down_proj);

// ---- Mamba-2 ---------------------------------------------------------------------------------------
// A Mamba state checkpoint inside a prefill call (prefix caching, runtime/prefix_cache.h): sequence `seq` of the
// call also leaves its state after its first `rows` new rows in state slot `slot`. 0 < rows < the sequence's rows;
// the sequence is not a pad; the slot is in range and no sequence's slot nor another checkpoint's; sorted by seq,
// then rows.
struct StateCheckpoint {
  int32_t seq;
  int32_t rows;
  int32_t slot;
};

// Depthwise causal conv1d over a packed batch, SiLU fused when `silu`.
//   x, out: [T, C]; weight: [C, K] (or the checkpoint's [C, 1, K]); bias: [C] or undefined;
//   conv_state: [num_slots, C, K-1]: the K-1 inputs preceding each sequence's first new token (zeros for a
//   fresh sequence); on return holds the last K-1 inputs (older ones kept when a sequence has < K-1 tokens).
//   cu_seqlens: [num_seqs + 1]; slots: [num_seqs]. A pad sequence (slot < 0) is skipped: its out rows and
//   all state are left untouched. Non-negative slots must be distinct.
//   checkpoints: the K-1 inputs preceding each cut (older ones from the sequence's state when the cut is fewer
//   than K-1 rows in) written to the checkpoint's slot.
void causal_conv1d(const Context& ctx, const Tensor& out, const Tensor& x, const Tensor& weight, const Tensor& bias,
                   const Tensor& conv_state, std::span<const int32_t> cu_seqlens, std::span<const int32_t> slots,
                   bool silu, std::span<const StateCheckpoint> checkpoints = {});

// Single-step update for a batch of sequences (one token each). x, out: [B, C]; slots: [B].
// dst_slots (empty: in place): sequence b reads slot slots[b] and writes its shifted window to slot dst_slots[b],
// leaving slots[b] as it was, with selective_state_update's rules for the destinations (below): the same bits as
// the in-place update.
void causal_conv1d_update(const Context& ctx, const Tensor& out, const Tensor& x, const Tensor& weight,
                          const Tensor& bias, const Tensor& conv_state, const Indices& slots, bool silu,
                          const Indices& dst_slots = {});

// Parameters shared by the SSD scan and the selective state update.
struct SsmParams {
  Tensor A_log;    // [H]   A = -exp(A_log)
  Tensor D;        // [H]   skip connection
  Tensor dt_bias;  // [H]   dt = softplus(dt_raw + dt_bias), clamped to [dt_min, dt_max]
  float dt_min = 0.0f;
  float dt_max = 1.0f / 0.0f;  // +inf: the (0, inf) default of time_step_limit is a no-op
  // The SSM state may be F32, BF16 or F16 (--mamba-ssm-cache-dtype); the math is fp32 in every case, the state is
  // read once and written once per call, rounded to nearest even for BF16 and stochastically for F16
  // (core/stochastic_rounding.h): element e of a sequence's state written after the token at position t uses the bits
  // ssm_rounding_bits(ssm_rounding_key(state_seed, t), e), so the CPU reference and CUDA round identically.
  uint64_t state_seed = 0;  // per layer (the model derives it from the layer index)
  // Per sequence of the call, the tokens it had before this call's rows (StepBatch::context_lens): a decode row's
  // token is at position context_lens[b], a prefill's last at context_lens[s] + n_s - 1. Empty: 0 for every
  // sequence. Read only for an F16 state.
  Indices context_lens;
};

// Chunked SSD prefill (docs/model.md 3.4) over a packed batch, with initial states read from and final states
// written to ssm_state slots. x: [T, H, P]; dt_raw: [T, H]; B, C: [T, G, N]; y: [T, H, P];
// ssm_state: [num_slots, H, P, N] F32, BF16 or F16 (SsmParams). Head h uses group h / (H / G). The chunk grid restarts
// at each sequence start. A pad sequence (slot < 0) is skipped: its y rows are left untouched. checkpoints: the grid
// also restarts at each cut, and the state there (the state entering the chunk after it, rounded to the state dtype as
// a final state is, keyed by the position of the row before the cut) is written to the checkpoint's slot; the sequence
// runs on in fp32, so y and its final state are those of the call without the checkpoints up to the chunking.
void ssd_chunk_scan(const Context& ctx, const Tensor& y, const Tensor& x, const Tensor& dt_raw, const Tensor& B,
                    const Tensor& C, const SsmParams& p, const Tensor& ssm_state, std::span<const int32_t> cu_seqlens,
                    std::span<const int32_t> slots, int64_t chunk_size,
                    std::span<const StateCheckpoint> checkpoints = {});

// The plain per-token recurrence (docs/model.md 3.3): the test oracle for ssd_chunk_scan, same contract.
void ssm_recurrence(const Context& ctx, const Tensor& y, const Tensor& x, const Tensor& dt_raw,
                    const Tensor& B, const Tensor& C, const SsmParams& p, const Tensor& ssm_state,
                    std::span<const int32_t> cu_seqlens, std::span<const int32_t> slots);

// Decode: one token per sequence (docs/model.md 3.5). x, y: [B, H, P]; dt_raw: [B, H]; B, C: [B, G, N];
// slots: [B] (slot < 0: skipped, y left untouched). dt is clamped to [dt_min, dt_max] as in the prefill, so a
// one-token ssd_chunk_scan and this update agree (HF's decode kernel ignores the limit; a no-op for (0, inf)).
void selective_state_update(const Context& ctx, const Tensor& y, const Tensor& x, const Tensor& dt_raw,
                            const Tensor& B, const Tensor& C, const SsmParams& p, const Tensor& ssm_state,
                            const Indices& slots);
// Out of place: sequence b reads its state from slot slots[b] and writes the updated state to slot dst_slots[b] of the
// same pool, leaving slots[b] as it was (speculative decoding keeps the old state to roll back to). y and the new state
// have the same bits as the in-place update on the same backend. dst_slots: [B]; a row with slots[b] < 0 is skipped
// whatever dst_slots[b] holds; otherwise dst_slots[b] must be in range, used by no other sequence as a source or a
// destination (dst_slots[b] == slots[b] updates that row in place). Empty dst_slots: the in-place update.
void selective_state_update(const Context& ctx, const Tensor& y, const Tensor& x, const Tensor& dt_raw,
                            const Tensor& B, const Tensor& C, const SsmParams& p, const Tensor& ssm_state,
                            const Indices& slots, const Indices& dst_slots);

// The whole Mamba-2 decode step between in_proj and out_proj, for one token per sequence:
//   causal_conv1d_update(xBC, silu) -> selective_state_update(x, dt_raw, B, C) -> gated_rms_norm(y, z)
// from the in_proj output rows zxbcdt [B, Di + Cd + H] = [ z : Di | xBC : Cd | dt_raw : H ] (docs/model.md 3.2) to
// out [B, Di]. Sizes come from the state: ssm_state [num_slots, H, P, N], Di = H * P, Cd = Di + 2 * n_groups * N;
// conv_weight [Cd, K] (or [Cd, 1, K]), conv_bias [Cd] or undefined, conv_state [num_slots, Cd, K-1], p's [H]
// parameters, norm_weight [Di] (norm groups of Di / n_groups channels = the heads of one B/C group).
// slots: [B] (slot < 0: pad, both states untouched and its out row unspecified).
// The result is exactly the three ops in order (the CPU reference composes them). The model calls this op for every
// decode batch; the backend picks the kernels. On CUDA, up to ctx.kernels.mamba_decode_fused_max_rows rows, one
// kernel (a thread-block cluster per sequence and group) computes them with the same roundings to the activation
// dtype at the same points: conv and SSM state bit-identical to the three CUDA kernels, out within an ulp (the norm's
// sum of squares is added in another order). More rows, or sizes the kernel does not take (N not in {16, 32, 64,
// 128, 256}, K not in {2, 3, 4}, a misaligned state, no cluster fits), run the three ops instead, so the op works for
// every valid shape.
// prefetch_states (CUDA, fused kernel): the slots' conv and SSM states are loaded before the kernel's PDL wait,
// overlapping the previous kernel (launch.cuh, "two back"), when ctx.kernels.mamba_prefetch_states. The caller
// guarantees that the previous kernel on the stream writes neither state (the model: this layer's in_proj). Same
// results either way.
// dst_slots (empty: in place): both states out of place, as causal_conv1d_update and selective_state_update take
// them (a speculative verify step keeps every token's state, runtime/engine.h): always the three ops composed.
// spanned: the gated norm's group spans tensor-parallel ranks (gated_rms_norm): always the three ops composed.
void mamba_decode_update(const Context& ctx, const Tensor& out, const Tensor& zxbcdt, const Tensor& conv_weight,
                         const Tensor& conv_bias, const SsmParams& p, const Tensor& norm_weight, int64_t n_groups,
                         float eps, const Tensor& conv_state, const Tensor& ssm_state, const Indices& slots,
                         bool prefetch_states = false, const Indices& dst_slots = {},
                         const SpannedNorm* spanned = nullptr);

// ---- attention -------------------------------------------------------------------------------------
// A paged KV cache of one attention layer: k, v: [num_blocks, block_size, num_key_value_heads, head_dim], in the
// activation dtype, or F8_E4M3 (--kv-cache-dtype fp8) with per-tensor scales: attention stores
// e4m3(k / k_scale) (round to nearest even, saturated at +-448) and reads e4m3 x k_scale, likewise v (vLLM's FP8 KV
// cache; the scales are the checkpoint's k_scale / v_scale, 1 when it has none). The scales are unused otherwise.
struct KvCacheView {
  Tensor k;
  Tensor v;
  float k_scale = 1.0f;
  float v_scale = 1.0f;
};

// Causal GQA attention over a packed batch with a paged KV cache, no positional encoding.
// Appends this step's k, v at positions context_lens[s] .. context_lens[s] + n_s - 1 of each sequence, then
// each new query at position context_lens[s] + i attends to positions [0, context_lens[s] + i].
//   q, out: [T, Qh, hd]; k, v: [T, KVh, hd]; cu_seqlens: [S + 1]; context_lens: [S] tokens already cached;
//   block_tables: [S, max_blocks_per_seq] I32 (row s lists sequence s's blocks in order).
//   scale: usually 1/sqrt(hd). Query head j uses kv head j / (Qh / KVh).
void attention(const Context& ctx, const Tensor& out, const Tensor& q, const Tensor& k, const Tensor& v,
               const KvCacheView& cache, const Indices& cu_seqlens, const Indices& context_lens,
               const Tensor& block_tables, float scale);

// ---- MoE -------------------------------------------------------------------------------------------
struct RouterParams {
  int64_t top_k = 1;
  int64_t n_group = 1;
  int64_t topk_group = 1;
  bool norm_topk_prob = true;
  float routed_scaling_factor = 1.0f;
};

// DeepSeek-V3 "noaux_tc" sigmoid router (docs/model.md 6.1) from fp32 router logits.
//   logits: [T, E] f32; correction_bias: [E]; topk_ids: [T, k] I32; topk_weights: [T, k] f32.
//   Selection uses sigmoid(logits) + bias, weights are the unbiased sigmoid scores, renormalised
//   (w / (sum + 1e-20)) when norm_topk_prob, times routed_scaling_factor. Output order: by descending
//   biased score; ties broken toward the lower expert index.
void router_topk(const Context& ctx, const Tensor& topk_ids, const Tensor& topk_weights, const Tensor& logits,
                 const Tensor& correction_bias, const RouterParams& p);

// The router from its input: logits = x.float() @ gate.float()^T in fp32 (transformers' F.linear(x.float(),
// weight.float())), then exactly router_topk. x: [T, D] (activation dtype); gate: [E, D] (F32 on the model's
// CUDA path, else F32 / BF16 / F16); correction_bias: [E]; topk_ids / topk_weights as router_topk.
// The CPU reference is linear + router_topk (bit-identical to calling them). On CUDA, small T (decode:
// T <= 16, F32 gate, E <= 512) runs ONE kernel (GEMV split over experts and columns, the last block to finish
// sums the column partials in a fixed order and selects); larger T keeps convert + cuBLASLt + router_topk.
// The fused logits differ from cuBLASLt's only by fp32 summation order.
void router_gate_topk(const Context& ctx, const Tensor& topk_ids, const Tensor& topk_weights, const Tensor& x,
                      const Tensor& gate, const Tensor& correction_bias, const RouterParams& p);

// Routed experts: out[t] = sum_j w[t, j] * down_e(relu(up_e(x[t]))^2), e = topk_ids[t, j].
//   x: [T, Din]; out: [T, Din]; up[e]: [I, Din]; down[e]: [Din, I]; up.size() == down.size() == E.
//   Accumulation in fp32 (HF eager adds experts in increasing expert index order).
void moe_experts(const Context& ctx, const Tensor& out, const Tensor& x, const Tensor& topk_ids,
                 const Tensor& topk_weights, std::span<const Tensor> up_proj, std::span<const Tensor> down_proj);

// Expert parallelism: topk_ids [T, k] of the whole model's experts, in place, to the rank's experts
// [first, first + count): id - first, or -1 for a pair another rank's expert runs (the experts ops skip -1, so the
// rank's output is its part of the sum).
void local_expert_ids(const Context& ctx, const Tensor& topk_ids, int64_t first, int64_t count);

// A MoE layer's shared expert: out = relu2_mlp(x, up_proj, down_proj). x, out: [T, H]; up: [Is, H]; down: [H, Is].
// x is the hidden state (also when the routed experts run in a latent space).
struct SharedExpert {
  Tensor out;
  Tensor x;
  Tensor up_proj;
  Tensor down_proj;
};

// The routed experts and the shared expert of one MoE layer: exactly moe_experts(out, x, ...) and
// relu2_mlp(shared.out, shared.x, shared.up_proj, shared.down_proj) (the CPU runs those two references). On CUDA at
// decode sizes (T <= 8 tokens, 16-bit activations and weights of one dtype) the shared expert runs inside the
// routed experts' two GEMV launches, with relu2_mlp's rounding points (its up product rounded to the activation
// dtype before relu^2, the relu^2 rounded again); otherwise the two ops one after the other.
void moe_experts_shared(const Context& ctx, const Tensor& out, const Tensor& x, const Tensor& topk_ids,
                        const Tensor& topk_weights, std::span<const Tensor> up_proj,
                        std::span<const Tensor> down_proj, const SharedExpert& shared);

// ---- sampling --------------------------------------------------------------------------------------
// Per-row sampling parameters. temperature 0 (or top_k 1) is greedy; top_k 0, top_p 1, min_p 0, presence and
// frequency penalties 0 and repetition_penalty 1 are off.
struct SamplingRow {
  float temperature = 0.0f;
  int32_t top_k = 0;
  float top_p = 1.0f;
  uint64_t seed = 0;
  uint64_t step = 0;  // index of the token being generated in its sequence: the uniform is counter_uniform(seed, step)
  float min_p = 0.0f;
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  float repetition_penalty = 1.0f;
  int32_t num_top_logprobs = 0;  // top logprobs wanted for this row, 0..kMaxTopLogprobs
  // This row's entries of the penalty token list: [penalty_begin, penalty_end).
  int32_t penalty_begin = 0;
  int32_t penalty_end = 0;
};

constexpr int32_t kMaxTopLogprobs = 20;

// One distinct token of a sequence, for the penalties: how often it was generated so far, and whether the
// prompt holds it. Repetition applies to tokens in the prompt or the output; presence and frequency to the
// output only (OpenAI / vLLM semantics).
struct PenaltyToken {
  int32_t id = 0;
  int32_t output_count = 0;
  int32_t in_prompt = 0;
};

// Outputs of the full sampler; every tensor but ids may be left undefined (then it is not computed).
struct SamplingOutputs {
  Tensor ids;           // [R] I32: the sampled token of each row
  Tensor logprobs;      // [R] F32: that token's log-probability under the raw logits (log-softmax, no penalty,
                        //      no temperature)
  Tensor top_ids;       // [R, K] I32: the K most likely tokens of the raw logits (ties: lower id first); a row
                        //      that asked for fewer has -1 past its count
  Tensor top_logprobs;  // [R, K] F32: their raw log-probabilities (0 past the row's count)
  Tensor nonfinite;     // [R] I32: 1 where the row's logits hold a NaN or an infinity, else 0
};

// One token id per row of fp32 logits. out_ids: [R] I32; logits: [R, V] F32; rows: R parameter sets.
// Order of operations (vLLM's): penalties -> temperature -> min_p -> top-k -> top-p -> sample.
// Penalties (from each row's PenaltyToken entries): a repeated token's logit l becomes l / repetition_penalty
// when l > 0, else l * repetition_penalty; then l -= frequency_penalty * output_count and
// l -= presence_penalty * (output_count > 0). Greedy: argmax of the penalised logits, ties -> lowest id.
// Otherwise the candidates in descending penalised-logit order (ties: lower id first); min_p keeps those with
// exp((l - max) / T) >= min_p; then the first top_k; softmax at the temperature; the smallest prefix whose mass
// reaches top_p (at least one token); inverse-CDF sampling of u = counter_uniform(seed, step) over that prefix.
// Log-probabilities are those of the raw logits (vLLM's default logprobs mode, "raw_logprobs").
// Invalid parameters (temperature < 0 or not finite, top_k < 0, top_p outside (0, 1], min_p outside [0, 1],
// a penalty not finite, repetition_penalty <= 0, num_top_logprobs outside [0, kMaxTopLogprobs], a penalty range
// outside the list, a penalty token outside the vocabulary) -> kRuntime.
void sample_tokens(const Context& ctx, const SamplingOutputs& out, const Tensor& logits,
                   std::span<const SamplingRow> rows, std::span<const PenaltyToken> penalty_tokens);
// Only the ids (no penalty list).
// Rows that are all greedy, without penalties or logprobs, need no per-row parameters on CUDA: such a call uploads
// nothing and can be captured in a CUDA graph.
void sample_tokens(const Context& ctx, const Tensor& out_ids, const Tensor& logits, std::span<const SamplingRow> rows);

// Greedy acceptance of a speculative verify step of n sequences of k + 1 rows each (runtime/engine.h), on the device
// so that a captured step can draft on: sequence i's row j (packed row i (k + 1) + j) carries token tokens[row]
// (j = 0: the sequence's last token, j >= 1: draft j - 1) and the target model's greedy choice targets[row] for the
// position after it. All I32:
//   accepted [n]:  the number of leading drafts equal to the target before them, 0 .. k
//   head_rows [n]: i (k + 1) + accepted[i], the row after which the draft head predicts the next first draft
//   draft_context [k - 1, n] (or empty when k = 1): context_lens[i] + accepted[i] + d + 1 in row d, the context of
//                  the head's step that drafts token d + 2 of the next verify
// tokens, targets: [n (k + 1)]; context_lens: [n], the verify step's.
void accept_drafts_greedy(const Context& ctx, const Tensor& accepted, const Tensor& head_rows,
                          const Tensor& draft_context, const Tensor& tokens, const Tensor& targets,
                          const Tensor& context_lens);

// ---- small helpers used by the model ---------------------------------------------------------------
// out = a + b (elementwise, same shape). out may alias a or b.
void add(const Context& ctx, const Tensor& out, const Tensor& a, const Tensor& b);
// Copies columns [col_begin, col_begin + out.dim(1)) of a [T, W] matrix into out [T, w].
void copy_columns(const Context& ctx, const Tensor& out, const Tensor& in, int64_t col_begin);
// The inverse: writes in [T, w] into columns [col_begin, col_begin + w) of out [T, W] (a concat is one call a part).
void write_columns(const Context& ctx, const Tensor& out, const Tensor& in, int64_t col_begin);

}  // namespace chimera::ops
