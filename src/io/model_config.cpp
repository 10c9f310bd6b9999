// config.json -> ModelConfig (docs/model.md 1.2). Defaults are HF NemotronHConfig's; legacy aliases resolve to
// the canonical field. A JSON null counts as "not set" (HF configs write e.g. "sliding_window": null).
#include "io/model_config.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>
#include <string_view>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/json_file.h"

namespace chimera {

namespace fs = std::filesystem;
using json = nlohmann::json;

char layer_kind_char(LayerKind k) {
  switch (k) {
    case LayerKind::kMamba: return 'M';
    case LayerKind::kAttention: return '*';
    case LayerKind::kMlp: return '-';
    case LayerKind::kMoe: return 'E';
  }
  return '?';
}

const char* layer_kind_name(LayerKind k) {
  switch (k) {
    case LayerKind::kMamba: return "mamba";
    case LayerKind::kAttention: return "attention";
    case LayerKind::kMlp: return "mlp";
    case LayerKind::kMoe: return "moe";
  }
  return "?";
}

std::string ModelConfig::pattern() const {
  std::string s;
  s.reserve(layers.size());
  for (LayerKind k : layers) s += layer_kind_char(k);
  return s;
}

namespace {

std::string prefix(const std::string& source) { return source.empty() ? std::string() : source + ": "; }

std::vector<LayerKind> parse_pattern(const std::string& pattern, const std::string& field, const std::string& source) {
  std::vector<LayerKind> r;
  r.reserve(pattern.size());
  for (size_t i = 0; i < pattern.size(); ++i) {
    switch (pattern[i]) {
      case 'M': r.push_back(LayerKind::kMamba); break;
      case '*': r.push_back(LayerKind::kAttention); break;
      case '-': r.push_back(LayerKind::kMlp); break;
      case 'E': r.push_back(LayerKind::kMoe); break;
      default:
        invalid_input("{}field '{}': unknown layer character '{}' at position {} (supported: 'M', '*', '-', 'E')",
                      prefix(source), field, pattern[i], i);
    }
  }
  return r;
}

// HF `layers_block_type` entries: the new names and the legacy ones.
std::vector<LayerKind> parse_block_types(const json& list, const std::string& field, const std::string& source) {
  if (!list.is_array()) {
    invalid_input("{}field '{}' must be a list of strings, got {}", prefix(source), field, list.type_name());
  }
  std::vector<LayerKind> r;
  for (size_t i = 0; i < list.size(); ++i) {
    const json& v = list[i];
    const std::string name = v.is_string() ? v.get<std::string>() : v.dump();
    if (name == "linear_attention" || name == "mamba") {
      r.push_back(LayerKind::kMamba);
    } else if (name == "full_attention" || name == "attention") {
      r.push_back(LayerKind::kAttention);
    } else if (name == "mlp") {
      r.push_back(LayerKind::kMlp);
    } else if (name == "moe") {
      r.push_back(LayerKind::kMoe);
    } else {
      invalid_input("{}field '{}': unknown layer type {} at position {} (supported: linear_attention, "
                    "full_attention, mlp, moe, or the legacy mamba, attention)",
                    prefix(source), field, v.dump(), i);
    }
  }
  return r;
}

std::string kinds_str(const std::vector<LayerKind>& ks) {
  std::string s;
  for (LayerKind k : ks) s += layer_kind_char(k);
  return s;
}

}  // namespace

// Python's json.dump writes Infinity / -Infinity / NaN, which nlohmann rejects. Outside string literals they
// are rewritten as the strings "Infinity" / "-Infinity" / "NaN", which the float reader accepts.
std::string quote_nonfinite_literals(const std::string& text) {
  std::string out;
  out.reserve(text.size() + 16);
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      out += c;
      if (c == '\\' && i + 1 < text.size()) {
        out += text[++i];
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
      out += c;
      continue;
    }
    // Only a byte that can start a literal is compared against the three of them (one test per byte elsewhere).
    bool replaced = false;
    if (c == '-' || c == 'I' || c == 'N') {
      static constexpr std::string_view kLiterals[] = {"-Infinity", "Infinity", "NaN"};
      for (std::string_view lit : kLiterals) {
        if (std::string_view(text).substr(i, lit.size()) == lit) {
          out += '"';
          out += lit;
          out += '"';
          i += lit.size() - 1;
          replaced = true;
          break;
        }
      }
    }
    if (!replaced) out += c;
  }
  return out;
}

