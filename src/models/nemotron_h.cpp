#include "models/nemotron_h.h"

#include <cmath>
#include <cstring>
#include <set>

#include "core/error.h"

namespace chimera {
namespace {

// The name table: canonical names (no "backbone." / "model." prefix, "embeddings" spelled with an s) mapped
// back to the checkpoint's own names, with a record of what the model consumed.
class WeightTable {
 public:
  explicit WeightTable(const Checkpoint& ckpt) : ckpt_(ckpt) {
    for (const std::string& name : ckpt.names()) {
      if (name.rfind("mtp.", 0) == 0) continue;  // kept separately for the MTP head
      std::string c = name;
      for (const char* prefix : {"backbone.", "model."}) {
        if (c.rfind(prefix, 0) == 0) {
          c = c.substr(std::string(prefix).size());
          break;
        }
      }
      if (c == "embedding.weight") c = "embeddings.weight";  // HF <= 5.15 save_pretrained spelling
      if (!canonical_.emplace(c, name).second) {
        invalid_input("{}: tensors '{}' and '{}' name the same weight", ckpt.dir().string(), canonical_[c], name);
      }
    }
  }

  bool has(const std::string& c) const { return canonical_.count(c) != 0; }

  // The tensor for canonical name `c`, checked against `shape`; a missing one is recorded (reported at the end).
  Tensor take(const std::string& c, const Shape& shape) {
    auto it = canonical_.find(c);
    if (it == canonical_.end()) {
      missing_.push_back(c);
      return Tensor();
    }
    consumed_.insert(c);
    const TensorInfo& info = ckpt_.info(it->second);
    if (info.shape != shape) {
      invalid_input("{}: tensor '{}' has shape {}, expected {} from config.json", info.file.string(), it->second,
                    shape_str(info.shape), shape_str(shape));
    }
    if (!dtype_is_float(info.dtype)) {
      invalid_input("{}: tensor '{}' has dtype {}, expected a float type", info.file.string(), it->second,
                    dtype_name(info.dtype));
    }
    return ckpt_.tensor(it->second);
  }

  // Small parameter vectors the kernels read as fp32 (A_log, D, dt_bias, correction bias).
  Tensor take_f32(const std::string& c, const Shape& shape) {
    Tensor t = take(c, shape);
    return t ? t.to_f32() : t;
  }

  void finish() const {
    if (!missing_.empty()) {
      invalid_input("{}: checkpoint is missing {} tensor(s) the config needs: {}", ckpt_.dir().string(),
                    missing_.size(), name_list(missing_));
    }
    std::vector<std::string> extra;
    for (const auto& [c, name] : canonical_) {
      if (!consumed_.count(c)) extra.push_back(name);
    }
    if (!extra.empty()) {
      invalid_input("{}: checkpoint has {} unexpected tensor(s) for this config: {}", ckpt_.dir().string(),
                    extra.size(), name_list(extra));
    }
  }

 private:
  // "a, b, c" for the first dozen names, then how many there are in all.
  static std::string name_list(const std::vector<std::string>& names) {
    std::string list;
    for (size_t i = 0; i < names.size() && i < 12; ++i) list += (i ? ", " : "") + names[i];
    if (names.size() > 12) list += fmt::format(", ... ({} in all)", names.size());
    return list;
  }

