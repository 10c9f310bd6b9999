#include "models/nemotron_h.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <initializer_list>
#include <numeric>
#include <optional>
#include <set>
#include <utility>

#include "backends/device_api.h"
#include "core/counter_rng.h"
#include "core/error.h"
#include "core/parallel.h"
#include "io/npy.h"

namespace chimera {
namespace {

// Synthetic weights (NemotronH::synthetic): a deterministic uniform draw per tensor, keyed by (seed,
// canonical name) so a tensor's values do not depend on load order or on --num-layers. Uniform rather than
// normal because it is cheap and only the scale matters: U(-a, a) has std a / sqrt(3).
uint64_t name_hash(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a
  for (const unsigned char ch : s) h = (h ^ ch) * 0x100000001b3ull;
  return h;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Fills `t` (host, float dtype) with f(u) for u uniform in [0, 1), one counter per element, in parallel.
template <typename F>
void fill_synthetic(const Tensor& t, uint64_t key, F f) {
  const int64_t n = t.numel();
  const size_t esize = dtype_size(t.dtype());
  parallel_for(n, 1 << 16, [&](int64_t begin, int64_t end) {
    float buf[4096];
    for (int64_t i = begin; i < end; i += 4096) {
      const int64_t m = std::min<int64_t>(4096, end - i);
      for (int64_t j = 0; j < m; ++j) buf[j] = f(counter_uniform(key, static_cast<uint64_t>(i + j)));
      convert_from_f32(buf, t.dtype(), static_cast<char*>(t.data()) + static_cast<size_t>(i) * esize,
                       static_cast<size_t>(m));
    }
  });
}

// One synthetic tensor for canonical name `c` with the init that keeps activations O(1):
//   matrices U with std 1/sqrt(fan_in) (fan_in = last dim: K for the conv), embeddings std 1, norms 1 +- 0.05,
//   A_log = log U(1, 16), D = 1 +- 0.1, dt_bias = softplus^-1(dt) with dt log-uniform in
//   [time_step_min, time_step_max] floored at time_step_floor (mamba_ssm's init), biases +- 0.02.
Tensor synthetic_tensor(const ModelConfig& cfg, uint64_t seed, const std::string& c, const Shape& shape,
                        DType dtype) {
  Tensor t = Tensor::empty(dtype, shape);
  const uint64_t key = splitmix64(seed) ^ name_hash(c);
  auto uniform = [](float lo, float hi) {
    return [lo, hi](double u) { return lo + (hi - lo) * static_cast<float>(u); };
  };
  if (ends_with(c, "A_log")) {
    fill_synthetic(t, key, [](double u) { return static_cast<float>(std::log(1.0 + 15.0 * u)); });
  } else if (ends_with(c, ".D")) {
    fill_synthetic(t, key, uniform(0.9f, 1.1f));
  } else if (ends_with(c, "dt_bias")) {
    const double lo = std::log(cfg.time_step_min), hi = std::log(cfg.time_step_max);
    const double floor = cfg.time_step_floor;
    fill_synthetic(t, key, [lo, hi, floor](double u) {
      const double dt = std::max(std::exp(lo + (hi - lo) * u), floor);
      return static_cast<float>(dt + std::log(-std::expm1(-dt)));
    });
  } else if (ends_with(c, "norm.weight") || ends_with(c, "norm_f.weight")) {
    fill_synthetic(t, key, uniform(0.95f, 1.05f));
  } else if (ends_with(c, "bias")) {  // conv1d.bias, in/out_proj.bias, e_score_correction_bias
    fill_synthetic(t, key, uniform(-0.02f, 0.02f));
  } else {
    const double std = c == "embeddings.weight" ? 1.0 : 1.0 / std::sqrt(static_cast<double>(shape.back()));
    const auto a = static_cast<float>(std * std::sqrt(3.0));
    fill_synthetic(t, key, uniform(-a, a));
  }
  return t;
}

}  // namespace

// The name table: canonical names (no "backbone." / "model." prefix, "embeddings" spelled with an s) mapped
// back to the checkpoint's own names, with a record of what the model consumed. Without a checkpoint it is
// the synthetic weight source: take() generates the tensor the loader asks for, so the names and shapes of
// synthetic models are the loader's own (nothing duplicated), and one tensor is made at a time.
class WeightTable {
 public:
  explicit WeightTable(const Checkpoint& ckpt) : ckpt_(&ckpt) {
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
  // Synthetic: weights in `dtype` (F32 for take_f32), seeded.
  WeightTable(const ModelConfig& config, DType dtype, uint64_t seed) : config_(&config), dtype_(dtype), seed_(seed) {}

  bool has(const std::string& c) const { return canonical_.count(c) != 0; }
  bool synthetic() const { return ckpt_ == nullptr; }

  // The tensor for canonical name `c`, checked against `shape`; a missing one is recorded (reported at the end).
  Tensor take(const std::string& c, const Shape& shape) { return take_as(c, shape, dtype_); }

  // Small parameter vectors the kernels read as fp32 (A_log, D, dt_bias, correction bias).
  Tensor take_f32(const std::string& c, const Shape& shape) {
    Tensor t = take_as(c, shape, DType::kF32);
    return t ? t.to_f32() : t;
  }

  void finish() const {
    if (!ckpt_) return;
    if (!missing_.empty()) {
      invalid_input("{}: checkpoint is missing {} tensor(s) the config needs: {}", ckpt_->dir().string(),
                    missing_.size(), name_list(missing_));
    }
    std::vector<std::string> extra;
    for (const auto& [c, name] : canonical_) {
      if (!consumed_.count(c)) extra.push_back(name);
    }
    if (!extra.empty()) {
      invalid_input("{}: checkpoint has {} unexpected tensor(s) for this config: {}", ckpt_->dir().string(),
                    extra.size(), name_list(extra));
    }
  }

 private:
  Tensor take_as(const std::string& c, const Shape& shape, DType synthetic_dtype) {
    if (!ckpt_) return synthetic_tensor(*config_, seed_, c, shape, synthetic_dtype);
    auto it = canonical_.find(c);
    if (it == canonical_.end()) {
      missing_.push_back(c);
      return Tensor();
    }
    consumed_.insert(c);
    const TensorInfo& info = ckpt_->info(it->second);
    if (info.shape != shape) {
      invalid_input("{}: tensor '{}' has shape {}, expected {} from config.json", info.file.string(), it->second,
                    shape_str(info.shape), shape_str(shape));
    }
    if (!dtype_is_float(info.dtype)) {
      invalid_input("{}: tensor '{}' has dtype {}, expected a float type", info.file.string(), it->second,
                    dtype_name(info.dtype));
    }
    return ckpt_->tensor(it->second);
  }

  // "a, b, c" for the first dozen names, then how many there are in all.
  static std::string name_list(const std::vector<std::string>& names) {
    std::string list;
    for (size_t i = 0; i < names.size() && i < 12; ++i) list += (i ? ", " : "") + names[i];
    if (names.size() > 12) list += fmt::format(", ... ({} in all)", names.size());
    return list;
  }

  const Checkpoint* ckpt_ = nullptr;
  const ModelConfig* config_ = nullptr;
  DType dtype_ = DType::kF32;
  uint64_t seed_ = 0;
  std::map<std::string, std::string> canonical_;
  std::set<std::string> consumed_;
  std::vector<std::string> missing_;
};

namespace {

int64_t numel_of(const Tensor& t) { return t ? t.numel() : 0; }

// Rows `rows` of a [T, D] activation as a new [rows.size(), D] tensor of `dtype` on ctx.device: ops::embedding
// is exactly a row gather with a dtype conversion, on every backend (no host loop touches device memory).
Tensor gather_rows(const ops::Context& ctx, const Tensor& in, DType dtype, std::span<const int32_t> rows) {
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

// Uploads host weights to the GPU once, converting them on the way; counts bytes for the progress line.
class Uploader {
 public:
  Uploader(DType dtype, size_t num_layers)
      : dtype_(dtype), num_layers_(num_layers), show_(isatty(fileno(stderr)) != 0) {}

  // A weight in the activation dtype (linear needs it; norms and conv accept it).
  void operator()(Tensor& t) { put(t, dtype_); }
  // Parameters the kernels read in fp32 (A_log, D, dt_bias, correction bias, router gate).
  void f32(Tensor& t) { put(t, DType::kF32); }
  // fp32 storage holding model-dtype values: A_log, D, dt_bias and the router gate. transformers loads them in the
  // model dtype (only e_score_correction_bias is kept in fp32, docs/model.md 8.5 / 8.6) and upcasts them in the
  // forward, so a 16-bit model rounds an fp32 checkpoint's values once here (a no-op for 16-bit checkpoints).
  void f32_in_model_dtype(Tensor& t) {
    if (t && dtype_ != DType::kF32 && t.dtype() != dtype_) t = device::to_device(t, Device::kCpu, dtype_);
    put(t, DType::kF32);
  }

  // E experts of one shape -> one device buffer [E, rows, cols], the experts become views of it (the grouped
  // expert GEMM reads one pointer per expert; one allocation keeps them together). Copied expert by expert so
  // the host never holds a converted copy of the whole layer.
  void experts(std::vector<Tensor>& ts) {
    if (ts.empty()) return;
    Shape shape = ts[0].shape();
    shape.insert(shape.begin(), static_cast<int64_t>(ts.size()));
    const Tensor fused = device::empty(Device::kCuda, dtype_, shape);
    for (size_t e = 0; e < ts.size(); ++e) {
      const Tensor dst = fused.select(static_cast<int64_t>(e));
      device::copy(dst, ts[e].dtype() == dtype_ ? ts[e] : device::to_device(ts[e], Device::kCpu, dtype_));
      ts[e] = dst;
    }
    bytes_ += fused.nbytes();
  }

  void layer_done(size_t i) {
    if (show_) {
      fmt::print(stderr, "\r[chimera] uploading weights to the GPU ({}): layer {}/{}, {:.2f} GiB", dtype_name(dtype_),
                 i + 1, num_layers_, static_cast<double>(bytes_) / (1u << 30));
      std::fflush(stderr);
    }
  }
  void finish() const {
    if (show_) fmt::print(stderr, "\n");
  }

 private:
  void put(Tensor& t, DType dtype) {
    if (!t) return;
    t = device::to_device(t, Device::kCuda, dtype);
    bytes_ += t.nbytes();
  }

  DType dtype_;
  size_t num_layers_;
  bool show_;
  size_t bytes_ = 0;
};

}  // namespace

namespace {

void upload_layer(Uploader& up, LayerWeights& L) {
  up(L.norm);
  MambaWeights& m = L.mamba;
  for (Tensor* t : {&m.in_proj, &m.in_proj_bias, &m.conv1d_weight, &m.conv1d_bias, &m.norm, &m.out_proj,
                    &m.out_proj_bias, &L.attention.q_proj, &L.attention.k_proj, &L.attention.v_proj,
                    &L.attention.o_proj, &L.mlp.up_proj, &L.mlp.down_proj, &L.moe.shared_experts.up_proj,
                    &L.moe.shared_experts.down_proj, &L.moe.fc1_latent_proj, &L.moe.fc2_latent_proj}) {
    up(*t);
  }
  for (Tensor* t : {&m.ssm.A_log, &m.ssm.D, &m.ssm.dt_bias, &L.moe.gate}) up.f32_in_model_dtype(*t);
  up.f32(L.moe.e_score_correction_bias);
  up.experts(L.moe.experts_up);
  up.experts(L.moe.experts_down);
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
  WeightTable w(checkpoint);
  NemotronH m = bind(config, w, options);
  for (const std::string& name : checkpoint.names()) {
    if (name.rfind("mtp.", 0) == 0) m.mtp_.emplace(name, checkpoint.tensor(name));
  }
  return m;
}

NemotronH NemotronH::synthetic(const ModelConfig& config, const ModelOptions& options, uint64_t seed) {
  check_options(config, options);
  if (!dtype_is_float(options.dtype)) {
    invalid_input("synthetic weights need a float dtype, got {}", dtype_name(options.dtype));
  }
  WeightTable w(config, options.dtype, seed);
  return bind(config, w, options);
}

// Binds every weight through the name table, layer by layer. On CUDA a synthetic model uploads each layer as
// soon as it is made (the host never holds more than one layer); a checkpoint's weights (mmap views) are
// uploaded after the name table has checked that nothing is missing or unexpected.
NemotronH NemotronH::bind(const ModelConfig& config, WeightTable& w, const ModelOptions& options) {
  const ModelConfig& c = config;
  NemotronH m;
  m.config_ = config;
  m.device_ = options.device;
  m.act_dtype_ = options.device == Device::kCpu ? DType::kF32 : options.dtype;
  std::optional<Uploader> uploader;
  if (m.device_ == Device::kCuda) uploader.emplace(m.act_dtype_, c.layers.size());
  const bool per_layer = uploader && w.synthetic();
  const int64_t D = c.hidden_size, V = c.vocab_size;
  m.embeddings_ = w.take("embeddings.weight", {V, D});
  m.norm_f_ = w.take("norm_f.weight", {D});
  m.lm_head_ = w.take("lm_head.weight", {V, D});
  auto upload_top = [&] {
    (*uploader)(m.embeddings_);
    (*uploader)(m.norm_f_);
    (*uploader)(m.lm_head_);
  };
  if (per_layer) upload_top();
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
        // The F16 state's stochastic rounding draws differ per layer (ops.h SsmParams::state_seed).
        mw.ssm.state_seed = splitmix64(0x4d616d6261535352ull ^ static_cast<uint64_t>(i));
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
    if (per_layer) {
      upload_layer(*uploader, L);
      uploader->layer_done(i);
    }
    m.layers_.push_back(std::move(L));
  }
  w.finish();
  if (uploader && !per_layer) {
    upload_top();
    for (size_t i = 0; i < m.layers_.size(); ++i) {
      upload_layer(*uploader, m.layers_[i]);
      uploader->layer_done(i);
    }
  }
  if (uploader) uploader->finish();
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

namespace {
// A mixer's first dense op on its normed input x: with `pre`, the residual step producing x folded into it.
void input_linear(const ops::Context& ctx, const ops::ResidualNorm* pre, const Tensor& x, std::span<const Tensor> outs,
                  std::span<const Tensor> weights, const Tensor& bias) {
  if (pre != nullptr) {
    ops::residual_norm_linear(ctx, *pre, outs, weights, bias);
  } else if (weights.size() == 1) {
    ops::linear(ctx, outs[0], x, weights[0], bias);
  } else {
    ops::linear_multi(ctx, outs, x, weights);
  }
}
}  // namespace

void NemotronH::mamba_mixer(const ops::Context& ctx, const LayerWeights& L, const StepBatch& b,
                            const Tensor& conv_state, const Tensor& ssm_state, const ops::ResidualNorm* pre,
                            const Tensor& x, const Tensor& out) const {
  const ModelConfig& c = config_;
  const MambaWeights& w = L.mamba;
  const int64_t T = b.num_tokens(), H = c.mamba_num_heads, P = c.mamba_head_dim, G = c.n_groups;
  const int64_t N = c.ssm_state_size, Di = c.mamba_inner(), Cd = c.conv_dim();
  const int64_t Tp = b.num_prefill_tokens();
  const size_t np = static_cast<size_t>(b.num_prefill_seqs);
  const std::span<const int32_t> cu(b.cu_seqlens);
  const ops::Indices slots(b.state_slots, b.device_meta ? b.device_meta->state_slots : nullptr);
  // The positions that key an F16 state's stochastic rounding (ops.h SsmParams::context_lens).
  ops::SsmParams sp = w.ssm;
  sp.context_lens = ops::Indices(b.context_lens, b.device_meta ? b.device_meta->context_lens : nullptr);

  // in_proj rows: [ z : Di | xBC : Cd | dt : H ]  (docs/model.md 3.2)
  Tensor zxbcdt = act(ctx, {T, c.in_proj_dim()});
  input_linear(ctx, pre, x, {&zxbcdt, 1}, {&w.in_proj, 1}, w.in_proj_bias);
  Tensor normed = act(ctx, {T, Di});

  // Decode rows: conv update + selective state update + gated norm as ONE op straight from the in_proj rows (which
  // kernels run is the backend's choice: one fused kernel for small batches on CUDA, the three ops otherwise).
  if (Tp < T) {
    ops::SsmParams decode = sp;
    decode.context_lens = sp.context_lens.subspan(np);
    ops::mamba_decode_update(ctx, normed.rows(Tp, T), zxbcdt.rows(Tp, T), w.conv1d_weight, w.conv1d_bias, decode,
                             w.norm, G, c.layer_norm_epsilon, conv_state, ssm_state, slots.subspan(np),
                             /*prefetch_states=*/true);  // the previous kernel is in_proj
  }
  // Prefill rows: varlen causal conv + SiLU, chunked SSD scan, gated norm.
  if (np > 0) {
    const Tensor in_rows = Tp == T ? zxbcdt : zxbcdt.rows(0, Tp);
    Tensor z, xbc, dt;
    split_columns(ctx, in_rows, {Di, Cd, H}, {&z, &xbc, &dt});
    Tensor xbc_act = act(ctx, {Tp, Cd});
    ops::causal_conv1d(ctx, xbc_act, xbc, w.conv1d_weight, w.conv1d_bias, conv_state, cu.first(np + 1),
                       slots.host.first(np), /*silu=*/true);
    Tensor xs, B, C;
    split_columns(ctx, xbc_act, {Di, G * N, G * N}, {&xs, &B, &C});
    Tensor y = act(ctx, {Tp, H, P});
    ops::SsmParams prefill = sp;
    prefill.context_lens = sp.context_lens.first(np);
    ops::ssd_chunk_scan(ctx, y, xs.reshape({Tp, H, P}), dt, B.reshape({Tp, G, N}), C.reshape({Tp, G, N}), prefill,
                        ssm_state, cu.first(np + 1), slots.host.first(np), c.chunk_size);
    // Gate first, then per-group RMSNorm (norm_before_gate = false).
    ops::gated_rms_norm(ctx, Tp == T ? normed : normed.rows(0, Tp), y.reshape({Tp, Di}), z, w.norm, G,
                        c.layer_norm_epsilon);
  }
  ops::linear(ctx, out, normed, w.out_proj, w.out_proj_bias);
}

void NemotronH::attention_mixer(const ops::Context& ctx, const LayerWeights& L, const StepBatch& b,
                                const Tensor& block_tables, const ops::KvCacheView& kv, const ops::ResidualNorm* pre,
                                const Tensor& x, const Tensor& out) const {
  const ModelConfig& c = config_;
  const AttentionWeights& w = L.attention;
  const int64_t T = b.num_tokens(), Qh = c.num_attention_heads, KVh = c.num_key_value_heads, hd = c.head_dim;
  Tensor q = act(ctx, {T, Qh * hd});
  Tensor k = act(ctx, {T, KVh * hd}), v = act(ctx, {T, KVh * hd});
  // One op for the three projections of the same x (on CUDA at decode sizes one GEMV launch).
  const Tensor qkv_out[] = {q, k, v};
  const Tensor qkv_w[] = {w.q_proj, w.k_proj, w.v_proj};
  input_linear(ctx, pre, x, qkv_out, qkv_w, Tensor());
  // No positional encoding of any kind (docs/model.md 4): the Mamba layers carry position.
  Tensor o = act(ctx, {T, Qh, hd});
  const StepBatch::DeviceMeta* dm = b.device_meta;
  ops::attention(ctx, o, q.reshape({T, Qh, hd}), k.reshape({T, KVh, hd}), v.reshape({T, KVh, hd}), kv,
                 ops::Indices(b.cu_seqlens, dm ? dm->cu_seqlens : nullptr),
                 ops::Indices(b.context_lens, dm ? dm->context_lens : nullptr), block_tables,
                 1.0f / std::sqrt(static_cast<float>(hd)));
  ops::linear(ctx, out, o.reshape({T, Qh * hd}), w.o_proj);
}

void NemotronH::moe_mixer(const ops::Context& ctx, size_t layer, const LayerWeights& L, const Tensor& x,
                          const Tensor& shared_out, const Tensor& routed_out) const {
  const ModelConfig& c = config_;
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

  // Routed experts, in the latent space when moe_latent_size is set (docs/model.md 6.2), and the shared expert, which
  // reads the full hidden state, never the latent one. One op: moe_experts then relu2_mlp (the CPU runs exactly
  // those), on CUDA at decode sizes the shared expert inside the routed experts' GEMV launches.
  const ops::SharedExpert shared{shared_out, x, w.shared_experts.up_proj, w.shared_experts.down_proj};
  if (c.moe_latent_size) {
    Tensor latent_in = act(ctx, {T, Din}), latent_out = act(ctx, {T, Din});
    ops::linear(ctx, latent_in, x, w.fc1_latent_proj);
    ops::moe_experts_shared(ctx, latent_out, latent_in, ids, weights, w.experts_up, w.experts_down, shared);
    ops::linear(ctx, routed_out, latent_out, w.fc2_latent_proj);
  } else {
    ops::moe_experts_shared(ctx, routed_out, x, ids, weights, w.experts_up, w.experts_down, shared);
  }
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

Tensor NemotronH::forward_device(const ops::Context& ctx, const StepBatch& b, ModelState& state) const {
  b.validate();
  if (ctx.device != device_) {
    runtime_error("NemotronH::forward: the model was loaded for the {} but the context is {}",
                  device_ == Device::kCpu ? "CPU" : "GPU", ctx.device == Device::kCpu ? "the CPU" : "a GPU");
  }
  // Written only while a dump is on (a debugging session: one thread), so concurrent forwards stay read-only.
  if (!dump_dir_.empty()) dump_step_ = b.num_prefill_seqs > 0 ? dumped_steps_++ : -1;
  const ModelConfig& c = config_;
  const int64_t T = b.num_tokens(), D = c.hidden_size;
  const float eps = c.layer_norm_epsilon;
  const StepBatch::DeviceMeta* dm = b.device_meta;

  // The CUDA attention reads block tables from device memory: one upload per step, shared by all layers
  // (none when the step's metadata is already on the device).
  Tensor block_tables = b.block_tables;
  if (dm) {
    block_tables = dm->block_tables;
  } else if (ctx.device != Device::kCpu && b.num_seqs() > 0) {
    block_tables = device::to_device(b.block_tables, ctx.device);
  }

  // The residual stream in two buffers: a residual step folded into the next layer's first dense op writes the
  // new residual to the other one (its GEMV blocks all read the old one; ops::residual_norm_linear).
  Tensor h = act(ctx, {T, D}), h_next = act(ctx, {T, D});
  ops::embedding(ctx, h, embeddings_, ops::Indices(b.token_ids, dm ? dm->token_ids : nullptr));
  Tensor x = act(ctx, {T, D});    // normed input of the current mixer
  Tensor mix = act(ctx, {T, D});  // mixer output (the MoE layer's shared expert)
  Tensor routed;                  // the MoE layer's routed experts, added in the norm kernel
  for (const LayerWeights& L : layers_) {
    if (L.kind == LayerKind::kMoe) {
      routed = act(ctx, {T, D});
      break;
    }
  }
  ops::rms_norm(ctx, x, h, layers_.empty() ? norm_f_ : layers_[0].norm, eps);

  // The residual step after layer i: h = h + mixer(x) (a MoE layer's shared + routed output rounded to the
  // activation dtype first), x = the next layer's norm (or norm_f) of h. Before a Mamba or attention layer it is
  // left pending and folded into that layer's first dense op (one launch fewer at decode sizes on CUDA);
  // otherwise one fused add + norm op here.
  // The last step (norm_f) folds into the lm_head when every row's logits are wanted (a decode step).
  const int64_t R = static_cast<int64_t>(b.logit_rows.size());
  bool every_row = R == T;
  for (int64_t r = 0; every_row && r < R; ++r) every_row = b.logit_rows[static_cast<size_t>(r)] == r;
  ops::ResidualNorm pending;
  bool has_pending = false;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const LayerWeights& L = layers_[i];
    const ops::ResidualNorm* pre = has_pending ? &pending : nullptr;
    switch (L.kind) {
      case LayerKind::kMamba: mamba_mixer(ctx, L, b, state.conv[i], state.ssm[i], pre, x, mix); break;
      case LayerKind::kAttention: attention_mixer(ctx, L, b, block_tables, state.kv[i], pre, x, mix); break;
      case LayerKind::kMlp: ops::relu2_mlp(ctx, mix, x, L.mlp.up_proj, L.mlp.down_proj); break;
      case LayerKind::kMoe: moe_mixer(ctx, i, L, x, mix, routed); break;
    }
    if (has_pending) std::swap(h, h_next);  // the folded step wrote the new residual to h_next
    dump_activation(i, "input", h);         // h is layer i's input now: the folded step has run
    const bool fold_next =
        i + 1 < layers_.size()
            ? layers_[i + 1].kind == LayerKind::kMamba || layers_[i + 1].kind == LayerKind::kAttention
            : every_row;
    const Tensor& next_norm = i + 1 < layers_.size() ? layers_[i + 1].norm : norm_f_;
    const Tensor no_tensor;
    const Tensor& second = L.kind == LayerKind::kMoe ? routed : no_tensor;
    has_pending = fold_next;
    if (fold_next) {
      pending = ops::ResidualNorm{h, h_next, mix, second, next_norm, eps, x};
    } else if (second) {
      ops::add2_rms_norm(ctx, h, x, mix, second, next_norm, eps);
    } else {
      ops::add_rms_norm(ctx, h, x, mix, next_norm, eps);
    }
  }

  // x now holds norm_f(h), or the step is pending for the lm_head. Only the requested rows go through lm_head (all
  // of them in a decode step: no gather).
  Tensor logits = act(ctx, {R, c.vocab_size});
  if (has_pending) {
    ops::residual_norm_linear(ctx, pending, {&logits, 1}, {&lm_head_, 1});
    return logits;
  }
  const Tensor rows = every_row ? x : gather_rows(ctx, x, act_dtype_, b.logit_rows);
  ops::linear(ctx, logits, rows, lm_head_);
  return logits;
}

}  // namespace chimera
