#include "models/nemotron_h.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <optional>
#include <utility>

#include "backends/device_api.h"
#include "core/error.h"
#include "dist/host_collectives.h"
#include "io/npy.h"
#include "io/quant_config.h"
#include "ops/quant_ops.h"

namespace chimera {
namespace {

// Rows `rows` of a [T, D] activation as a new [rows.size(), D] tensor of `dtype` on ctx.device: ops::embedding
// is exactly a row gather with a dtype conversion, on every backend (no host loop touches device memory).
Tensor gather_rows(const ops::Context& ctx, const Tensor& in, DType dtype, const ops::Indices& rows) {
  Tensor out = device::empty(ctx.device, dtype, {static_cast<int64_t>(rows.size()), in.dim(1)});
  ops::embedding(ctx, out, in, rows);
  return out;
}

// Splits the columns of a [T, sum(widths)] activation into [T, widths[i]] tensors. One row (a batch-1 decode
// step) is contiguous, so the parts are views and nothing is copied (three kernels fewer per split); otherwise
// each part is a strided copy.
void split_columns(const ops::Context& ctx, const Tensor& in, std::initializer_list<int64_t> widths,
                   std::initializer_list<Tensor*> parts) {
  const int64_t T = in.dim(0);
  int64_t begin = 0;
  auto part = parts.begin();
  for (int64_t w : widths) {
    if (T == 1) {
      **part = in.reshape({in.dim(1)}).rows(begin, begin + w).reshape({1, w});
    } else {
      **part = device::empty(ctx.device, in.dtype(), {T, w});
      ops::copy_columns(ctx, **part, in, begin);
    }
    begin += w;
    ++part;
  }
}

void check_options(const ModelConfig& c, const ModelOptions& options) {
  if (c.mlp_bias) invalid_input("config.json: mlp_bias=true is not supported (no released checkpoint uses it)");
  if (c.attention_bias) invalid_input("config.json: attention_bias=true is not supported (HF ignores it too)");
  if (options.device == Device::kCuda && options.dtype != DType::kF32 && options.dtype != DType::kBF16 &&
      options.dtype != DType::kF16) {
    invalid_input("model dtype {} is not supported on CUDA (supported: float32, bfloat16, float16)",
                  dtype_name(options.dtype));
  }
}

}  // namespace

NemotronH NemotronH::load(const ModelConfig& config, const Checkpoint& checkpoint, const ModelOptions& options) {
  check_options(config, options);
  NemotronH m = with_options(config, options);
  // A checkpoint's weights (mmap views) are uploaded after the name table has checked that nothing is missing or
  // unexpected.
  m.w_ = load_weights(config, checkpoint, load_quant_config(checkpoint.dir()), options);
  if (m.device_ == Device::kCuda) {
    WeightUploader up(config, m.act_dtype_);
    const int n = static_cast<int>(config.layers.size()) + mtp_layer_count(m.w_);
    for (int i = -1; i < n; ++i) up.upload(m.w_, i);
  }
  return m;
}

NemotronH NemotronH::synthetic(const ModelConfig& config, const ModelOptions& options, uint64_t seed) {
  check_options(config, options);
  if (!dtype_is_float(options.dtype) || options.dtype == DType::kF8E4M3) {
    invalid_input("synthetic weights need a float dtype, got {}", dtype_name(options.dtype));
  }
  NemotronH m = with_options(config, options);
  // On CUDA each layer is uploaded as soon as it is made (the host never holds more than one layer).
  std::optional<WeightUploader> up;
  if (m.device_ == Device::kCuda) up.emplace(config, m.act_dtype_);
  m.w_ = synthetic_weights(config, options, seed, [&](ModelWeights& w, int layer) {
    if (up) up->upload(w, layer);
  });
  return m;
}

NemotronH NemotronH::with_options(const ModelConfig& config, const ModelOptions& options) {
  NemotronH m;
  m.config_ = config;
  m.tp_ = options.tp;
  m.local_ = rank_config(config, options.tp);
  m.device_ = options.device;
  m.act_dtype_ = options.device == Device::kCpu ? DType::kF32 : options.dtype;
  return m;
}

std::map<std::string, int64_t> NemotronH::parameter_counts() const {
  std::map<std::string, int64_t> n;
  for (const auto& [kind, k] : weight_summary(config_, w_)) n[kind] = k.parameters;
  return n;
}

// ---- forward ---------------------------------------------------------------------------------------

namespace {
// A mixer's first linear op on its normed input x: with `pre`, the residual step producing x folded into it (the
// fused ops when the weights are dense, ops/quant_ops.h).
void input_linear(const ops::Context& ctx, const ops::ResidualNorm* pre, const Tensor& x, std::span<const Tensor> outs,
                  std::span<const ops::LinearWeight* const> weights, const Tensor& bias) {
  if (pre != nullptr) {
    ops::residual_norm_linear(ctx, *pre, outs, weights, bias);
  } else if (weights.size() == 1) {
    ops::linear(ctx, outs[0], x, *weights[0], bias);
  } else {
    ops::linear_multi(ctx, outs, x, weights);
  }
}
}  // namespace

void NemotronH::mamba_mixer(const ops::Context& ctx, const LayerWeights& L, const StepBatch& b, const SpecPlan& spec,
                            const Tensor& conv_state, const Tensor& ssm_state, const ops::ResidualNorm* pre,
                            const Tensor& x, const Tensor& out) const {
  const ModelConfig& c = local_;
  const MambaWeights& w = L.mamba;
  const int64_t T = b.num_tokens(), H = c.mamba_num_heads, P = c.mamba_head_dim, G = c.n_groups;
  const int64_t N = c.ssm_state_size, Di = c.mamba_inner(), Cd = c.conv_dim();
  const int64_t Tp = b.num_prefill_tokens(), Tc = b.num_chunk_tokens();
  const size_t np = static_cast<size_t>(b.num_prefill_seqs);
  const size_t nc = np - static_cast<size_t>(b.num_spec_seqs);  // prompt chunks (and recomputation) first
  const std::span<const int32_t> cu(b.cu_seqlens);
  const ops::Indices slots(b.state_slots, b.device_meta ? b.device_meta->state_slots : nullptr);
  // The positions that key an F16 state's stochastic rounding (ops.h SsmParams::context_lens).
  ops::SsmParams sp = w.ssm;
  sp.context_lens = ops::Indices(b.context_lens, b.device_meta ? b.device_meta->context_lens : nullptr);

  // in_proj rows: [ z : Di | xBC : Cd | dt : H ]  (docs/model.md 3.2)
  Tensor zxbcdt = act(ctx, {T, c.in_proj_dim()});
  const ops::LinearWeight* in_proj[] = {&w.in_proj};
  input_linear(ctx, pre, x, {&zxbcdt, 1}, in_proj, w.in_proj_bias);
  Tensor normed = act(ctx, {T, Di});

  // Decode rows: conv update + selective state update + gated norm as ONE op straight from the in_proj rows (which
  // kernels run is the backend's choice: one fused kernel for small batches on CUDA, the three ops otherwise).
  if (Tp < T) {
    ops::SsmParams decode = sp;
    decode.context_lens = sp.context_lens.subspan(np);
    ops::mamba_decode_update(ctx, normed.rows(Tp, T), zxbcdt.rows(Tp, T), w.conv1d_weight, w.conv1d_bias, decode,
                             w.norm, G, c.layer_norm_epsilon, conv_state, ssm_state, slots.subspan(np),
                             /*prefetch_states=*/true, {}, spanned_norm());  // the previous kernel is in_proj
  }
  // Speculative verify rows: the single-token update token by token, out of place (StepBatch::spec_slots).
  if (nc < np) spec_mamba(ctx, w, b, spec, zxbcdt, sp, conv_state, ssm_state, normed);
  // Prefill rows: varlen causal conv + SiLU, chunked SSD scan, gated norm.
  if (nc > 0) {
    const Tensor in_rows = Tc == T ? zxbcdt : zxbcdt.rows(0, Tc);
    Tensor z, xbc, dt;
    split_columns(ctx, in_rows, {Di, Cd, H}, {&z, &xbc, &dt});
    Tensor xbc_act = act(ctx, {Tc, Cd});
    // Prefix caching's checkpoints inside the chunks (StepBatch::mamba_checkpoints): the conv and the scan write the
    // state at each cut as they pass it.
    const std::span<const ops::StateCheckpoint> cuts(b.mamba_checkpoints);
    ops::causal_conv1d(ctx, xbc_act, xbc, w.conv1d_weight, w.conv1d_bias, conv_state, cu.first(nc + 1),
                       slots.host.first(nc), /*silu=*/true, cuts);
    Tensor xs, B, C;
    split_columns(ctx, xbc_act, {Di, G * N, G * N}, {&xs, &B, &C});
    Tensor y = act(ctx, {Tc, H, P});
    ops::SsmParams prefill = sp;
    prefill.context_lens = sp.context_lens.first(nc);
    ops::ssd_chunk_scan(ctx, y, xs.reshape({Tc, H, P}), dt, B.reshape({Tc, G, N}), C.reshape({Tc, G, N}), prefill,
                        ssm_state, cu.first(nc + 1), slots.host.first(nc), c.chunk_size, cuts);
    // Gate first, then per-group RMSNorm (norm_before_gate = false).
    ops::gated_rms_norm(ctx, Tc == T ? normed : normed.rows(0, Tc), y.reshape({Tc, Di}), z, w.norm, G,
                        c.layer_norm_epsilon, spanned_norm());
  }
  ops::linear(ctx, out, normed, w.out_proj, w.out_proj_bias);
}

void NemotronH::spec_mamba(const ops::Context& ctx, const MambaWeights& w, const StepBatch& b, const SpecPlan& spec,
                           const Tensor& zxbcdt, const ops::SsmParams& sp, const Tensor& conv_state,
                           const Tensor& ssm_state, const Tensor& normed) const {
  const int32_t Tc = b.num_chunk_tokens(), Ts = b.num_prefill_tokens() - Tc;
  // The plan's arrays, on the device too when the step's metadata is (a captured verify step).
  const StepBatch::DeviceMeta::Spec* dev = b.device_meta ? &b.device_meta->spec : nullptr;
  const auto indices = [](const std::vector<int32_t>& v, const int32_t* d) { return ops::Indices(v, d); };
  const Tensor in = gather_rows(ctx, zxbcdt, act_dtype_, indices(spec.gather, dev ? dev->gather : nullptr));
  const Tensor out = act(ctx, {Ts, normed.dim(1)});
  const ModelConfig& c = local_;
  const auto part = [&](const std::vector<int32_t>& v, const int32_t* d, size_t r0, size_t r1) {
    return ops::Indices(std::span<const int32_t>(v).subspan(r0, r1 - r0), d ? d + r0 : nullptr);
  };
  for (size_t j = 0; j + 1 < spec.step_begin.size(); ++j) {
    const size_t r0 = spec.step_begin[j], r1 = spec.step_begin[j + 1];
    ops::SsmParams step = sp;
    step.context_lens = part(spec.pos, dev ? dev->pos : nullptr, r0, r1);
    ops::mamba_decode_update(ctx, out.rows(static_cast<int64_t>(r0), static_cast<int64_t>(r1)),
                             in.rows(static_cast<int64_t>(r0), static_cast<int64_t>(r1)), w.conv1d_weight,
                             w.conv1d_bias, step, w.norm, c.n_groups, c.layer_norm_epsilon, conv_state, ssm_state,
                             part(spec.src, dev ? dev->src : nullptr, r0, r1), /*prefetch_states=*/false,
                             part(spec.dst, dev ? dev->dst : nullptr, r0, r1), spanned_norm());
  }
  // Back to the batch's row order.
  ops::embedding(ctx, normed.rows(Tc, Tc + Ts), out, indices(spec.scatter, dev ? dev->scatter : nullptr));
}

void NemotronH::attention_mixer(const ops::Context& ctx, const LayerWeights& L, const AttentionView& view,
                                const ops::KvCacheView& kv, const ops::ResidualNorm* pre, const Tensor& x,
                                const Tensor& out) const {
  const ModelConfig& c = local_;
  const AttentionWeights& w = L.attention;
  const int64_t T = x.dim(0), Qh = c.num_attention_heads, KVh = c.num_key_value_heads, hd = c.head_dim;
  Tensor q = act(ctx, {T, Qh * hd});
  Tensor k = act(ctx, {T, KVh * hd}), v = act(ctx, {T, KVh * hd});
  // One op for the three projections of the same x (on CUDA at decode sizes one GEMV launch).
  const Tensor qkv_out[] = {q, k, v};
  const ops::LinearWeight* qkv_w[] = {&w.q_proj, &w.k_proj, &w.v_proj};
  input_linear(ctx, pre, x, qkv_out, qkv_w, Tensor());
  // No positional encoding of any kind (docs/model.md 4): the Mamba layers carry position.
  Tensor o = act(ctx, {T, Qh, hd});
  // An FP8 cache stores k / k_scale and v / v_scale: the checkpoint's scales when it has them, else 1 (vLLM's rule).
  ops::KvCacheView cache = kv;
  if (kv.k.dtype() == DType::kF8E4M3) {
    if (w.k_scale > 0) cache.k_scale = w.k_scale;
    if (w.v_scale > 0) cache.v_scale = w.v_scale;
  }
  // Rows of one sequence that read each other's keys: the decode kernel's own append (each row writes its k / v as
  // it attends) would race with them, so the op appends first (the same bits either way).
  ops::Context actx = ctx;
  if (view.shared_kv) actx.kernels.attention_decode_append = false;
  ops::attention(actx, o, q.reshape({T, Qh, hd}), k.reshape({T, KVh, hd}), v.reshape({T, KVh, hd}), cache,
                 view.cu_seqlens(), view.context_lens(), view.block_tables, 1.0f / std::sqrt(static_cast<float>(hd)));
  ops::linear(ctx, out, o.reshape({T, Qh * hd}), w.o_proj);
}

bool NemotronH::moe_mixer(const ops::Context& ctx, size_t layer, const LayerWeights& L, const Tensor& x,
                          const Tensor& shared_out, const Tensor& routed_out) const {
  const ModelConfig& c = local_;
  const MoeWeights& w = L.moe;
  const int64_t T = x.dim(0), k = c.num_experts_per_tok, Din = c.moe_input_dim();

  // Router (docs/model.md 6.1): fp32 logits, sigmoid, bias for selection only, top-k, normalise, scale.
  // On CUDA with 16-bit activations the gate is F32 and the op upcasts x, as transformers does
  // (F.linear(x.float(), weight.float())): expert choices are sensitive to rounded router logits. One op: at
  // decode sizes one CUDA kernel (logits GEMV + top-k), otherwise convert + GEMM + router_topk.
  Tensor ids = device::empty(ctx.device, DType::kI32, {T, k});
  Tensor weights = device::empty(ctx.device, DType::kF32, {T, k});
  ops::RouterParams rp{k, c.n_group, c.topk_group, c.norm_topk_prob, c.routed_scaling_factor};
  ops::router_gate_topk(ctx, ids, weights, x, w.gate, w.e_score_correction_bias, rp);
  dump_activation(layer, "experts", ids);
  if (tp_.enabled() && tp_.expert_parallel) {
    // Expert parallelism: the rank holds experts [rank * E_r, (rank + 1) * E_r) whole and runs only their pairs;
    // its output is its part of the sum, completed with the other row-parallel parts after the mixer.
    const int64_t mine = w.experts_up.num_experts();
    ops::local_expert_ids(ctx, ids, tp_.rank * mine, mine);
  }

  // Routed experts, in the latent space when moe_latent_size is set (docs/model.md 6.2), and the shared expert, which
  // reads the full hidden state, never the latent one. Dense: one op, moe_experts then relu2_mlp (the CPU runs exactly
  // those), on CUDA at decode sizes the shared expert inside the routed experts' GEMV launches. Quantized: the two
  // ops of ops/quant_ops.h one after the other.
  Tensor latent_in = x, latent_out = routed_out;
  if (c.moe_latent_size) {
    latent_in = act(ctx, {T, Din});
    latent_out = act(ctx, {T, Din});
    ops::linear(ctx, latent_in, x, w.fc1_latent_proj);
  }
  const MlpWeights& sh = w.shared_experts;
  if (!w.up_views.empty() && sh.up_proj.format == ops::WeightFormat::kDense &&
      sh.down_proj.format == ops::WeightFormat::kDense) {
    const ops::SharedExpert shared{shared_out, x, sh.up_proj.weight, sh.down_proj.weight};
    ops::moe_experts_shared(ctx, latent_out, latent_in, ids, weights, w.up_views, w.down_views, shared);
  } else {
    ops::moe_experts(ctx, latent_out, latent_in, ids, weights, w.experts_up, w.experts_down);
    ops::relu2_mlp(ctx, shared_out, x, sh.up_proj, sh.down_proj);
  }
  if (group_.group && c.moe_latent_size) {
    // Tensor parallelism: latent_out is this rank's part of the experts' sum, and fc2_latent_proj (replicated) may
    // quantize its input (FP8), which is not linear: the sum is completed in the latent space first, so routed_out
    // comes out whole and only the shared expert's part is left to sum.
    ops::all_reduce(ctx, latent_out, group_);
    ops::linear(ctx, routed_out, latent_out, w.fc2_latent_proj);
    ops::all_reduce(ctx, shared_out, group_);
    return false;
  }
  if (c.moe_latent_size) ops::linear(ctx, routed_out, latent_out, w.fc2_latent_proj);
  return true;
}

Tensor NemotronH::act(const ops::Context& ctx, Shape shape) const {
  return device::empty(ctx.device, act_dtype_, std::move(shape));
}

void NemotronH::set_activation_dump(std::filesystem::path dir) {
  if (!dir.empty()) {
    std::error_code ec;
    if (std::filesystem::exists(dir, ec) && !std::filesystem::is_directory(dir, ec)) {
      invalid_input("activation dump directory {}: exists and is not a directory", dir.string());
    }
    std::filesystem::create_directories(dir, ec);
    if (ec || !std::filesystem::is_directory(dir)) {
      invalid_input("activation dump directory {}: cannot be created ({})", dir.string(), ec.message());
    }
  }
  dump_dir_ = std::move(dir);
  dumped_steps_ = 0;
  dump_step_ = -1;
}

void NemotronH::dump_activation(size_t layer, const char* what, const Tensor& t) const {
  if (dump_step_ < 0) return;
  // Every stream's work done first (the step may run on a non-blocking stream), then a synchronous copy.
  device::synchronize(t.device());
  const Tensor host = t.dtype() == DType::kI32 ? device::to_host(t) : device::to_host_f32(t);
  write_npy(dump_dir_ / fmt::format("step{}_layer{}_{}.npy", dump_step_, layer, what), host);
}

Tensor NemotronH::forward(const ops::Context& ctx, const StepBatch& b, ModelState& state) const {
  Tensor logits = forward_device(ctx, b, state);
  // Host fp32 logits (a no-op on the CPU).
  return ctx.device == Device::kCpu ? logits : device::to_host_f32(logits);
}

NemotronH::AttentionView NemotronH::attention_view(const ops::Context& ctx, const StepBatch& b) {
  AttentionView v;
  const StepBatch::DeviceMeta* dm = b.device_meta;
  if (b.num_spec_seqs == 0) {  // every sequence is itself: the batch's own lists and table
    v.host_cu = &b.cu_seqlens;
    v.host_context = &b.context_lens;
    v.device_cu = dm ? dm->cu_seqlens : nullptr;
    v.device_context = dm ? dm->context_lens : nullptr;
    // On CUDA the attention reads the tables from device memory: one upload per step shared by all layers (none when
    // the step's metadata is already there).
    v.block_tables = dm                                               ? dm->block_tables
                     : ctx.device != Device::kCpu && b.num_seqs() > 0 ? device::to_device(b.block_tables, ctx.device)
                                                                      : b.block_tables;
    return v;
  }
  v.rows = attention_rows(b);
  v.shared_kv = true;
  v.device_cu = dm ? dm->spec.attn_cu_seqlens : nullptr;
  v.device_context = dm ? dm->spec.attn_context_lens : nullptr;
  if (dm) {
    v.block_tables = dm->spec.attn_block_tables;
    return v;
  }
  const int64_t max_blocks = b.block_tables.dim(1);
  Tensor tables = Tensor::zeros(DType::kI32, {static_cast<int64_t>(v.rows.table_rows.size()), max_blocks});
  for (size_t r = 0; r < v.rows.table_rows.size(); ++r) {
    const int32_t* row = b.block_tables.i32() + int64_t{v.rows.table_rows[r]} * max_blocks;
    std::copy(row, row + max_blocks, tables.i32() + static_cast<int64_t>(r) * max_blocks);
  }
  v.block_tables = ctx.device != Device::kCpu ? device::to_device(tables, ctx.device) : tables;
  return v;
}

namespace {
bool is_every_row(const StepBatch& b) {
  const int64_t R = static_cast<int64_t>(b.logit_rows.size());
  bool every_row = R == b.num_tokens();
  for (int64_t r = 0; every_row && r < R; ++r) every_row = b.logit_rows[static_cast<size_t>(r)] == r;
  return every_row;
}
}  // namespace

Tensor NemotronH::forward_device(const ops::Context& ctx, const StepBatch& b, ModelState& state) const {
  return forward_impl(ctx, b, state, nullptr);
}

Tensor NemotronH::forward_device(const ops::Context& ctx, const StepBatch& b, ModelState& state, Tensor& hidden) const {
  return forward_impl(ctx, b, state, &hidden);
}

NemotronH::Stream NemotronH::stream(const ops::Context& ctx, int64_t T, std::span<const LayerWeights> layers) const {
  const int64_t D = config_.hidden_size;
  Stream s{act(ctx, {T, D}), act(ctx, {T, D}), act(ctx, {T, D}), act(ctx, {T, D}), Tensor()};
  for (const LayerWeights& L : layers) {
    if (L.kind == LayerKind::kMoe) {
      s.routed = act(ctx, {T, D});
      break;
    }
  }
  return s;
}

bool NemotronH::run_layers(const ops::Context& ctx, const StepBatch& b, ModelState& state,
                           std::span<const LayerWeights> layers, size_t first, Stream& s, const Tensor& final_norm,
                           bool fold_final, ops::ResidualNorm& pending) const {
  const float eps = config_.layer_norm_epsilon;
  // The residual step after layer j: h = h + mixer(x) (a MoE layer's shared + routed output rounded to the
  // activation dtype first), x = the next layer's norm (or the final norm) of h. Before a Mamba or attention layer
  // it is left pending and folded into that layer's first dense op (one launch fewer at decode sizes on CUDA);
  // otherwise one fused add + norm op here.
  bool has_pending = false;
  for (size_t j = 0; j < layers.size(); ++j) {
    const LayerWeights& L = layers[j];
    const size_t i = first + j;
    const ops::ResidualNorm* pre = has_pending ? &pending : nullptr;
    bool partial = true;  // the mixer left this rank's part of its output to sum (tensor parallelism)
    switch (L.kind) {
      case LayerKind::kMamba: mamba_mixer(ctx, L, b, s.spec, state.conv[i], state.ssm[i], pre, s.x, s.mix); break;
      case LayerKind::kAttention: attention_mixer(ctx, L, s.attn, state.kv[i], pre, s.x, s.mix); break;
      case LayerKind::kMlp: ops::relu2_mlp(ctx, s.mix, s.x, L.mlp.up_proj, L.mlp.down_proj); break;
      case LayerKind::kMoe: partial = moe_mixer(ctx, i, L, s.x, s.mix, s.routed); break;
    }
    if (has_pending) std::swap(s.h, s.h_next);  // the folded step wrote the new residual to h_next
    dump_activation(i, "input", s.h);           // h is layer i's input now: the folded step has run
    const bool last = j + 1 == layers.size();
    const Tensor& next_norm = last ? final_norm : layers[j + 1].norm;
    // Tensor parallelism: every mixer ends in a row-parallel layer (o_proj, out_proj, down_proj, the experts' and
    // the shared expert's down_proj), so s.mix (+ s.routed) holds this rank's part of the sum: the sum over ranks,
    // the residual add and the next norm in one op (one fused AllReduce kernel between GPUs), never folded into
    // the next layer. A LatentMoE layer has summed both of its outputs itself (moe_mixer).
    if (group_.group && partial) {
      if (L.kind == LayerKind::kMoe) ops::add(ctx, s.mix, s.mix, s.routed);
      ops::all_reduce_add_rms_norm(ctx, s.h, s.x, s.mix, next_norm, eps, group_);
      has_pending = false;
      continue;
    }
    const bool fold_next =
        last ? fold_final : layers[j + 1].kind == LayerKind::kMamba || layers[j + 1].kind == LayerKind::kAttention;
    const Tensor no_tensor;
    const Tensor& second = L.kind == LayerKind::kMoe ? s.routed : no_tensor;
    has_pending = fold_next;
    if (fold_next) {
      pending = ops::ResidualNorm{s.h, s.h_next, s.mix, second, next_norm, eps, s.x};
    } else if (second) {
      ops::add2_rms_norm(ctx, s.h, s.x, s.mix, second, next_norm, eps);
    } else {
      ops::add_rms_norm(ctx, s.h, s.x, s.mix, next_norm, eps);
    }
  }
  return has_pending;
}

Tensor NemotronH::head_logits(const ops::Context& ctx, const StepBatch& b, const Tensor& x) const {
  // Only the requested rows go through lm_head (all of them in a decode step: no gather).
  Tensor logits = act(ctx, {static_cast<int64_t>(b.logit_rows.size()), local_.vocab_size});
  const int32_t* dev_rows = b.device_meta ? b.device_meta->logit_rows : nullptr;
  const Tensor rows = is_every_row(b) && dev_rows == nullptr
                          ? x
                          : gather_rows(ctx, x, act_dtype_, ops::Indices(b.logit_rows, dev_rows));
  ops::linear(ctx, logits, rows, w_.lm_head);
  return whole_logits(ctx, logits);
}

Tensor NemotronH::whole_logits(const ops::Context& ctx, const Tensor& local) const {
  if (!group_.group) return local;
  Tensor whole = act(ctx, {local.dim(0), config_.vocab_size});
  ops::all_gather_columns(ctx, whole, local, group_);
  return whole;
}

void NemotronH::embed(const ops::Context& ctx, const Tensor& out, const ops::Indices& ids) const {
  if (!group_.group) {
    ops::embedding(ctx, out, w_.embeddings, ids);
    return;
  }
  // The rank's rows [first, first + V / size) looked up, the others' rows zero, then summed over the ranks.
  ops::embedding_shard(ctx, out, w_.embeddings, ids, tp_.rank * local_.vocab_size, config_.vocab_size);
  ops::all_reduce(ctx, out, group_);
}

void NemotronH::set_tensor_parallel_group(dist::HostCollectives* group, dist::DeviceGroup* device) {
  if (!tp_.enabled()) {
    if (group && group->size() != 1)
      runtime_error("NemotronH: a communicator of {} ranks for a model without tensor parallelism", group->size());
    return;
  }
  if (!group || group->size() != tp_.size) {
    runtime_error("NemotronH: rank {} of {} needs a communicator of {} ranks, got {}", tp_.rank, tp_.size, tp_.size,
                  group ? group->size() : 0);
  }
  group_ = ops::TpGroup{group, tp_.rank, device};
  norm_spans_ = config_.n_groups < tp_.size;
  if (norm_spans_) {
    // Each rank's heads lie in one group of size / n_groups ranks (rank_config checked that it divides).
    const int64_t span = tp_.size / config_.n_groups;
    spanned_ = ops::SpannedNorm{group_, config_.n_groups, tp_.rank / span, span};
  }
}

Tensor NemotronH::forward_impl(const ops::Context& ctx, const StepBatch& b, ModelState& state, Tensor* hidden) const {
  b.validate();
  if (ctx.device != device_) {
    runtime_error("NemotronH::forward: the model was loaded for the {} but the context is {}",
                  device_ == Device::kCpu ? "CPU" : "GPU", ctx.device == Device::kCpu ? "the CPU" : "a GPU");
  }
  // Written only while a dump is on (a debugging session: one thread), so concurrent forwards stay read-only.
  if (!dump_dir_.empty()) dump_step_ = b.num_prefill_seqs > 0 ? dumped_steps_++ : -1;
  const StepBatch::DeviceMeta* dm = b.device_meta;

  if (tp_.enabled() && !group_.group) {
    runtime_error("NemotronH::forward: rank {} of {} has no communicator (set_tensor_parallel_group)", tp_.rank,
                  tp_.size);
  }
  Stream s = stream(ctx, b.num_tokens(), w_.layers);
  // Once for all layers of the step: the Mamba layers' verify plan and the attention layers' rows.
  s.spec = spec_plan(b);
  s.attn = attention_view(ctx, b);
  embed(ctx, s.h, ops::Indices(b.token_ids, dm ? dm->token_ids : nullptr));
  ops::rms_norm(ctx, s.x, s.h, w_.layers.empty() ? w_.norm_f : w_.layers[0].norm, config_.layer_norm_epsilon);
  // The last step (norm_f) folds into the lm_head when every row's logits are wanted (a decode step) and nobody
  // needs norm_f's output itself.
  ops::ResidualNorm pending;
  const bool folded =
      run_layers(ctx, b, state, w_.layers, 0, s, w_.norm_f, is_every_row(b) && hidden == nullptr, pending);
  if (folded) {
    Tensor logits = act(ctx, {b.num_tokens(), local_.vocab_size});
    const ops::LinearWeight* head[] = {&w_.lm_head};
    ops::residual_norm_linear(ctx, pending, {&logits, 1}, head);
    return whole_logits(ctx, logits);
  }
  if (hidden) *hidden = s.x;  // norm_f(h)
  return head_logits(ctx, b, s.x);
}

Tensor NemotronH::mtp_forward_device(const ops::Context& ctx, const StepBatch& b, const Tensor& hidden,
                                     ModelState& state, int block, Tensor* mtp_hidden) const {
  b.validate();
  if (ctx.device != device_) runtime_error("NemotronH::mtp_forward: the context's device is not the model's");
  if (block < 0 || block >= mtp_blocks()) {
    runtime_error("NemotronH::mtp_forward: block {} of a head with {} block(s)", block, mtp_blocks());
  }
  const int64_t T = b.num_tokens(), D = config_.hidden_size;
  const float eps = config_.layer_norm_epsilon;
  if (hidden.shape() != Shape{T, D} || hidden.dtype() != act_dtype_ || hidden.device() != ctx.device) {
    runtime_error("NemotronH::mtp_forward: hidden is {}, expected [{}, {}] of the step's rows in the activation dtype",
                  hidden.describe(), T, D);
  }
  const MtpBlockWeights& m = w_.mtp[static_cast<size_t>(block)];
  const size_t first = w_.layers.size() + static_cast<size_t>(block) * m.layers.size();
  if (state.kv.size() < first + m.layers.size()) {
    runtime_error("NemotronH::mtp_forward: the state has no MTP caches (a StateCache made with CacheSizes::mtp)");
  }
  const StepBatch::DeviceMeta* dm = b.device_meta;

  // x0 = eh_proj(concat[enorm(e_{t+1}), hnorm(h_t)]), the embedding first.
  Tensor e = act(ctx, {T, D}), en = act(ctx, {T, D}), hn = act(ctx, {T, D}), eh = act(ctx, {T, 2 * D});
  if (tp_.enabled() && !group_.group) runtime_error("NemotronH::mtp_forward: rank {} has no communicator", tp_.rank);
  embed(ctx, e, ops::Indices(b.token_ids, dm ? dm->token_ids : nullptr));
  ops::rms_norm(ctx, en, e, m.enorm, eps);
  ops::rms_norm(ctx, hn, hidden, m.hnorm, eps);
  ops::write_columns(ctx, eh, en, 0);
  ops::write_columns(ctx, eh, hn, D);
  Stream s = stream(ctx, T, m.layers);
  s.attn = attention_view(ctx, b);  // the head has no Mamba layers: no spec plan
  ops::linear(ctx, s.h, eh, m.eh_proj);
  ops::rms_norm(ctx, s.x, s.h, m.layers[0].norm, eps);
  // Its sublayers as the backbone's layers, then final_layernorm (kept: it is the next draft depth's h).
  ops::ResidualNorm pending;
  run_layers(ctx, b, state, m.layers, first, s, m.final_layernorm, /*fold_final=*/false, pending);
  if (mtp_hidden) *mtp_hidden = s.x;
  return head_logits(ctx, b, s.x);
}

}  // namespace chimera
