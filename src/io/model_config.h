// ModelConfig: one validated view of a Hugging Face `config.json` for model_type "nemotron_h"
// (docs/model.md 1.2). Field names follow the config; legacy aliases are resolved by the parser.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace chimera {

// One mixer per layer (docs/model.md 1.1).
enum class LayerKind : uint8_t {
  kMamba,      // 'M'  linear_attention / mamba
  kAttention,  // '*'  full_attention / attention
  kMlp,        // '-'  mlp
  kMoe,        // 'E'  moe
};
char layer_kind_char(LayerKind k);         // 'M', '*', '-', 'E'
const char* layer_kind_name(LayerKind k);  // "mamba", "attention", "mlp", "moe"

struct ModelConfig {
  std::string model_type = "nemotron_h";
  int64_t vocab_size = 131072;
  int64_t hidden_size = 4096;
  std::vector<LayerKind> layers;  // from hybrid_override_pattern or layers_block_type
  int64_t num_hidden_layers() const { return static_cast<int64_t>(layers.size()); }

  // attention
  int64_t num_attention_heads = 32;
  int64_t num_key_value_heads = 8;
  int64_t head_dim = 128;  // legacy: attention_head_dim
  bool attention_bias = false;
  int64_t max_position_embeddings = 4096;
  std::optional<int64_t> sliding_window;

  // dense MLP
  int64_t intermediate_size = 21504;
  std::string mlp_hidden_act = "relu2";
  bool mlp_bias = false;

  // Mamba-2
  int64_t mamba_num_heads = 128;
  int64_t mamba_head_dim = 64;
  int64_t ssm_state_size = 128;
  int64_t n_groups = 8;      // legacy: mamba_n_groups
  int64_t conv_kernel = 4;   // legacy: mamba_d_conv
  int64_t expand = 2;        // legacy: mamba_expand (unused by the math)
  int64_t chunk_size = 128;  // legacy: mamba_chunk_size
  bool use_conv_bias = true; // legacy: mamba_conv_bias
  bool use_bias = false;
  std::string mamba_hidden_act = "silu";
  float time_step_limit_min = 0.0f;  // time_step_limit / mamba_dt_limit
  float time_step_limit_max = 1.0f / 0.0f;
  float time_step_min = 0.001f, time_step_max = 0.1f, time_step_floor = 1e-4f;
  std::string mamba_ssm_cache_dtype = "float32";

  // MoE
  int64_t n_routed_experts = 8;
  int64_t num_experts_per_tok = 2;
  int64_t moe_intermediate_size = 7688;
  int64_t moe_shared_expert_intermediate_size = 7688;
  int64_t n_shared_experts = 1;
  std::optional<int64_t> moe_latent_size;
  float routed_scaling_factor = 1.0f;
  int64_t n_group = 1;
  int64_t topk_group = 1;
  bool norm_topk_prob = true;

  // MTP (Nemotron 3 Super); kept for the MTP work, not used by the forward pass yet.
  int64_t num_nextn_predict_layers = 0;
  std::vector<LayerKind> mtp_layers;

  float layer_norm_epsilon = 1e-5f;  // aliases: rms_norm_eps, norm_eps
  bool residual_in_fp32 = false;     // ignored by HF native (docs/model.md 2.2)
  bool tie_word_embeddings = false;
  std::string torch_dtype = "bfloat16";  // "torch_dtype" or "dtype"

  int64_t bos_token_id = 1;
  std::vector<int64_t> eos_token_ids = {2};  // config eos_token_id, replaced by generation_config.json's
  int64_t pad_token_id = 0;

  // Derived sizes (docs/model.md 3.1).
  int64_t mamba_inner() const { return mamba_num_heads * mamba_head_dim; }             // Di
  int64_t conv_dim() const { return mamba_inner() + 2 * n_groups * ssm_state_size; }   // Cd
  int64_t in_proj_dim() const { return 2 * mamba_inner() + 2 * n_groups * ssm_state_size + mamba_num_heads; }
  int64_t moe_input_dim() const { return moe_latent_size.value_or(hidden_size); }
  std::string pattern() const;  // "M*-E..."
};

// Parses a pattern string ("M*-E") into layer kinds; unknown character -> kInvalidInput naming `field`,
// the character and its position.
std::vector<LayerKind> parse_layer_pattern(const std::string& pattern, const std::string& field);

// Bounds on config sizes (validate): dimensions (hidden_size, heads, experts, intermediate sizes, ...) and token
// counts (vocab_size, max_position_embeddings, sliding_window).
inline constexpr int64_t kMaxConfigDim = int64_t{1} << 20;
inline constexpr int64_t kMaxConfigTokens = int64_t{1} << 31;

// config.json text with Python's Infinity / -Infinity / NaN literals (outside strings) quoted, so that the JSON
// parser accepts it (HF configs write `"time_step_limit": [0.0, Infinity]`).
std::string quote_nonfinite_literals(const std::string& text);

// Reads and validates DIR/config.json (and DIR/generation_config.json for EOS ids when present).
// Every error is kInvalidInput and names the file and the field.
ModelConfig load_model_config(const std::filesystem::path& model_dir);
// Same, from JSON text; `source` names it in errors.
ModelConfig parse_model_config(const std::string& json_text, const std::string& source);
// Applies generation_config.json text (eos / bos / pad ids) to `c` and checks the ids against its vocabulary.
void apply_generation_config(ModelConfig& c, const std::string& json_text, const std::string& source);

}  // namespace chimera