  const Checkpoint& ckpt_;
  std::map<std::string, std::string> canonical_;
  std::set<std::string> consumed_;
  std::vector<std::string> missing_;
};

int64_t numel_of(const Tensor& t) { return t ? t.numel() : 0; }

}  // namespace

NemotronH NemotronH::load(const ModelConfig& config, const Checkpoint& checkpoint) {
  const ModelConfig& c = config;
  if (c.mlp_bias) invalid_input("config.json: mlp_bias=true is not supported (no released checkpoint uses it)");
  if (c.attention_bias) invalid_input("config.json: attention_bias=true is not supported (HF ignores it too)");

  NemotronH m;
  m.config_ = config;
  WeightTable w(checkpoint);
  const int64_t D = c.hidden_size, V = c.vocab_size;
  m.embeddings_ = w.take("embeddings.weight", {V, D});
  m.norm_f_ = w.take("norm_f.weight", {D});
  m.lm_head_ = w.take("lm_head.weight", {V, D});

  for (size_t i = 0; i < c.layers.size(); ++i) {
    const std::string p = fmt::format("layers.{}.", i);
    const std::string mx = p + "mixer.";
    LayerWeights L;
    L.kind = c.layers[i];
    L.norm = w.take(p + "norm.weight", {D});
    switch (L.kind) {
      case LayerKind::kMamba: {
        const int64_t H = c.mamba_num_heads, Di = c.mamba_inner(), Cd = c.conv_dim(), K = c.conv_kernel;
        MambaWeights& mw = L.mamba;
        mw.in_proj = w.take(mx + "in_proj.weight", {c.in_proj_dim(), D});
        if (c.use_bias) mw.in_proj_bias = w.take(mx + "in_proj.bias", {c.in_proj_dim()});
        mw.conv1d_weight = w.take(mx + "conv1d.weight", {Cd, 1, K});
        if (mw.conv1d_weight) mw.conv1d_weight = mw.conv1d_weight.reshape({Cd, K});
        if (c.use_conv_bias) mw.conv1d_bias = w.take(mx + "conv1d.bias", {Cd});
        mw.ssm.A_log = w.take_f32(mx + "A_log", {H});
        mw.ssm.D = w.take_f32(mx + "D", {H});
        mw.ssm.dt_bias = w.take_f32(mx + "dt_bias", {H});
        mw.ssm.dt_min = c.time_step_limit_min;
        mw.ssm.dt_max = c.time_step_limit_max;
        mw.norm = w.take(mx + "norm.weight", {Di});
        mw.out_proj = w.take(mx + "out_proj.weight", {D, Di});
        if (c.use_bias) mw.out_proj_bias = w.take(mx + "out_proj.bias", {D});
        break;
      }
      case LayerKind::kAttention: {
        const int64_t q = c.num_attention_heads * c.head_dim, kv = c.num_key_value_heads * c.head_dim;
        L.attention.q_proj = w.take(mx + "q_proj.weight", {q, D});
        L.attention.k_proj = w.take(mx + "k_proj.weight", {kv, D});
        L.attention.v_proj = w.take(mx + "v_proj.weight", {kv, D});
        L.attention.o_proj = w.take(mx + "o_proj.weight", {D, q});
        break;
      }
      case LayerKind::kMlp:
        L.mlp.up_proj = w.take(mx + "up_proj.weight", {c.intermediate_size, D});
        L.mlp.down_proj = w.take(mx + "down_proj.weight", {D, c.intermediate_size});
        break;
      case LayerKind::kMoe: {
        const int64_t E = c.n_routed_experts, I = c.moe_intermediate_size, Din = c.moe_input_dim();
        MoeWeights& moe = L.moe;
        moe.gate = w.take(mx + "gate.weight", {E, D});
        moe.e_score_correction_bias = w.take_f32(mx + "gate.e_score_correction_bias", {E});
        // transformers' in-memory form fuses the experts: experts.up_proj [E, I, Din], down_proj [E, Din, I].
        std::string fused_up = mx + "experts.up_proj", fused_down = mx + "experts.down_proj";
        if (w.has(fused_up + ".weight")) fused_up += ".weight";
        if (w.has(fused_down + ".weight")) fused_down += ".weight";
        if (w.has(fused_up) || w.has(fused_down)) {
          Tensor up = w.take(fused_up, {E, I, Din}), down = w.take(fused_down, {E, Din, I});
          for (int64_t e = 0; up && down && e < E; ++e) {
            moe.experts_up.push_back(up.select(e));
            moe.experts_down.push_back(down.select(e));
          }
        } else {
          for (int64_t e = 0; e < E; ++e) {
            moe.experts_up.push_back(w.take(fmt::format("{}experts.{}.up_proj.weight", mx, e), {I, Din}));
            moe.experts_down.push_back(w.take(fmt::format("{}experts.{}.down_proj.weight", mx, e), {Din, I}));
          }
        }
        const int64_t Ish = c.moe_shared_expert_intermediate_size;
        moe.shared_experts.up_proj = w.take(mx + "shared_experts.up_proj.weight", {Ish, D});
        moe.shared_experts.down_proj = w.take(mx + "shared_experts.down_proj.weight", {D, Ish});
        if (c.moe_latent_size) {
          moe.fc1_latent_proj = w.take(mx + "fc1_latent_proj.weight", {*c.moe_latent_size, D});
          moe.fc2_latent_proj = w.take(mx + "fc2_latent_proj.weight", {D, *c.moe_latent_size});
        }
        break;
      }
    }
    m.layers_.push_back(std::move(L));
  }
  w.finish();
  for (const std::string& name : checkpoint.names()) {
    if (name.rfind("mtp.", 0) == 0) m.mtp_.emplace(name, checkpoint.tensor(name));
  }
  return m;
}

std::map<std::string, int64_t> NemotronH::parameter_counts() const {
  std::map<std::string, int64_t> n;
  n["embeddings"] = numel_of(embeddings_);
  n["lm_head"] = numel_of(lm_head_);
  n["norm_f"] = numel_of(norm_f_);
  for (const LayerWeights& L : layers_) {
    int64_t& k = n[layer_kind_name(L.kind)];
    k += numel_of(L.norm);
    const MambaWeights& m = L.mamba;
    for (const Tensor* t : {&m.in_proj, &m.in_proj_bias, &m.conv1d_weight, &m.conv1d_bias, &m.ssm.A_log, &m.ssm.D,
                            &m.ssm.dt_bias, &m.norm, &m.out_proj, &m.out_proj_bias, &L.attention.q_proj,
                            &L.attention.k_proj, &L.attention.v_proj, &L.attention.o_proj, &L.mlp.up_proj,
                            &L.mlp.down_proj, &L.moe.gate, &L.moe.e_score_correction_bias,
                            &L.moe.shared_experts.up_proj, &L.moe.shared_experts.down_proj, &L.moe.fc1_latent_proj,
                            &L.moe.fc2_latent_proj}) {
      k += numel_of(*t);
    }
    for (const Tensor& t : L.moe.experts_up) k += numel_of(t);
    for (const Tensor& t : L.moe.experts_down) k += numel_of(t);
  }
  if (!mtp_.empty()) {
    int64_t& k = n["mtp"];
    for (const auto& [name, t] : mtp_) k += numel_of(t);
  }
  return n;
}

// ---- forward ---------------------------------------------------------------------------------------

void NemotronH::mamba_mixer(const ops::Context& ctx, const LayerWeights& L, const StepBatch& b,
                            const Tensor& conv_state, const Tensor& ssm_state, const Tensor& x,
                            const Tensor& out) const {
  const ModelConfig& c = config_;
  const MambaWeights& w = L.mamba;
  const int64_t T = b.num_tokens(), H = c.mamba_num_heads, P = c.mamba_head_dim, G = c.n_groups;
  const int64_t N = c.ssm_state_size, Di = c.mamba_inner(), Cd = c.conv_dim();
  const int64_t Tp = b.num_prefill_tokens();
  const size_t np = static_cast<size_t>(b.num_prefill_seqs);
  const std::span<const int32_t> cu(b.cu_seqlens), slots(b.state_slots);

  // in_proj rows: [ z : Di | xBC : Cd | dt : H ]  (model-spec 3.2)
  Tensor zxbcdt = Tensor::empty(DType::kF32, {T, c.in_proj_dim()});
  ops::linear(ctx, zxbcdt, x, w.in_proj, w.in_proj_bias);
  Tensor z = Tensor::empty(DType::kF32, {T, Di}), xbc = Tensor::empty(DType::kF32, {T, Cd});
  Tensor dt = Tensor::empty(DType::kF32, {T, H});
  ops::copy_columns(ctx, z, zxbcdt, 0);
  ops::copy_columns(ctx, xbc, zxbcdt, Di);
  ops::copy_columns(ctx, dt, zxbcdt, Di + Cd);

  // Depthwise causal conv + SiLU: varlen prefill for the first sequences, one-step update for the rest.
  Tensor xbc_act = Tensor::empty(DType::kF32, {T, Cd});
  if (np > 0) {
    ops::causal_conv1d(ctx, xbc_act.rows(0, Tp), xbc.rows(0, Tp), w.conv1d_weight, w.conv1d_bias, conv_state,
                       cu.first(np + 1), slots.first(np), /*silu=*/true);
  }
  if (Tp < T) {
    ops::causal_conv1d_update(ctx, xbc_act.rows(Tp, T), xbc.rows(Tp, T), w.conv1d_weight, w.conv1d_bias,
                              conv_state, slots.subspan(np), /*silu=*/true);
  }
  Tensor xs = Tensor::empty(DType::kF32, {T, Di}), B = Tensor::empty(DType::kF32, {T, G * N});
  Tensor C = Tensor::empty(DType::kF32, {T, G * N});
  ops::copy_columns(ctx, xs, xbc_act, 0);
  ops::copy_columns(ctx, B, xbc_act, Di);
  ops::copy_columns(ctx, C, xbc_act, Di + G * N);
  xs = xs.reshape({T, H, P});
  B = B.reshape({T, G, N});
  C = C.reshape({T, G, N});

  // Selective SSM: chunked SSD scan for prefill, selective state update for decode.
  Tensor y = Tensor::empty(DType::kF32, {T, H, P});
  if (np > 0) {
    ops::ssd_chunk_scan(ctx, y.rows(0, Tp), xs.rows(0, Tp), dt.rows(0, Tp), B.rows(0, Tp), C.rows(0, Tp), w.ssm,
                        ssm_state, cu.first(np + 1), slots.first(np), c.chunk_size);
  }
  if (Tp < T) {
    ops::selective_state_update(ctx, y.rows(Tp, T), xs.rows(Tp, T), dt.rows(Tp, T), B.rows(Tp, T), C.rows(Tp, T),
                                w.ssm, ssm_state, slots.subspan(np));
  }

  // Gate first, then per-group RMSNorm (norm_before_gate = false), then out_proj.
  Tensor normed = Tensor::empty(DType::kF32, {T, Di});
  ops::gated_rms_norm(ctx, normed, y.reshape({T, Di}), z, w.norm, G, c.layer_norm_epsilon);
  ops::linear(ctx, out, normed, w.out_proj, w.out_proj_bias);
}

void NemotronH::attention_mixer(const ops::Context& ctx, const LayerWeights& L, const StepBatch& b,
                                const ops::KvCacheView& kv, const Tensor& x, const Tensor& out) const {
  const ModelConfig& c = config_;
  const AttentionWeights& w = L.attention;
  const int64_t T = b.num_tokens(), Qh = c.num_attention_heads, KVh = c.num_key_value_heads, hd = c.head_dim;
  Tensor q = Tensor::empty(DType::kF32, {T, Qh * hd});
  Tensor k = Tensor::empty(DType::kF32, {T, KVh * hd}), v = Tensor::empty(DType::kF32, {T, KVh * hd});
  ops::linear(ctx, q, x, w.q_proj);
  ops::linear(ctx, k, x, w.k_proj);
  ops::linear(ctx, v, x, w.v_proj);
  // No positional encoding of any kind (model-spec 4): the Mamba layers carry position.
  Tensor o = Tensor::empty(DType::kF32, {T, Qh, hd});
  ops::attention(ctx, o, q.reshape({T, Qh, hd}), k.reshape({T, KVh, hd}), v.reshape({T, KVh, hd}), kv,
                 b.cu_seqlens, b.context_lens, b.block_tables, 1.0f / std::sqrt(static_cast<float>(hd)));
  ops::linear(ctx, out, o.reshape({T, Qh * hd}), w.o_proj);
}

void NemotronH::moe_mixer(const ops::Context& ctx, const LayerWeights& L, const Tensor& x, const Tensor& out) const {
  const ModelConfig& c = config_;
  const MoeWeights& w = L.moe;
  const int64_t T = x.dim(0), E = c.n_routed_experts, k = c.num_experts_per_tok, Din = c.moe_input_dim();

  // Router (model-spec 6.1): fp32 logits, sigmoid, bias for selection only, top-k, normalise, scale.
  Tensor logits = Tensor::empty(DType::kF32, {T, E});
  ops::linear(ctx, logits, x, w.gate);
  Tensor ids = Tensor::empty(DType::kI32, {T, k}), weights = Tensor::empty(DType::kF32, {T, k});
  ops::RouterParams rp{k, c.n_group, c.topk_group, c.norm_topk_prob, c.routed_scaling_factor};
  ops::router_topk(ctx, ids, weights, logits, w.e_score_correction_bias, rp);

  // Routed experts, in the latent space when moe_latent_size is set (model-spec 6.2).
  Tensor routed_in = x;
  if (c.moe_latent_size) {
    routed_in = Tensor::empty(DType::kF32, {T, Din});
    ops::linear(ctx, routed_in, x, w.fc1_latent_proj);
  }
  Tensor routed = Tensor::empty(DType::kF32, {T, Din});
  ops::moe_experts(ctx, routed, routed_in, ids, weights, w.experts_up, w.experts_down);
  if (c.moe_latent_size) {
    Tensor up = Tensor::empty(DType::kF32, {T, c.hidden_size});
    ops::linear(ctx, up, routed, w.fc2_latent_proj);
    routed = up;
  }
  // The shared expert reads the full hidden state, never the latent one.
  ops::relu2_mlp(ctx, out, x, w.shared_experts.up_proj, w.shared_experts.down_proj);
  ops::add(ctx, out, routed, out);
}

Tensor NemotronH::forward(const ops::Context& ctx, const StepBatch& b, ModelState& state) const {
  b.validate();
  const ModelConfig& c = config_;
  const int64_t T = b.num_tokens(), D = c.hidden_size;
  const float eps = c.layer_norm_epsilon;

  Tensor h = Tensor::empty(DType::kF32, {T, D});  // the residual stream
  ops::embedding(ctx, h, embeddings_, b.token_ids);
  Tensor x = Tensor::empty(DType::kF32, {T, D});    // normed input of the current mixer
  Tensor mix = Tensor::empty(DType::kF32, {T, D});  // mixer output
  ops::rms_norm(ctx, x, h, layers_.empty() ? norm_f_ : layers_[0].norm, eps);

  for (size_t i = 0; i < layers_.size(); ++i) {
    const LayerWeights& L = layers_[i];
    switch (L.kind) {
      case LayerKind::kMamba: mamba_mixer(ctx, L, b, state.conv[i], state.ssm[i], x, mix); break;
      case LayerKind::kAttention: attention_mixer(ctx, L, b, state.kv[i], x, mix); break;
      case LayerKind::kMlp: ops::relu2_mlp(ctx, mix, x, L.mlp.up_proj, L.mlp.down_proj); break;
      case LayerKind::kMoe: moe_mixer(ctx, L, x, mix); break;
    }
    // h = h + mixer(x); x = next layer's norm (or norm_f) of h: one fused op.
    const Tensor& next_norm = i + 1 < layers_.size() ? layers_[i + 1].norm : norm_f_;
    ops::add_rms_norm(ctx, h, x, mix, next_norm, eps);
  }

  // x now holds norm_f(h). Only the requested rows go through lm_head.
  const int64_t R = static_cast<int64_t>(b.logit_rows.size());
  Tensor rows = Tensor::empty(DType::kF32, {R, D});
  for (int64_t r = 0; r < R; ++r) {
    std::memcpy(rows.select(r).data(), x.select(b.logit_rows[static_cast<size_t>(r)]).data(),
                static_cast<size_t>(D) * 4);
  }
  Tensor logits = Tensor::empty(DType::kF32, {R, c.vocab_size});
  ops::linear(ctx, logits, rows, lm_head_);
  return logits;
}

}  // namespace chimera
