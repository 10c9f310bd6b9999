#include "models/nemotron_h_weights.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <set>
#include <utility>

#include "backends/device_api.h"
#include "core/counter_rng.h"
#include "core/error.h"
#include "core/fp8.h"
#include "core/nvfp4.h"
#include "core/parallel.h"
#include "ops/quant_ops.h"

namespace chimera {
namespace {

using Role = WeightSlot::Role;

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

bool dense_dtype(DType t) { return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16; }

// ---- synthetic values --------------------------------------------------------------------------------------
// A deterministic uniform draw per tensor, keyed by (seed, canonical name) so a tensor's values do not depend on
// load order or on --num-layers. Uniform rather than normal because it is cheap and only the scale matters:
// U(-a, a) has std a / sqrt(3).
uint64_t name_hash(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a
  for (const unsigned char ch : s) h = (h ^ ch) * 0x100000001b3ull;
  return h;
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

// "a, b, c" for the first dozen names, then how many there are in all.
std::string name_list(const std::vector<std::string>& names) {
  std::string list;
  for (size_t i = 0; i < names.size() && i < 12; ++i) list += (i ? ", " : "") + names[i];
  if (names.size() > 12) list += fmt::format(", ... ({} in all)", names.size());
  return list;
}

// ---- the checkpoint side of the name table -------------------------------------------------------------------
bool is_mtp_name(const std::string& name) {
  return name.rfind("mtp.", 0) == 0;
}

// Canonical names (no "backbone." / "model." prefix, "embeddings" spelled with an s; the MTP head's mtp.* as they
// are) mapped back to the checkpoint's own names, with a record of what the model consumed.
class CheckpointTensors {
 public:
  // with_mtp false: the checkpoint's mtp.* tensors are not the model's (a config without an MTP head) and are
  // neither loaded nor reported as unexpected.
  CheckpointTensors(const Checkpoint& ckpt, const std::optional<QuantConfig>& quant, bool with_mtp)
      : ckpt_(ckpt), quant_(quant) {
    for (const std::string& name : ckpt.names()) {
      if (is_mtp_name(name) && !with_mtp) continue;
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

  // The checkpoint's name of canonical tensor `c` ("backbone." + c when the checkpoint lacks it, mtp.* as it is).
  std::string name_of(const std::string& c) const {
    const auto it = canonical_.find(c);
    if (it != canonical_.end()) return it->second;
    return is_mtp_name(c) ? c : "backbone." + c;
  }
  // The checkpoint module of canonical module `c` ("layers.0.mixer.in_proj" -> "backbone.layers.0.mixer.in_proj").
  std::string module_of(const std::string& c) const {
    const std::string n = name_of(c + ".weight");
    return n.substr(0, n.size() - std::string(".weight").size());
  }

  // What the quantization config says module `module` (a checkpoint prefix) stores. MIXED_PRECISION lists the
  // routed experts as one module ("backbone.layers.3.mixer.experts"): a module below a listed one takes its entry.
  ops::WeightFormat format_of(const std::string& module) const {
    if (!quant_) return ops::WeightFormat::kDense;
    ModuleQuant m = quant_->module_quant(module);
    if (m.format == chimera::WeightFormat::kUnquantized && quant_->algo == QuantAlgo::kMixedPrecision) {
      for (std::string p = module; p.rfind('.') != std::string::npos;) {
        p.resize(p.rfind('.'));
        if (quant_->excluded(p)) break;
        if (const auto it = quant_->quantized_layers.find(p); it != quant_->quantized_layers.end()) {
          m = it->second;
          break;
        }
      }
    }
    switch (m.format) {
      case chimera::WeightFormat::kUnquantized: return ops::WeightFormat::kDense;
      case chimera::WeightFormat::kFp8: return ops::WeightFormat::kFp8;
      case chimera::WeightFormat::kNvfp4:
      case chimera::WeightFormat::kNvfp4W4A16: return ops::WeightFormat::kNvfp4;
    }
    return ops::WeightFormat::kDense;
  }
  std::string quant_source() const { return quant_ ? quant_->source : std::string("the checkpoint"); }

  // A dense float tensor (F32 / BF16 / F16) checked against `shape`; a missing one is recorded (reported at the end).
  // `module`, when set, is the linear module it belongs to (a quantized dtype there names the config's verdict).
  Tensor take(const std::string& c, const Shape& shape, const std::string& module = "") {
    const TensorInfo* info = find(c);
    if (!info) return Tensor();
    check_shape(*info, shape, "from config.json");
    if (!dense_dtype(info->dtype)) {
      if (!module.empty()) {
        invalid_input("{}: tensor '{}' has dtype {}, but {} leaves module '{}' unquantized (expected a float type)",
                      info->file.string(), info->name, dtype_name(info->dtype), quant_source(), module);
      }
      invalid_input("{}: tensor '{}' has dtype {}, expected a float type", info->file.string(), info->name,
                    dtype_name(info->dtype));
    }
    return ckpt_.tensor(info->name);
  }
  Tensor take_f32(const std::string& c, const Shape& shape) {
    Tensor t = take(c, shape);
    return t ? t.to_f32() : t;
  }
  // A tensor of exactly `dtype` and `shape` (`layout` says what it holds, for the error), for module `module`
  // stored as `format`.
  Tensor take_exact(const std::string& c, DType dtype, const Shape& shape, const char* layout,
                    const std::string& module, ops::WeightFormat format) {
    const TensorInfo* info = find(c);
    if (!info) return Tensor();
    if (info->dtype != dtype) {
      invalid_input("{}: tensor '{}' has dtype {}, expected {} ({}: {} stores module '{}' as {})",
                    info->file.string(), info->name, dtype_name(info->dtype), dtype_name(dtype), layout,
                    quant_source(), module, ops::weight_format_name(format));
    }
    check_shape(*info, shape, layout);
    return ckpt_.tensor(info->name);
  }
  // An F32 scalar ([] or [1]), finite and > 0. Missing and `required`: recorded as missing; missing and optional: 0.
  float scalar(const std::string& c, bool required) {
    if (!has(c)) {
      if (required) missing_.push_back(name_of(c));
      return 0.0f;
    }
    const TensorInfo* info = find(c);
    if (info->dtype != DType::kF32 || info->shape.size() > 1 || (info->shape.size() == 1 && info->shape[0] != 1)) {
      invalid_input("{}: tensor '{}' is {} {}, expected an F32 scalar (shape [] or [1])", info->file.string(),
                    info->name, dtype_name(info->dtype), shape_str(info->shape));
    }
    float v;
    std::memcpy(&v, ckpt_.tensor(info->name).data(), sizeof v);
    if (!std::isfinite(v) || v <= 0.0f) {
      invalid_input("{}: tensor '{}' = {} is not a positive finite scale", info->file.string(), info->name, v);
    }
    return v;
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
  const TensorInfo* find(const std::string& c) {
    const auto it = canonical_.find(c);
    if (it == canonical_.end()) {
      missing_.push_back(name_of(c));
      return nullptr;
    }
    consumed_.insert(c);
    return &ckpt_.info(it->second);
  }
  static void check_shape(const TensorInfo& info, const Shape& shape, const char* what) {
    if (info.shape != shape) {
      invalid_input("{}: tensor '{}' has shape {}, expected {} ({})", info.file.string(), info.name,
                    shape_str(info.shape), shape_str(shape), what);
    }
  }

  const Checkpoint& ckpt_;
  const std::optional<QuantConfig>& quant_;
  std::map<std::string, std::string> canonical_;
  std::set<std::string> consumed_;
  std::vector<std::string> missing_;
};

// One linear module from the checkpoint in the format the config gives it.
ops::LinearWeight load_linear(CheckpointTensors& ck, const std::string& c, int64_t N, int64_t K,
                              const ModelOptions& options) {
  ops::LinearWeight w;
  w.name = ck.module_of(c);
  w.format = ck.format_of(w.name);
  switch (w.format) {
    case ops::WeightFormat::kDense: w.weight = ck.take(c + ".weight", {N, K}, w.name); break;
    case ops::WeightFormat::kFp8:
      w.weight = ck.take_exact(c + ".weight", DType::kF8E4M3, {N, K}, "F8_E4M3 [N, K]", w.name, w.format);
      w.scale = ck.scalar(c + ".weight_scale", true);
      w.input_scale = ck.scalar(c + ".input_scale", false);
      w.act = w.input_scale > 0.0f && !options.weight_only ? ops::ActQuant::kStatic : ops::ActQuant::kNone;
      break;
    case ops::WeightFormat::kNvfp4:
      if (K % 2 != 0 || K % kNvfp4BlockSize != 0) {
        invalid_input("{}: tensor '{}.weight': NVFP4 needs in_features a multiple of {} (two E2M1 values a byte, one "
                      "scale per {}), got in = {}", ck.quant_source(), w.name, kNvfp4BlockSize, kNvfp4BlockSize, K);
      }
      w.weight = ck.take_exact(c + ".weight", DType::kU8, {N, K / 2}, "U8 [N, K / 2], two E2M1 values a byte", w.name,
                               w.format);
      w.weight_scale = ck.take_exact(c + ".weight_scale", DType::kF8E4M3, {N, K / kNvfp4BlockSize},
                                     "F8_E4M3 [N, K / 16]", w.name, w.format);
      w.scale = ck.scalar(c + ".weight_scale_2", true);
      w.input_scale = ck.scalar(c + ".input_scale", false);  // W4A4's activation scale: weight-only here
      break;
  }
  return w;
}

// Where and in which dtype the experts' [E, ...] buffers are built (ExpertsTarget{} = as stored, on the host).
struct ExpertsTarget {
  Device device = Device::kCpu;
  DType dense_dtype = DType::kF32;  // on CUDA: the dtype dense experts are converted to
};

// E tensors of one shape and dtype as one [E, ...] tensor. On the host: a view when they lie back to back in one
// mapping (a checkpoint that stores the experts in order), else a host copy. On CUDA: one device buffer filled
// expert by expert (in `dtype`), so the host never holds a copy of the layer's experts.
Tensor stack(const std::vector<Tensor>& ts, const ExpertsTarget& target, DType dtype) {
  Shape shape = ts[0].shape();
  shape.insert(shape.begin(), static_cast<int64_t>(ts.size()));
  if (target.device == Device::kCuda) {
    const Tensor r = device::empty(Device::kCuda, dtype, shape);
    for (size_t e = 0; e < ts.size(); ++e) {
      const Tensor& src = ts[e];
      device::copy(r.select(static_cast<int64_t>(e)),
                   src.dtype() == dtype ? src : device::to_device(src, Device::kCpu, dtype));
    }
    return r;
  }
  bool adjacent = true;
  for (size_t e = 1; adjacent && e < ts.size(); ++e) {
    adjacent = static_cast<const char*>(ts[e].data()) == static_cast<const char*>(ts[0].data()) + e * ts[0].nbytes();
  }
  if (adjacent) {
    auto owner = std::make_shared<std::vector<Tensor>>(ts);
    return Tensor::wrap(ts[0].data(), ts[0].dtype(), shape, owner);
  }
  Tensor r = Tensor::empty(ts[0].dtype(), shape);
  for (size_t e = 0; e < ts.size(); ++e) {
    std::memcpy(static_cast<char*>(r.data()) + e * ts[0].nbytes(), ts[e].data(), ts[e].nbytes());
  }
  return r;
}

// E per-expert linear layers as one ExpertWeights (one format for all: kInvalidInput otherwise).
ops::ExpertWeights stack_experts(std::vector<ops::LinearWeight>& ex, const std::string& name,
                                 const ExpertsTarget& target = {}) {
  ops::ExpertWeights w;
  w.name = name;
  w.format = ex[0].format;
  w.act = ex[0].act;
  std::vector<Tensor> weights, scales;
  for (const ops::LinearWeight& e : ex) {
    if (e.format != w.format) {
      invalid_input("{} is {} but {} is {}: the routed experts of one projection need one format", ex[0].name,
                    ops::weight_format_name(w.format), e.name, ops::weight_format_name(e.format));
    }
    if (!e.weight) return {};  // a missing tensor, reported by finish()
    weights.push_back(e.weight);
    if (e.weight_scale) scales.push_back(e.weight_scale);
    if (e.act != w.act) w.act = ops::ActQuant::kNone;  // not every expert has an input scale: weight-only
  }
  const bool cuda = target.device == Device::kCuda;
  w.weight = stack(weights, target,
                   w.format == ops::WeightFormat::kDense && cuda ? target.dense_dtype : weights[0].dtype());
  if (!scales.empty()) w.weight_scale = stack(scales, target, scales[0].dtype());
  if (w.format != ops::WeightFormat::kDense) {
    for (const ops::LinearWeight& e : ex) {
      w.host_scale.push_back(e.scale);
      if (w.act == ops::ActQuant::kStatic) w.host_input_scale.push_back(e.input_scale);
    }
    const auto E = static_cast<int64_t>(ex.size());
    w.scale = Tensor::from_f32({E}, w.host_scale);
    if (!w.host_input_scale.empty()) w.input_scale = Tensor::from_f32({E}, w.host_input_scale);
    if (cuda) {
      w.scale = device::to_device(w.scale, Device::kCuda);
      if (w.input_scale) w.input_scale = device::to_device(w.input_scale, Device::kCuda);
    }
  }
  return w;
}

// ---- quantization at load (ModelOptions::quantize) -------------------------------------------------------------
Tensor bytes_tensor(DType dtype, const Shape& shape, const std::vector<uint8_t>& bytes) {
  Tensor t = Tensor::empty(dtype, shape);
  std::memcpy(t.data(), bytes.data(), bytes.size());
  return t;
}

// A dense [N, K] weight quantized as ModelOpt's weight quantizers do. There is no calibrated input scale, so the
// activations are `act` (FP8: ActQuant::kDynamic, or kNone with ModelOptions::weight_only); NVFP4 runs weight-only.
void quantize_linear(ops::LinearWeight& w, ops::WeightFormat format, ops::ActQuant act) {
  if (!w || w.format != ops::WeightFormat::kDense || format == ops::WeightFormat::kDense) return;
  const Tensor f = w.weight.to_f32();
  const int64_t N = f.dim(0), K = f.dim(1);
  const std::span<const float> v(f.f32(), static_cast<size_t>(f.numel()));
  if (format == ops::WeightFormat::kFp8) {
    const Fp8Weight q = quantize_fp8_per_tensor(v);
    w.weight = bytes_tensor(DType::kF8E4M3, {N, K}, q.data);
    w.scale = q.weight_scale;
  } else {
    if (K % kNvfp4BlockSize != 0) {
      invalid_input("--quantization nvfp4: module '{}' has in_features {}, not a multiple of {}", w.name, K,
                    kNvfp4BlockSize);
    }
    const Nvfp4Weight q = quantize_nvfp4(v, N, K);
    w.weight = bytes_tensor(DType::kU8, {N, K / 2}, q.packed);
    w.weight_scale = bytes_tensor(DType::kF8E4M3, {N, K / kNvfp4BlockSize}, q.block_scale);
    w.scale = q.weight_scale_2;
  }
  w.format = format;
  w.act = format == ops::WeightFormat::kFp8 ? act : ops::ActQuant::kNone;
  w.input_scale = 0.0f;
}

// The activation quantization of a layer quantized at load: dynamic (FP8), none with ModelOptions::weight_only.
ops::ActQuant load_quantized_act(const ModelOptions& options) {
  return options.weight_only ? ops::ActQuant::kNone : ops::ActQuant::kDynamic;
}

void quantize_experts(ops::ExpertWeights& w, ops::WeightFormat format, ops::ActQuant act) {
  if (!w || w.format != ops::WeightFormat::kDense || format == ops::WeightFormat::kDense) return;
  std::vector<ops::LinearWeight> ex;
  for (int64_t e = 0; e < w.num_experts(); ++e) {
    ex.push_back(w.expert(e));
    ex.back().name = fmt::format("{} (expert {})", w.name, e);
    quantize_linear(ex.back(), format, act);
  }
  const std::string name = w.name;
  w = stack_experts(ex, name);
}

// Whether --quantization touches slot `s`: every linear layer and expert projection but lm_head (ModelOpt's
// default exclusions; the router, conv1d and embeddings are not linear slots) and the MTP head, which NVIDIA's
// quantized Super checkpoints keep in bf16.
bool quantizable(const WeightSlot& s) {
  return s.kind != "lm_head" && s.kind != "mtp";
}

void reshape_conv(const WeightSlot& s) {
  if (*s.tensor && ends_with(s.name, "conv1d.weight")) *s.tensor = s.tensor->reshape({s.tensor->dim(0), s.shape[2]});
}

std::string expert_name(const std::string& pattern, int64_t e) {
  std::string n = pattern;
  n.replace(n.find("{e}"), 3, std::to_string(e));
  return n;
}

// The layer structure of `c` with no tensors yet; with_mtp: its MTP head's blocks too.
ModelWeights empty_weights(const ModelConfig& c, bool with_mtp) {
  ModelWeights w;
  w.layers.resize(c.layers.size());
  for (size_t i = 0; i < c.layers.size(); ++i) w.layers[i].kind = c.layers[i];
  if (!with_mtp || c.num_nextn_predict_layers == 0) return w;
  if (c.mtp_layers.empty()) {
    invalid_input(
        "config.json: num_nextn_predict_layers = {} but the MTP pattern (mtp_hybrid_override_pattern / "
        "mtp_layers_block_type) is empty",
        c.num_nextn_predict_layers);
  }
  for (const LayerKind k : c.mtp_layers) {
    if (k == LayerKind::kMamba) {
      invalid_input(
          "config.json: mtp_hybrid_override_pattern / mtp_layers_block_type has a Mamba sublayer; the MTP "
          "head supports attention ('*'), MLP ('-') and MoE ('E') sublayers");
    }
  }
  w.mtp.resize(static_cast<size_t>(c.num_nextn_predict_layers));
  for (MtpBlockWeights& b : w.mtp) {
    b.layers.resize(c.mtp_layers.size());
    for (size_t j = 0; j < c.mtp_layers.size(); ++j) b.layers[j].kind = c.mtp_layers[j];
  }
  return w;
}

// Slot `s`'s tensor cut to the model's shard (models/tensor_parallel.h), after any quantization at load so that a
// rank's quantized weight is exactly its slice of the unsharded one (per-tensor scales are replicated, per-expert
// ones too unless the experts split by expert; NVFP4's packed bytes and 16-column block scales are cut along with
// their columns). A no-op for a replicated slot.
void apply_shard(const WeightSlot& s) {
  const Shard& sh = s.shard;
  if (sh.replicated()) return;
  if (s.tensor) {
    *s.tensor = sh.rank0_only ? Tensor() : slice_tensor(*s.tensor, sh);
  } else if (s.linear && *s.linear) {
    ops::LinearWeight& l = *s.linear;
    const bool packed = l.format == ops::WeightFormat::kNvfp4 && sh.dim == 1;
    l.weight = slice_tensor(l.weight, sh, packed ? 2 : 1);
    if (l.weight_scale) l.weight_scale = slice_tensor(l.weight_scale, sh, packed ? kNvfp4BlockSize : 1);
  } else if (s.experts && *s.experts) {
    ops::ExpertWeights& x = *s.experts;
    const bool packed = x.format == ops::WeightFormat::kNvfp4 && sh.dim == 2;
    x.weight = slice_tensor(x.weight, sh, packed ? 2 : 1);
    if (x.weight_scale) x.weight_scale = slice_tensor(x.weight_scale, sh, packed ? kNvfp4BlockSize : 1);
    if (sh.dim == 0) {
      // Expert parallel: the rank's experts' own scales.
      const Shard per_expert{0, sh.ranges};
      if (x.scale) x.scale = slice_tensor(x.scale, per_expert);
      if (x.input_scale) x.input_scale = slice_tensor(x.input_scale, per_expert);
      auto cut = [&](std::vector<float>& v) {
        if (v.empty()) return;
        std::vector<float> mine;
        for (const auto& [b, e] : sh.ranges) mine.insert(mine.end(), v.begin() + b, v.begin() + e);
        v = std::move(mine);
      };
      cut(x.host_scale);
      cut(x.host_input_scale);
    }
  }
}

}  // namespace

std::vector<WeightSlot> weight_slots(const ModelConfig& c, ModelWeights& w, const TensorParallel& tp) {
  std::vector<WeightSlot> s;
  // Shards only with tensor parallelism: without it every slot is replicated (the whole tensor, no copy).
  const bool sharded = tp.enabled();
  auto rows = [&](std::vector<std::pair<int64_t, int64_t>> r, int dim = 0) {
    return sharded ? Shard{dim, std::move(r), false} : Shard{};
  };
  auto part = [&](int64_t n, int64_t unit, int dim) {
    const auto [b, e] = even_part(n, tp);
    return rows({{b * unit, e * unit}}, dim);
  };
  const Shard rank0_only = sharded ? Shard{-1, {}, tp.rank != 0} : Shard{};
  auto tensor = [&](std::string name, std::string kind, int layer, Role role, Shape shape, Tensor* t, Shard sh = {}) {
    s.push_back({std::move(name), std::move(kind), layer, role, std::move(shape), std::move(sh), t, nullptr, nullptr});
  };
  auto linear = [&](std::string name, std::string kind, int layer, int64_t N, int64_t K, ops::LinearWeight* l,
                    Shard sh = {}) {
    s.push_back({std::move(name), std::move(kind), layer, Role::kLinear, {N, K}, std::move(sh), nullptr, l, nullptr});
  };
  auto experts = [&](std::string name, std::string kind, int layer, Shape shape, Shard sh, ops::ExpertWeights* e) {
    s.push_back({std::move(name), std::move(kind), layer, Role::kExperts, std::move(shape), std::move(sh), nullptr,
                 nullptr, e});
  };
  const int64_t D = c.hidden_size, V = c.vocab_size;
  tensor("embeddings.weight", "embeddings", -1, Role::kTensor, {V, D}, &w.embeddings, part(V, 1, 0));
  tensor("norm_f.weight", "norm_f", -1, Role::kTensor, {D}, &w.norm_f);
  linear("lm_head", "lm_head", -1, V, D, &w.lm_head, part(V, 1, 0));
  // One layer's slots: prefix "layers.{i}." (or the MTP head's "mtp.layers.{f}."), grouped under `kind`; `i`:
  // the layer index (the Mamba state-rounding seed).
  auto layer = [&](LayerWeights& L, const std::string& p, const std::string& kind, int li) {
    const std::string mx = p + "mixer.";
    tensor(p + "norm.weight", kind, li, Role::kTensor, {D}, &L.norm);
    switch (L.kind) {
      case LayerKind::kMamba: {
        const int64_t H = c.mamba_num_heads, Di = c.mamba_inner(), Cd = c.conv_dim(), K = c.conv_kernel;
        const MambaShard ms = sharded ? mamba_shard(c, tp) : MambaShard{};
        MambaWeights& m = L.mamba;
        linear(mx + "in_proj", kind, li, c.in_proj_dim(), D, &m.in_proj, rows(ms.in_proj));
        if (c.use_bias) {
          tensor(mx + "in_proj.bias", kind, li, Role::kTensor, {c.in_proj_dim()}, &m.in_proj_bias, rows(ms.in_proj));
        }
        tensor(mx + "conv1d.weight", kind, li, Role::kTensor, {Cd, 1, K}, &m.conv1d_weight, rows(ms.conv));
        if (c.use_conv_bias) tensor(mx + "conv1d.bias", kind, li, Role::kTensor, {Cd}, &m.conv1d_bias, rows(ms.conv));
        tensor(mx + "A_log", kind, li, Role::kSsmParam, {H}, &m.ssm.A_log, rows({ms.heads}));
        tensor(mx + "D", kind, li, Role::kSsmParam, {H}, &m.ssm.D, rows({ms.heads}));
        tensor(mx + "dt_bias", kind, li, Role::kSsmParam, {H}, &m.ssm.dt_bias, rows({ms.heads}));
        m.ssm.dt_min = c.time_step_limit_min;
        m.ssm.dt_max = c.time_step_limit_max;
        // The F16 state's stochastic rounding draws differ per layer (ops.h SsmParams::state_seed).
        m.ssm.state_seed = splitmix64(0x4d616d6261535352ull ^ static_cast<uint64_t>(li));
        tensor(mx + "norm.weight", kind, li, Role::kTensor, {Di}, &m.norm, rows({ms.inner}));
        linear(mx + "out_proj", kind, li, D, Di, &m.out_proj, rows({ms.inner}, 1));
        if (c.use_bias) tensor(mx + "out_proj.bias", kind, li, Role::kTensor, {D}, &m.out_proj_bias, rank0_only);
        break;
      }
      case LayerKind::kAttention: {
        const int64_t hd = c.head_dim, q = c.num_attention_heads * hd, kv = c.num_key_value_heads * hd;
        const auto [k0, k1] = sharded ? split_or_replicate(c.num_key_value_heads, tp) : std::pair<int64_t, int64_t>{};
        linear(mx + "q_proj", kind, li, q, D, &L.attention.q_proj, part(c.num_attention_heads, hd, 0));
        linear(mx + "k_proj", kind, li, kv, D, &L.attention.k_proj, rows({{k0 * hd, k1 * hd}}));
        linear(mx + "v_proj", kind, li, kv, D, &L.attention.v_proj, rows({{k0 * hd, k1 * hd}}));
        linear(mx + "o_proj", kind, li, D, q, &L.attention.o_proj, part(c.num_attention_heads, hd, 1));
        break;
      }
      case LayerKind::kMlp:
        linear(mx + "up_proj", kind, li, c.intermediate_size, D, &L.mlp.up_proj, part(c.intermediate_size, 1, 0));
        linear(mx + "down_proj", kind, li, D, c.intermediate_size, &L.mlp.down_proj, part(c.intermediate_size, 1, 1));
        break;
      case LayerKind::kMoe: {
        const int64_t E = c.n_routed_experts, I = c.moe_intermediate_size, Din = c.moe_input_dim();
        MoeWeights& moe = L.moe;
        tensor(mx + "gate.weight", kind, li, Role::kRouterGate, {E, D}, &moe.gate);
        tensor(mx + "gate.e_score_correction_bias", kind, li, Role::kF32, {E}, &moe.e_score_correction_bias);
        // Routed experts split by their intermediate dimension (tensor parallel: up's N, down's K) or by expert
        // (expert parallel: the rank's experts whole).
        const Shard up = tp.expert_parallel ? part(E, 1, 0) : part(I, 1, 1);
        const Shard down = tp.expert_parallel ? part(E, 1, 0) : part(I, 1, 2);
        experts(mx + "experts.{e}.up_proj", kind, li, {E, I, Din}, up, &moe.experts_up);
        experts(mx + "experts.{e}.down_proj", kind, li, {E, Din, I}, down, &moe.experts_down);
        const int64_t Ish = c.moe_shared_expert_intermediate_size;
        linear(mx + "shared_experts.up_proj", kind, li, Ish, D, &moe.shared_experts.up_proj, part(Ish, 1, 0));
        linear(mx + "shared_experts.down_proj", kind, li, D, Ish, &moe.shared_experts.down_proj, part(Ish, 1, 1));
        if (c.moe_latent_size) {
          linear(mx + "fc1_latent_proj", kind, li, *c.moe_latent_size, D, &moe.fc1_latent_proj);
          linear(mx + "fc2_latent_proj", kind, li, D, *c.moe_latent_size, &moe.fc2_latent_proj);
        }
        break;
      }
    }
  };
  for (size_t i = 0; i < c.layers.size() && i < w.layers.size(); ++i) {
    layer(w.layers[i], fmt::format("layers.{}.", i), layer_kind_name(w.layers[i].kind), static_cast<int>(i));
  }
  // The MTP head: block-level tensors on each block's first and last sublayer (docs/model.md 7).
  size_t f = 0;
  for (MtpBlockWeights& b : w.mtp) {
    for (size_t j = 0; j < b.layers.size(); ++j, ++f) {
      const std::string p = fmt::format("mtp.layers.{}.", f);
      const int li = static_cast<int>(w.layers.size() + f);
      if (j == 0) {
        tensor(p + "enorm.weight", "mtp", li, Role::kTensor, {D}, &b.enorm);
        tensor(p + "hnorm.weight", "mtp", li, Role::kTensor, {D}, &b.hnorm);
        linear(p + "eh_proj", "mtp", li, D, 2 * D, &b.eh_proj);
      }
      layer(b.layers[j], p, "mtp", li);
      if (j + 1 == b.layers.size())
        tensor(p + "final_layernorm.weight", "mtp", li, Role::kTensor, {D}, &b.final_layernorm);
    }
  }
  return s;
}

std::function<double(const std::string& name, int64_t numel)> rank_shares(const ModelConfig& config,
                                                                          const TensorParallel& tp) {
  auto shares = std::make_shared<std::map<std::string, double>>();
  if (tp.enabled()) {
    ModelWeights w = empty_weights(config, /*with_mtp=*/false);
    for (const WeightSlot& s : weight_slots(config, w, tp)) {
      double share = 1.0;
      if (s.shard.rank0_only) {
        share = tp.rank == 0 ? 1.0 : 0.0;
      } else if (!s.shard.replicated()) {
        share = static_cast<double>(shape_numel(s.shard.local_shape(s.shape))) /
                static_cast<double>(shape_numel(s.shape));
      }
      (*shares)[s.name] = share;
    }
  }
  return [shares](const std::string& full_name, int64_t numel) {
    if (numel <= 1 || shares->empty()) return 1.0;  // scalar scales are replicated
    std::string name = full_name.rfind("backbone.", 0) == 0 ? full_name.substr(9) : full_name;
    if (auto it = shares->find(name); it != shares->end()) return it->second;
    // A linear module's tensors (weight, weight_scale, bias): the module's share; an expert's: its slot's.
    const size_t dot = name.rfind('.');
    if (dot == std::string::npos) return 1.0;
    std::string module = name.substr(0, dot);
    if (const size_t e = module.find("experts."); e != std::string::npos) {
      size_t end = e + 8;
      while (end < module.size() && std::isdigit(static_cast<unsigned char>(module[end]))) ++end;
      if (end > e + 8 && end < module.size() && module[end] == '.') module.replace(e + 8, end - (e + 8), "{e}");
    }
    if (auto it = shares->find(module); it != shares->end()) return it->second;
    return 1.0;
  };
}

int mtp_layer_count(const ModelWeights& w) {
  size_t n = 0;
  for (const MtpBlockWeights& b : w.mtp) n += b.layers.size();
  return static_cast<int>(n);
}

ModelWeights load_weights(const ModelConfig& c, const Checkpoint& checkpoint, const std::optional<QuantConfig>& quant,
                          const ModelOptions& options) {
  if (quant && options.quantize != ops::WeightFormat::kDense) {
    invalid_input("--quantization {}: {} is already quantized ({}); drop the flag to run it as stored",
                  ops::weight_format_name(options.quantize), checkpoint.dir().string(), quant->source);
  }
  // The MTP head is loaded when the config has one and the checkpoint carries its tensors (a file without them
  // is a backbone, as transformers saves it); then every one of its tensors is checked like the rest.
  bool has_mtp_tensors = false;
  for (const std::string& name : checkpoint.names()) has_mtp_tensors = has_mtp_tensors || is_mtp_name(name);
  const bool with_mtp = c.num_nextn_predict_layers > 0 && has_mtp_tensors;
  CheckpointTensors ck(checkpoint, quant, with_mtp);
  rank_config(c, options.tp);  // sizes that cannot be split: kInvalidInput naming the config field
  ModelWeights w = empty_weights(c, with_mtp);
  for (const WeightSlot& s : weight_slots(c, w, options.tp)) {
    switch (s.role) {
      case Role::kTensor:
      case Role::kRouterGate: *s.tensor = ck.take(s.name, s.shape); break;
      case Role::kSsmParam:
      case Role::kF32: *s.tensor = ck.take_f32(s.name, s.shape); break;
      case Role::kLinear:
        *s.linear = load_linear(ck, s.name, s.shape[0], s.shape[1], options);
        if (quantizable(s)) quantize_linear(*s.linear, options.quantize, load_quantized_act(options));
        break;
      case Role::kExperts: {
        const int64_t E = s.shape[0], N = s.shape[1], K = s.shape[2];
        // transformers' in-memory form fuses the experts: experts.up_proj [E, I, Din], down_proj [E, Din, I].
        std::string fused = s.name;
        fused.replace(fused.find("experts.{e}."), 12, "experts.");
        if (ck.has(fused + ".weight")) fused += ".weight";
        if (ck.has(fused)) {
          s.experts->name = ck.name_of(fused);
          s.experts->weight = ck.take(fused, s.shape, s.experts->name);
        } else {
          std::vector<ops::LinearWeight> ex;
          for (int64_t e = 0; e < E; ++e) ex.push_back(load_linear(ck, expert_name(s.name, e), N, K, options));
          std::string name = ck.module_of(expert_name(s.name, 0));
          name.replace(name.find("experts.0."), 10, "experts.{e}.");
          // On CUDA the experts go straight into their device buffer (quantization at load and a tensor-parallel
          // rank's slicing need them on the host).
          ExpertsTarget target;
          if (options.device == Device::kCuda && options.quantize == ops::WeightFormat::kDense && !options.tp.enabled()) {
            target = {Device::kCuda, options.dtype};
          }
          *s.experts = stack_experts(ex, name, target);
        }
        if (quantizable(s)) quantize_experts(*s.experts, options.quantize, load_quantized_act(options));
        break;
      }
    }
    apply_shard(s);
    if (s.tensor) reshape_conv(s);
  }
  // The FP8 KV cache's scales, when the checkpoint has them (ModelOpt: on the k / v projections).
  auto kv_scales = [&](LayerWeights& L, const std::string& mx) {
    if (L.kind != LayerKind::kAttention) return;
    AttentionWeights& a = L.attention;
    if (ck.has(mx + "k_proj.k_scale")) a.k_scale = ck.scalar(mx + "k_proj.k_scale", true);
    if (ck.has(mx + "v_proj.v_scale")) a.v_scale = ck.scalar(mx + "v_proj.v_scale", true);
  };
  for (size_t i = 0; i < w.layers.size(); ++i) kv_scales(w.layers[i], fmt::format("layers.{}.mixer.", i));
  size_t f = 0;
  for (MtpBlockWeights& b : w.mtp) {
    for (LayerWeights& L : b.layers) kv_scales(L, fmt::format("mtp.layers.{}.mixer.", f++));
  }
  ck.finish();
  bind_expert_views(w);
  return w;
}

ModelWeights synthetic_weights(const ModelConfig& c, const ModelOptions& options, uint64_t seed,
                               const std::function<void(ModelWeights&, int layer)>& on_layer) {
  rank_config(c, options.tp);  // sizes that cannot be split: kInvalidInput naming the config field
  ModelWeights w = empty_weights(c, /*with_mtp=*/true);
  // Every tensor is made whole from (seed, name) and then cut to the rank's shard, so a rank's weights are exactly
  // its slices of the unsharded model's.
  const std::vector<WeightSlot> slots = weight_slots(c, w, options.tp);
  int current = -1;
  for (const WeightSlot& s : slots) {
    if (s.layer != current) {
      if (on_layer) on_layer(w, current);
      current = s.layer;
    }
    switch (s.role) {
      case Role::kTensor:
      case Role::kRouterGate: *s.tensor = synthetic_tensor(c, seed, s.name, s.shape, options.dtype); break;
      case Role::kSsmParam:
      case Role::kF32: *s.tensor = synthetic_tensor(c, seed, s.name, s.shape, DType::kF32); break;
      case Role::kLinear:
        s.linear->name = "backbone." + s.name;
        if (s.name == "lm_head") s.linear->name = "lm_head";
        s.linear->weight = synthetic_tensor(c, seed, s.name + ".weight", s.shape, options.dtype);
        if (quantizable(s)) quantize_linear(*s.linear, options.quantize, load_quantized_act(options));
        break;
      case Role::kExperts: {
        std::vector<ops::LinearWeight> ex;
        for (int64_t e = 0; e < s.shape[0]; ++e) {
          ops::LinearWeight l;
          l.name = "backbone." + expert_name(s.name, e);
          l.weight = synthetic_tensor(c, seed, expert_name(s.name, e) + ".weight", {s.shape[1], s.shape[2]},
                                      options.dtype);
          if (quantizable(s)) quantize_linear(l, options.quantize, load_quantized_act(options));
          ex.push_back(std::move(l));
        }
        *s.experts = stack_experts(ex, "backbone." + s.name);
        break;
      }
    }
    apply_shard(s);
    if (s.tensor) reshape_conv(s);
  }
  if (on_layer) on_layer(w, current);
  bind_expert_views(w);
  return w;
}

void bind_expert_views(ModelWeights& w) {
  std::vector<LayerWeights*> layers;
  for (LayerWeights& L : w.layers) layers.push_back(&L);
  for (MtpBlockWeights& b : w.mtp) {
    for (LayerWeights& L : b.layers) layers.push_back(&L);
  }
  for (LayerWeights* layer : layers) {
    LayerWeights& L = *layer;
    MoeWeights& m = L.moe;
    m.up_views.clear();
    m.down_views.clear();
    if (L.kind != LayerKind::kMoe || !m.experts_up || !m.experts_down) continue;
    if (m.experts_up.format != ops::WeightFormat::kDense || m.experts_down.format != ops::WeightFormat::kDense) continue;
    for (int64_t e = 0; e < m.experts_up.num_experts(); ++e) {
      m.up_views.push_back(m.experts_up.weight.select(e));
      m.down_views.push_back(m.experts_down.weight.select(e));
    }
  }
}

// ---- upload ------------------------------------------------------------------------------------------------

WeightUploader::WeightUploader(const ModelConfig& config, DType dtype)
    : config_(config), dtype_(dtype), show_(isatty(fileno(stderr)) != 0) {}

WeightUploader::~WeightUploader() {
  if (show_) fmt::print(stderr, "\n");
}

void WeightUploader::upload(ModelWeights& w, int layer) {
  // A dense weight in the activation dtype (linear needs it; norms and conv accept it); stored bytes as they are.
  auto put = [&](Tensor& t, DType dtype) {
    if (!t) return;
    if (t.device() != Device::kCuda || t.dtype() != dtype) t = device::to_device(t, Device::kCuda, dtype);
    bytes_ += t.nbytes();
  };
  for (const WeightSlot& s : weight_slots(config_, w)) {
    if (s.layer != layer) continue;
    switch (s.role) {
      case Role::kTensor: put(*s.tensor, dtype_); break;
      case Role::kF32: put(*s.tensor, DType::kF32); break;
      case Role::kSsmParam:
      case Role::kRouterGate:
        // fp32 storage holding model-dtype values. transformers loads them in the model dtype (only
        // e_score_correction_bias is kept in fp32, docs/model.md 8.5 / 8.6) and upcasts them in the forward, so a
        // 16-bit model rounds an fp32 checkpoint's values once here (a no-op for 16-bit checkpoints).
        if (*s.tensor && dtype_ != DType::kF32 && s.tensor->dtype() != dtype_) {
          *s.tensor = device::to_device(*s.tensor, Device::kCpu, dtype_);
        }
        put(*s.tensor, DType::kF32);
        break;
      case Role::kLinear: {
        ops::LinearWeight& l = *s.linear;
        if (l.format == ops::WeightFormat::kDense) {
          put(l.weight, dtype_);
        } else {
          put(l.weight, l.weight.dtype());
          put(l.weight_scale, DType::kF8E4M3);
        }
        break;
      }
      case Role::kExperts: {
        ops::ExpertWeights& x = *s.experts;
        if (!x) break;
        if (x.format == ops::WeightFormat::kDense && x.weight.device() == Device::kCuda) {
          bytes_ += x.weight.nbytes();  // stacked on the device at load
        } else if (x.format == ops::WeightFormat::kDense) {
          // One device buffer [E, N, K], filled expert by expert so the host never holds a converted copy of
          // the whole layer.
          const Tensor fused = device::empty(Device::kCuda, dtype_, x.weight.shape());
          for (int64_t e = 0; e < x.num_experts(); ++e) {
            const Tensor src = x.weight.select(e);
            device::copy(fused.select(e), src.dtype() == dtype_ ? src : device::to_device(src, Device::kCpu, dtype_));
          }
          x.weight = fused;
          bytes_ += fused.nbytes();
        } else {
          put(x.weight, x.weight.dtype());
          put(x.weight_scale, DType::kF8E4M3);
          put(x.scale, DType::kF32);
          put(x.input_scale, DType::kF32);
        }
        break;
      }
    }
  }
  bind_expert_views(w);
  if (show_ && layer >= 0) {
    fmt::print(stderr, "\r[chimera] uploading weights to the GPU ({}): layer {}/{}, {:.2f} GiB", dtype_name(dtype_),
               layer + 1, config_.layers.size(), static_cast<double>(bytes_) / (1u << 30));
    std::fflush(stderr);
  }
}

// ---- counts --------------------------------------------------------------------------------------------------

std::map<std::string, KindWeights> weight_summary(const ModelConfig& config, const ModelWeights& weights) {
  // The table only reads through its pointers here.
  ModelWeights& w = const_cast<ModelWeights&>(weights);
  std::map<std::string, KindWeights> r;
  std::map<std::string, std::set<std::string>> formats;
  auto nbytes = [](const Tensor& t) { return t ? static_cast<int64_t>(t.nbytes()) : int64_t{0}; };
  for (const WeightSlot& s : weight_slots(config, w)) {
    KindWeights& k = r[s.kind];
    switch (s.role) {
      case Role::kTensor:
      case Role::kF32:
      case Role::kSsmParam:
      case Role::kRouterGate:
        if (*s.tensor) {
          k.parameters += s.tensor->numel();
          k.bytes += nbytes(*s.tensor);
        }
        break;
      case Role::kLinear: {
        const ops::LinearWeight& l = *s.linear;
        if (!l) break;
        k.parameters += l.out_features() * l.in_features();
        k.bytes += nbytes(l.weight) + nbytes(l.weight_scale);
        if (l.format != ops::WeightFormat::kDense) k.bytes += l.input_scale > 0.0f ? 8 : 4;  // the F32 scalars
        formats[s.kind].insert(ops::weight_format_name(l.format));
        break;
      }
      case Role::kExperts: {
        const ops::ExpertWeights& x = *s.experts;
        if (!x) break;
        k.parameters += x.num_experts() * x.out_features() * x.in_features();
        k.bytes += nbytes(x.weight) + nbytes(x.weight_scale) + nbytes(x.scale) + nbytes(x.input_scale);
        formats[s.kind].insert(ops::weight_format_name(x.format));
        break;
      }
    }
  }
  for (auto& [kind, k] : r) {
    for (const std::string& f : formats[kind]) k.formats += (k.formats.empty() ? "" : "+") + f;
    if (k.formats.empty()) k.formats = "dense";
  }
  return r;
}

double decode_bytes_per_token(const ModelConfig& config, const ModelWeights& weights) {
  ModelWeights& w = const_cast<ModelWeights&>(weights);  // read through the table's pointers only
  const double topk = config.n_routed_experts > 0 ? static_cast<double>(config.num_experts_per_tok) /
                                                        static_cast<double>(config.n_routed_experts)
                                                  : 0.0;
  auto nbytes = [](const Tensor& t) { return t ? static_cast<double>(t.nbytes()) : 0.0; };
  double bytes = 0.0;
  for (const WeightSlot& s : weight_slots(config, w)) {
    if (s.kind == "mtp") continue;  // the backbone's token
    if (s.tensor) {
      bytes += s.kind == "embeddings" ? nbytes(*s.tensor) / static_cast<double>(config.vocab_size) : nbytes(*s.tensor);
    } else if (s.linear) {
      bytes += nbytes(s.linear->weight) + nbytes(s.linear->weight_scale);
    } else if (s.experts) {
      const ops::ExpertWeights& x = *s.experts;
      bytes += topk * (nbytes(x.weight) + nbytes(x.weight_scale)) + nbytes(x.scale) + nbytes(x.input_scale);
    }
  }
  return bytes;
}

}  // namespace chimera