namespace {

json parse_json_text(const std::string& text, const std::string& source) {
  const json j = parse_json(quote_nonfinite_literals(text), source.empty() ? std::string("config") : source);
  if (!j.is_object()) invalid_input("{}must be a JSON object, got {}", prefix(source), j.type_name());
  return j;
}

// Typed field access with aliases: the canonical name first, then legacy spellings. When two spellings are
// present they must agree (an old config writes both `layer_norm_epsilon` and `rms_norm_eps`).
class Fields {
 public:
  Fields(const json& j, std::string source) : j_(j), source_(std::move(source)) {}

  // The first non-null value among `names`, with the name it was found under.
  const json* find(std::initializer_list<const char*> names, std::string* found_as = nullptr) const {
    const json* r = nullptr;
    std::string r_name;
    for (const char* n : names) {
      const auto it = j_.find(n);
      if (it == j_.end() || it->is_null()) continue;
      if (!r) {
        r = &*it;
        r_name = n;
      } else if (*it != *r) {
        invalid_input("{}fields '{}' ({}) and '{}' ({}) disagree", prefix(source_), r_name, r->dump(), n, it->dump());
      }
    }
    if (found_as) *found_as = r_name;
    return r;
  }

  void get(std::initializer_list<const char*> names, int64_t& out) const {
    std::string n;
    const json* v = find(names, &n);
    if (!v) return;
    if (!v->is_number_integer()) type_error(n, *v, "an integer");
    if (v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) type_error(n, *v, "an int64");
    out = v->get<int64_t>();
  }
  void get(std::initializer_list<const char*> names, std::optional<int64_t>& out) const {
    if (!find(names)) return;
    int64_t x = 0;
    get(names, x);
    out = x;
  }
  void get(std::initializer_list<const char*> names, bool& out) const {
    std::string n;
    const json* v = find(names, &n);
    if (!v) return;
    if (!v->is_boolean()) type_error(n, *v, "a boolean");
    out = v->get<bool>();
  }
  void get(std::initializer_list<const char*> names, std::string& out) const {
    std::string n;
    const json* v = find(names, &n);
    if (!v) return;
    if (!v->is_string()) type_error(n, *v, "a string");
    out = v->get<std::string>();
  }
  void get(std::initializer_list<const char*> names, float& out) const {
    std::string n;
    const json* v = find(names, &n);
    if (v) out = to_float(*v, n);
  }

  float to_float(const json& v, const std::string& field) const {
    if (v.is_number()) return v.get<float>();
    // transformers 5.x's config serialiser writes non-finite floats as {"__float__": "Infinity"}.
    const json* str = &v;
    if (v.is_object() && v.size() == 1 && v.contains("__float__")) str = &v.at("__float__");
    if (str->is_string()) {
      const std::string s = str->get<std::string>();
      if (s == "Infinity") return std::numeric_limits<float>::infinity();
      if (s == "-Infinity") return -std::numeric_limits<float>::infinity();
      if (s == "NaN") return std::numeric_limits<float>::quiet_NaN();
    }
    type_error(field, v, "a number");
  }

  [[noreturn]] void type_error(const std::string& field, const json& v, const char* want) const {
    invalid_input("{}field '{}' must be {}, got {} {}", prefix(source_), field, want, v.type_name(), v.dump());
  }

  // An int or a list of ints (eos_token_id).
  std::optional<std::vector<int64_t>> int_or_list(const char* name) const {
    const json* v = find({name});
    if (!v) return std::nullopt;
    std::vector<int64_t> r;
    auto id = [&](const json& e) {
      if (!e.is_number_integer() || (e.is_number_unsigned() && e.get<uint64_t>() > INT32_MAX) ||
          (!e.is_number_unsigned() && (e.get<int64_t>() < 0 || e.get<int64_t>() > INT32_MAX))) {
        type_error(name, *v, "a token id (0 <= id < 2^31) or a list of them");
      }
      return e.get<int64_t>();
    };
    if (v->is_number_integer()) {
      r.push_back(id(*v));
      return r;
    }
    if (!v->is_array()) type_error(name, *v, "an integer or a list of integers");
    for (const auto& e : *v) r.push_back(id(e));
    return r;
  }

  // A layer pattern given as a string field and/or a list field; both present -> they must agree.
  std::optional<std::vector<LayerKind>> pattern(const char* string_field, const char* list_field) const {
    std::optional<std::vector<LayerKind>> from_string, from_list;
    if (const json* s = find({string_field})) {
      if (!s->is_string()) type_error(string_field, *s, "a string");
      from_string = parse_pattern(s->get<std::string>(), string_field, source_);
    }
    if (const json* l = find({list_field})) from_list = parse_block_types(*l, list_field, source_);
    if (from_string && from_list && *from_string != *from_list) {
      invalid_input("{}fields '{}' (\"{}\") and '{}' (\"{}\") disagree", prefix(source_), string_field,
                    kinds_str(*from_string), list_field, kinds_str(*from_list));
    }
    return from_string ? from_string : from_list;
  }

