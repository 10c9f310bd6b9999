#include "runtime/memory_plan.h"

#include <algorithm>

#include <fmt/core.h>

#include "core/error.h"

namespace chimera {
namespace {

int64_t count(const ModelConfig& c, LayerKind k) {
  return static_cast<int64_t>(std::count(c.layers.begin(), c.layers.end(), k));
}

}  // namespace

// Shapes of docs/model.md 2.1 (the loader's name table in models/nemotron_h.cpp); each layer's pre-mixer norm
// counts with its kind, as in NemotronH::parameter_counts().
std::map<std::string, int64_t> parameter_counts(const ModelConfig& c) {
  const int64_t D = c.hidden_size, H = c.mamba_num_heads, Di = c.mamba_inner(), Cd = c.conv_dim();
  const int64_t mamba = c.in_proj_dim() * D + (c.use_bias ? c.in_proj_dim() + D : 0) + Cd * c.conv_kernel +
                        (c.use_conv_bias ? Cd : 0) + 3 * H + Di + D * Di;
  const int64_t q = c.num_attention_heads * c.head_dim, kv = c.num_key_value_heads * c.head_dim;
  const int64_t attention = 2 * q * D + 2 * kv * D;
  const int64_t mlp = 2 * c.intermediate_size * D;
  const int64_t E = c.n_routed_experts;
  const int64_t moe = E * D + E + E * 2 * c.moe_intermediate_size * c.moe_input_dim() +
                      2 * c.moe_shared_expert_intermediate_size * D +
                      (c.moe_latent_size ? 2 * *c.moe_latent_size * D : 0);
  std::map<std::string, int64_t> n;
  n["embeddings"] = c.vocab_size * D;
  n["lm_head"] = c.vocab_size * D;
  n["norm_f"] = D;
  for (const auto& [kind, per_layer] : {std::pair{LayerKind::kMamba, mamba},
                                        {LayerKind::kAttention, attention},
                                        {LayerKind::kMlp, mlp},
                                        {LayerKind::kMoe, moe}}) {
    if (count(c, kind)) n[layer_kind_name(kind)] = count(c, kind) * (per_layer + D);
  }
  return n;
}

int64_t parameter_count(const ModelConfig& c) {
  int64_t total = 0;
  for (const auto& [kind, n] : parameter_counts(c)) total += n;
  return total;
}

int64_t fp32_parameter_count(const ModelConfig& c) {
  return count(c, LayerKind::kMamba) * 3 * c.mamba_num_heads +
         count(c, LayerKind::kMoe) * (c.n_routed_experts * c.hidden_size + c.n_routed_experts);
}

MemoryPlan plan_memory(const ModelConfig& c, DType weight_dtype, DType act_dtype, const MemoryLimits& limits) {
  const auto wsize = static_cast<int64_t>(dtype_size(weight_dtype));
  const auto asize = static_cast<int64_t>(dtype_size(act_dtype));
  const int64_t seqs = std::max(limits.max_num_seqs, 1), bs = std::max(limits.block_size, 1);
  const int64_t tokens_per_seq = (std::max(limits.max_model_len, 1) + bs - 1) / bs * bs;
  MemoryPlan p;
  const int64_t f32 = fp32_parameter_count(c);
  p.weights = static_cast<size_t>((parameter_count(c) - f32) * wsize + f32 * 4);
  p.kv_cache = static_cast<size_t>(count(c, LayerKind::kAttention) * 2 * c.num_key_value_heads * c.head_dim * asize *
                                   tokens_per_seq * seqs);
  const int64_t mamba_per_seq =
      c.conv_dim() * (c.conv_kernel - 1) * asize + c.mamba_num_heads * c.mamba_head_dim * c.ssm_state_size * 4;
  p.mamba_state = static_cast<size_t>(count(c, LayerKind::kMamba) * mamba_per_seq * seqs);

  // Widest intermediates of one token in each mixer kind present (what the forward pass keeps live).
  const int64_t D = c.hidden_size;
  int64_t widest = 0;
  if (count(c, LayerKind::kMamba)) widest = std::max(widest, c.in_proj_dim() + c.conv_dim() + 3 * c.mamba_inner());
  if (count(c, LayerKind::kAttention)) {
    widest = std::max(widest, 2 * (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim);
  }
  if (count(c, LayerKind::kMlp)) widest = std::max(widest, 2 * c.intermediate_size);
  if (count(c, LayerKind::kMoe)) {
    widest = std::max(widest, c.num_experts_per_tok * (2 * c.moe_intermediate_size + 2 * c.moe_input_dim()) +
                                  2 * c.moe_shared_expert_intermediate_size + 2 * c.n_routed_experts +
                                  2 * c.moe_latent_size.value_or(0));
  }
  const int64_t tokens = std::max(limits.max_tokens_per_step, 1);
  // 5 x D per token: the residual stream's two buffers (NemotronH::forward_device alternates them), the normed
  // input, the mixer output and the MoE layer's routed output.
  p.workspace = static_cast<size_t>(tokens * (5 * D + widest) * asize + seqs * c.vocab_size * 4 * 2);
  return p;
}

std::string gib(size_t bytes) {
  return fmt::format("{:.2f} GiB", static_cast<double>(bytes) / (1ull << 30));
}

void check_memory_plan(const MemoryPlan& p, size_t free_bytes, const std::string& device_name) {
  if (p.total() <= free_bytes) return;
  invalid_input("needs {} (weights {}, KV {}, Mamba state {}, workspace {}) but the {} has {} free", gib(p.total()),
                gib(p.weights), gib(p.kv_cache), gib(p.mamba_state), gib(p.workspace), device_name, gib(free_bytes));
}

}  // namespace chimera
