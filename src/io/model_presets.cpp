#include "io/model_presets.h"

#include <utility>

#include "core/error.h"

namespace chimera {
namespace {

// config.json fields as published (docs/model.md section 9, verbatim copies where one was found). Fields left
// out take the HF defaults of docs/model.md 1.2, which the published files repeat.
constexpr const char* kNemotronH8B = R"({
  "model_type": "nemotron_h", "vocab_size": 131072, "hidden_size": 4096,
  "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
  "num_hidden_layers": 52, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
  "intermediate_size": 21504, "mlp_hidden_act": "relu2",
  "mamba_num_heads": 128, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8,
  "conv_kernel": 4, "chunk_size": 128, "use_conv_bias": true, "use_bias": false,
  "max_position_embeddings": 8192, "layer_norm_epsilon": 1e-5, "tie_word_embeddings": false,
  "residual_in_fp32": false, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "torch_dtype": "bfloat16"
})";

constexpr const char* kNemotron3Nano30B = R"({
  "model_type": "nemotron_h", "vocab_size": 131072, "hidden_size": 2688,
  "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
  "num_hidden_layers": 52, "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128,
  "intermediate_size": 1856, "mlp_hidden_act": "relu2",
  "mamba_num_heads": 64, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8,
  "conv_kernel": 4, "chunk_size": 128, "use_conv_bias": true, "use_bias": false,
  "n_routed_experts": 128, "num_experts_per_tok": 6, "moe_intermediate_size": 1856,
  "moe_shared_expert_intermediate_size": 3712, "n_shared_experts": 1, "moe_latent_size": null,
  "routed_scaling_factor": 2.5, "n_group": 1, "topk_group": 1, "norm_topk_prob": true,
  "max_position_embeddings": 262144, "layer_norm_epsilon": 1e-5, "tie_word_embeddings": false,
  "residual_in_fp32": false, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "torch_dtype": "bfloat16"
})";

constexpr const char* kNemotron3Super120B = R"({
  "model_type": "nemotron_h", "vocab_size": 131072, "hidden_size": 4096,
  "hybrid_override_pattern": "MEMEMEM*EMEMEMEM*EMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEM*EMEMEMEME",
  "num_hidden_layers": 88, "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128,
  "intermediate_size": 2688, "mlp_hidden_act": "relu2",
  "mamba_num_heads": 128, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8,
  "conv_kernel": 4, "chunk_size": 128, "use_conv_bias": true, "use_bias": false,
  "n_routed_experts": 512, "num_experts_per_tok": 22, "moe_intermediate_size": 2688,
  "moe_shared_expert_intermediate_size": 5376, "n_shared_experts": 1, "moe_latent_size": 1024,
  "routed_scaling_factor": 5.0, "n_group": 1, "topk_group": 1, "norm_topk_prob": true,
  "num_nextn_predict_layers": 1, "mtp_hybrid_override_pattern": "*E",
  "max_position_embeddings": 262144, "layer_norm_epsilon": 1e-5, "tie_word_embeddings": false,
  "residual_in_fp32": false, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "torch_dtype": "bfloat16"
})";

// Every layer kind and the LatentMoE projection, a few MB; the vocab matches the bundled tiny model's
// tokenizer (models/nemotron-h-tiny) so the CLI can print text.
constexpr const char* kTiny = R"({
  "model_type": "nemotron_h", "vocab_size": 4096, "hidden_size": 128,
  "hybrid_override_pattern": "MEM*EM-E", "num_hidden_layers": 8,
  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
  "intermediate_size": 256, "mlp_hidden_act": "relu2",
  "mamba_num_heads": 8, "mamba_head_dim": 32, "ssm_state_size": 32, "n_groups": 2,
  "conv_kernel": 4, "chunk_size": 64, "use_conv_bias": true, "use_bias": false,
  "n_routed_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 128,
  "moe_shared_expert_intermediate_size": 256, "n_shared_experts": 1, "moe_latent_size": 64,
  "routed_scaling_factor": 2.5, "n_group": 1, "topk_group": 1, "norm_topk_prob": true,
  "max_position_embeddings": 4096, "layer_norm_epsilon": 1e-5, "tie_word_embeddings": false,
  "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "torch_dtype": "bfloat16"
})";

const std::pair<const char*, const char*> kPresets[] = {
    {"nemotron-h-8b", kNemotronH8B},
    {"nemotron-3-nano-30b-a3b", kNemotron3Nano30B},
    {"nemotron-3-super-120b-a12b", kNemotron3Super120B},
    {"tiny", kTiny},
};

}  // namespace

std::vector<std::string> model_preset_names() {
  std::vector<std::string> names;
  for (const auto& [name, json] : kPresets) names.emplace_back(name);
  return names;
}

ModelConfig model_preset(const std::string& name) {
  for (const auto& [preset, json] : kPresets) {
    if (name == preset) return parse_model_config(json, "preset '" + name + "'");
  }
  std::string list;
  for (const std::string& n : model_preset_names()) list += (list.empty() ? "" : ", ") + n;
  invalid_input("--synthetic: unknown preset '{}' (presets: {})", name, list);
}

void truncate_layers(ModelConfig& config, int64_t num_layers) {
  if (num_layers < 1 || num_layers > config.num_hidden_layers()) {
    invalid_input("--num-layers: {} is out of range, the model has {} layers", num_layers, config.num_hidden_layers());
  }
  if (num_layers == config.num_hidden_layers()) return;
  // The MTP head stays (it reads the last layer's output, whichever that is), so speculative decoding can be measured
  // at a large model's shapes on one device.
  config.layers.resize(static_cast<size_t>(num_layers));
}

}  // namespace chimera