  const std::string& source() const { return source_; }

 private:
  const json& j_;
  std::string source_;
};

bool has_kind(const std::vector<LayerKind>& ks, LayerKind k) {
  return std::find(ks.begin(), ks.end(), k) != ks.end();
}

// Special ids must be rows of the embedding: an eos_token_id outside the vocabulary never matches a sampled
// token, so generation would silently run to the length cap. pad_token_id may be unset-like (HF writes it but
// Chimera never pads); it is checked too, as a mistyped one is an edit worth reporting.
void validate_token_ids(const ModelConfig& c, const std::string& source) {
  const std::string p = prefix(source);
  for (int64_t id : c.eos_token_ids) {
    if (id < 0 || id >= c.vocab_size) {
      invalid_input("{}eos_token_id {} is outside the vocabulary [0, {}) of vocab_size", p, id, c.vocab_size);
    }
  }
  if (c.bos_token_id < 0 || c.bos_token_id >= c.vocab_size) {
    invalid_input("{}bos_token_id {} is outside the vocabulary [0, {}) of vocab_size", p, c.bos_token_id, c.vocab_size);
  }
}

void validate(const ModelConfig& c, const std::string& source) {
  const std::string p = prefix(source);
  const std::pair<const char*, int64_t> positive[] = {
      {"vocab_size", c.vocab_size},
      {"hidden_size", c.hidden_size},
      {"num_attention_heads", c.num_attention_heads},
      {"num_key_value_heads", c.num_key_value_heads},
      {"head_dim", c.head_dim},
      {"max_position_embeddings", c.max_position_embeddings},
      {"intermediate_size", c.intermediate_size},
      {"mamba_num_heads", c.mamba_num_heads},
      {"mamba_head_dim", c.mamba_head_dim},
      {"ssm_state_size", c.ssm_state_size},
      {"n_groups", c.n_groups},
      {"conv_kernel", c.conv_kernel},
      {"expand", c.expand},
      {"chunk_size", c.chunk_size},
      {"n_routed_experts", c.n_routed_experts},
      {"num_experts_per_tok", c.num_experts_per_tok},
      {"moe_intermediate_size", c.moe_intermediate_size},
      {"moe_shared_expert_intermediate_size", c.moe_shared_expert_intermediate_size},
      {"n_group", c.n_group},
      {"topk_group", c.topk_group},
  };
  // Upper bounds keep every size derived from the config (products of a few of these, the memory plan's
  // checked sums) inside int64 and say at once when a field was mistyped; real models are far below them.
  for (const auto& [name, v] : positive) {
    if (v <= 0) invalid_input("{}field '{}' must be positive, got {}", p, name, v);
    const bool token_count = std::strcmp(name, "vocab_size") == 0 || std::strcmp(name, "max_position_embeddings") == 0;
    const int64_t limit = token_count ? kMaxConfigTokens : kMaxConfigDim;
    if (v > limit) invalid_input("{}field '{}' is {}, above the supported maximum {}", p, name, v, limit);
  }
  if (c.sliding_window && *c.sliding_window > kMaxConfigTokens) {
    invalid_input("{}field 'sliding_window' is {}, above the supported maximum {}", p, *c.sliding_window,
                  kMaxConfigTokens);
  }
  if (c.moe_latent_size && *c.moe_latent_size > kMaxConfigDim) {
    invalid_input("{}field 'moe_latent_size' is {}, above the supported maximum {}", p, *c.moe_latent_size,
                  kMaxConfigDim);
  }
  if (c.n_shared_experts > kMaxConfigDim || c.num_nextn_predict_layers > kMaxConfigDim) {
    invalid_input("{}fields 'n_shared_experts' ({}) and 'num_nextn_predict_layers' ({}) must be at most {}", p,
                  c.n_shared_experts, c.num_nextn_predict_layers, kMaxConfigDim);
  }
  if (c.sliding_window && *c.sliding_window <= 0) {
    invalid_input("{}field 'sliding_window' must be positive or null, got {}", p, *c.sliding_window);
  }
  if (c.moe_latent_size && *c.moe_latent_size <= 0) {
    invalid_input("{}field 'moe_latent_size' must be positive or null, got {}", p, *c.moe_latent_size);
  }
  if (c.n_shared_experts < 0) invalid_input("{}field 'n_shared_experts' must be >= 0, got {}", p, c.n_shared_experts);
  if (c.num_nextn_predict_layers < 0) {
    invalid_input("{}field 'num_nextn_predict_layers' must be >= 0, got {}", p, c.num_nextn_predict_layers);
  }
  if (!(c.layer_norm_epsilon > 0.0f) || !std::isfinite(c.layer_norm_epsilon)) {
    invalid_input("{}field 'layer_norm_epsilon' must be a positive finite number, got {}", p, c.layer_norm_epsilon);
  }
  if (c.mamba_num_heads % c.n_groups != 0) {
    invalid_input("{}mamba_num_heads ({}) must be divisible by n_groups ({})", p, c.mamba_num_heads, c.n_groups);
  }
  if (c.num_attention_heads % c.num_key_value_heads != 0) {
    invalid_input("{}num_attention_heads ({}) must be divisible by num_key_value_heads ({})", p,
                  c.num_attention_heads, c.num_key_value_heads);
  }
  if ((has_kind(c.layers, LayerKind::kMoe) || has_kind(c.mtp_layers, LayerKind::kMoe)) &&
      c.num_experts_per_tok > c.n_routed_experts) {
    invalid_input("{}num_experts_per_tok ({}) must not exceed n_routed_experts ({})", p, c.num_experts_per_tok,
                  c.n_routed_experts);
  }
  if (c.n_routed_experts % c.n_group != 0) {
    invalid_input("{}n_routed_experts ({}) must be divisible by n_group ({})", p, c.n_routed_experts, c.n_group);
  }
  if (c.topk_group > c.n_group) {
    invalid_input("{}topk_group ({}) must not exceed n_group ({})", p, c.topk_group, c.n_group);
  }
  if (c.mlp_hidden_act != "relu2") {
    invalid_input("{}field 'mlp_hidden_act' is '{}'; only 'relu2' is supported", p, c.mlp_hidden_act);
  }
  if (c.mamba_hidden_act != "silu") {
    invalid_input("{}field 'mamba_hidden_act' is '{}'; only 'silu' is supported", p, c.mamba_hidden_act);
  }
  validate_token_ids(c, source);
  if (c.time_step_limit_min > c.time_step_limit_max) {
    invalid_input("{}field 'time_step_limit' has min {} > max {}", p, c.time_step_limit_min, c.time_step_limit_max);
  }
}


}  // namespace

std::vector<LayerKind> parse_layer_pattern(const std::string& pattern, const std::string& field) {
  return parse_pattern(pattern, field, "");
}

ModelConfig parse_model_config(const std::string& json_text, const std::string& source) {
  const json j = parse_json_text(json_text, source);
  const Fields f(j, source);
  const std::string p = prefix(source);
  ModelConfig c;

  const auto mt = j.find("model_type");
  if (mt == j.end() || mt->is_null()) invalid_input("{}missing field 'model_type' (supported: nemotron_h)", p);
  if (!mt->is_string()) f.type_error("model_type", *mt, "a string");
  if (*mt != "nemotron_h") {
    invalid_input("{}model_type '{}' is not supported (supported: nemotron_h)", p, mt->get<std::string>());
  }

  f.get({"vocab_size"}, c.vocab_size);
  f.get({"hidden_size"}, c.hidden_size);

  auto layers = f.pattern("hybrid_override_pattern", "layers_block_type");
  if (!layers) invalid_input("{}no layer pattern: expected 'hybrid_override_pattern' or 'layers_block_type'", p);
  if (layers->empty()) invalid_input("{}the layer pattern is empty", p);
  c.layers = std::move(*layers);
  std::optional<int64_t> num_hidden_layers;
  f.get({"num_hidden_layers"}, num_hidden_layers);
  if (num_hidden_layers && *num_hidden_layers != c.num_hidden_layers()) {
    invalid_input("{}num_hidden_layers is {} but the layer pattern has {} layers", p, *num_hidden_layers,
                  c.num_hidden_layers());
  }

  f.get({"num_attention_heads"}, c.num_attention_heads);
  f.get({"num_key_value_heads"}, c.num_key_value_heads);
  f.get({"head_dim", "attention_head_dim"}, c.head_dim);
  f.get({"attention_bias"}, c.attention_bias);
  f.get({"max_position_embeddings"}, c.max_position_embeddings);
  f.get({"sliding_window"}, c.sliding_window);

  f.get({"intermediate_size"}, c.intermediate_size);
  f.get({"mlp_hidden_act"}, c.mlp_hidden_act);
  f.get({"mlp_bias"}, c.mlp_bias);

  f.get({"mamba_num_heads"}, c.mamba_num_heads);
  f.get({"mamba_head_dim"}, c.mamba_head_dim);
  f.get({"ssm_state_size"}, c.ssm_state_size);
  f.get({"n_groups", "mamba_n_groups"}, c.n_groups);
  f.get({"conv_kernel", "mamba_d_conv"}, c.conv_kernel);
  f.get({"expand", "mamba_expand"}, c.expand);
  f.get({"chunk_size", "mamba_chunk_size"}, c.chunk_size);
  f.get({"use_conv_bias", "mamba_conv_bias"}, c.use_conv_bias);
  f.get({"use_bias"}, c.use_bias);
  f.get({"mamba_hidden_act"}, c.mamba_hidden_act);
  std::string limit_field;
  if (const json* lim = f.find({"time_step_limit", "mamba_dt_limit"}, &limit_field)) {
    if (!lim->is_array() || lim->size() != 2) f.type_error(limit_field, *lim, "a [min, max] list");
    // null ends mean "unbounded": (0, inf) is HF's default and a no-op clamp.
    if (!(*lim)[0].is_null()) c.time_step_limit_min = f.to_float((*lim)[0], limit_field);
    if (!(*lim)[1].is_null()) c.time_step_limit_max = f.to_float((*lim)[1], limit_field);
  }
  f.get({"time_step_min", "mamba_dt_min"}, c.time_step_min);
  f.get({"time_step_max", "mamba_dt_max"}, c.time_step_max);
  f.get({"time_step_floor", "mamba_dt_init_floor"}, c.time_step_floor);
  f.get({"mamba_ssm_cache_dtype"}, c.mamba_ssm_cache_dtype);

  f.get({"n_routed_experts"}, c.n_routed_experts);
  f.get({"num_experts_per_tok"}, c.num_experts_per_tok);
  f.get({"moe_intermediate_size"}, c.moe_intermediate_size);
  f.get({"moe_shared_expert_intermediate_size"}, c.moe_shared_expert_intermediate_size);
  f.get({"n_shared_experts"}, c.n_shared_experts);
  f.get({"moe_latent_size"}, c.moe_latent_size);
  f.get({"routed_scaling_factor"}, c.routed_scaling_factor);
  f.get({"n_group"}, c.n_group);
  f.get({"topk_group"}, c.topk_group);
  f.get({"norm_topk_prob"}, c.norm_topk_prob);

  f.get({"num_nextn_predict_layers"}, c.num_nextn_predict_layers);
  if (auto mtp = f.pattern("mtp_hybrid_override_pattern", "mtp_layers_block_type")) c.mtp_layers = std::move(*mtp);

  f.get({"layer_norm_epsilon", "rms_norm_eps", "norm_eps"}, c.layer_norm_epsilon);
  f.get({"residual_in_fp32"}, c.residual_in_fp32);
  f.get({"tie_word_embeddings"}, c.tie_word_embeddings);
  f.get({"torch_dtype", "dtype"}, c.torch_dtype);

  f.get({"bos_token_id"}, c.bos_token_id);
  if (auto eos = f.int_or_list("eos_token_id")) c.eos_token_ids = std::move(*eos);
  f.get({"pad_token_id"}, c.pad_token_id);

  validate(c, source);
  return c;
}

void apply_generation_config(ModelConfig& c, const std::string& json_text, const std::string& source) {
  const json g = parse_json_text(json_text, source);
  const Fields f(g, source);
  if (auto eos = f.int_or_list("eos_token_id")) c.eos_token_ids = std::move(*eos);
  f.get({"bos_token_id"}, c.bos_token_id);
  f.get({"pad_token_id"}, c.pad_token_id);
  validate_token_ids(c, source);
}

ModelConfig load_model_config(const fs::path& model_dir) {
  const fs::path config_path = model_dir / "config.json";
  std::error_code ec;
  ModelConfig c = parse_model_config(read_text_file(config_path, "config file", kMaxConfigFileBytes),
                                     config_path.string());

  // generation_config.json, when present, decides the special ids used for generation (HF GenerationConfig).
  const fs::path gen_path = model_dir / "generation_config.json";
  if (fs::exists(gen_path, ec) || fs::is_symlink(gen_path, ec)) {
    apply_generation_config(c, read_text_file(gen_path, "generation config", kMaxConfigFileBytes), gen_path.string());
  }
  return c;
}

}  // namespace chimera
