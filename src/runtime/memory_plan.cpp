#include "runtime/memory_plan.h"

#include <algorithm>

#include <fmt/core.h>

#include "core/error.h"

namespace chimera {
namespace {

int64_t count(const ModelConfig& c, LayerKind k) {
  return static_cast<int64_t>(std::count(c.layers.begin(), c.layers.end(), k));
}

// Checked int64 arithmetic for sizes: a product or sum beyond int64 is an error naming what was being sized,
// never a wrapped (smaller) number that a fit check would pass.
struct Checked {
  const char* what;
  int64_t mul(std::initializer_list<int64_t> factors) const {
    int64_t r = 1;
    for (int64_t f : factors) {
      if (__builtin_mul_overflow(r, f, &r)) overflow();
    }
    return r;
  }
  int64_t add(std::initializer_list<int64_t> terms) const {
    int64_t r = 0;
    for (int64_t t : terms) {
      if (__builtin_add_overflow(r, t, &r)) overflow();
    }
    return r;
  }
  [[noreturn]] void overflow() const {
    invalid_input("memory plan: the size of the {} overflows 64-bit arithmetic (the config's sizes or the serving "
                  "limits are too large)",
                  what);
  }
};

}  // namespace

// Shapes of docs/model.md 2.1 (the loader's name table in models/nemotron_h.cpp); each layer's pre-mixer norm
// counts with its kind, as in NemotronH::parameter_counts().
std::map<std::string, int64_t> parameter_counts(const ModelConfig& c) {
  const Checked k{"parameters"};
  const int64_t D = c.hidden_size, H = c.mamba_num_heads, Di = c.mamba_inner(), Cd = c.conv_dim();
  const int64_t P = c.in_proj_dim();
  const int64_t mamba = k.add({k.mul({P, D}), c.use_bias ? k.add({P, D}) : 0, k.mul({Cd, c.conv_kernel}),
                               c.use_conv_bias ? Cd : 0, k.mul({3, H}), Di, k.mul({D, Di})});
  const int64_t q = k.mul({c.num_attention_heads, c.head_dim}), kv = k.mul({c.num_key_value_heads, c.head_dim});
  const int64_t attention = k.add({k.mul({2, q, D}), k.mul({2, kv, D})});
  const int64_t mlp = k.mul({2, c.intermediate_size, D});
  const int64_t E = c.n_routed_experts;
  const int64_t moe = k.add({k.mul({E, D}), E, k.mul({E, 2, c.moe_intermediate_size, c.moe_input_dim()}),
                             k.mul({2, c.moe_shared_expert_intermediate_size, D}),
                             c.moe_latent_size ? k.mul({2, *c.moe_latent_size, D}) : 0});
  std::map<std::string, int64_t> n;
  n["embeddings"] = k.mul({c.vocab_size, D});
  n["lm_head"] = k.mul({c.vocab_size, D});
  n["norm_f"] = D;
  for (const auto& [kind, per_layer] : {std::pair{LayerKind::kMamba, mamba},
                                        {LayerKind::kAttention, attention},
                                        {LayerKind::kMlp, mlp},
                                        {LayerKind::kMoe, moe}}) {
    if (count(c, kind)) n[layer_kind_name(kind)] = k.mul({count(c, kind), k.add({per_layer, D})});
  }
  return n;
}

int64_t parameter_count(const ModelConfig& c) {
  const Checked k{"parameters"};
  int64_t total = 0;
  for (const auto& [kind, n] : parameter_counts(c)) total = k.add({total, n});
  return total;
}

int64_t fp32_parameter_count(const ModelConfig& c) {
  const Checked k{"parameters"};
  return k.add({k.mul({count(c, LayerKind::kMamba), 3, c.mamba_num_heads}),
                k.mul({count(c, LayerKind::kMoe), k.add({k.mul({c.n_routed_experts, c.hidden_size}), c.n_routed_experts})})});
}

std::map<std::string, int64_t> weight_bytes(const ModelConfig& c, DType weight_dtype, ops::WeightFormat f) {
  const Checked k{"weights"};
  const auto wsize = static_cast<int64_t>(dtype_size(weight_dtype));
  const int64_t D = c.hidden_size, E = c.n_routed_experts;
  // Per layer of each kind: the linear layers' parameters, their number, and the fp32 parameters.
  struct Linear {
    int64_t params = 0, modules = 0, f32 = 0;
  };
  const int64_t q = k.mul({c.num_attention_heads, c.head_dim}), kv = k.mul({c.num_key_value_heads, c.head_dim});
  const std::map<LayerKind, Linear> linear = {
      {LayerKind::kMamba, {k.add({k.mul({c.in_proj_dim(), D}), k.mul({D, c.mamba_inner()})}), 2, 3 * c.mamba_num_heads}},
      {LayerKind::kAttention, {k.add({k.mul({2, q, D}), k.mul({2, kv, D})}), 4, 0}},
      {LayerKind::kMlp, {k.mul({2, c.intermediate_size, D}), 2, 0}},
      {LayerKind::kMoe,
       {k.add({k.mul({E, 2, c.moe_intermediate_size, c.moe_input_dim()}),
               k.mul({2, c.moe_shared_expert_intermediate_size, D}),
               c.moe_latent_size ? k.mul({2, *c.moe_latent_size, D}) : 0}),
        2 * E + 2 + (c.moe_latent_size ? 2 : 0), k.add({k.mul({E, D}), E})}},
  };
  auto stored = [&](int64_t params, int64_t modules) {
    switch (f) {
      case ops::WeightFormat::kDense: return k.mul({params, wsize});
      case ops::WeightFormat::kFp8: return k.add({params, k.mul({modules, 4})});
      case ops::WeightFormat::kNvfp4: return k.add({params / 2, params / 16, k.mul({modules, 4})});
    }
    return k.mul({params, wsize});
  };
  std::map<std::string, int64_t> r;
  for (const auto& [kind, n] : parameter_counts(c)) {
    int64_t bytes = k.mul({n, wsize});
    for (const auto& [lk, l] : linear) {
      if (kind != layer_kind_name(lk)) continue;
      const int64_t layers = count(c, lk);
      const int64_t rest = n - k.mul({layers, k.add({l.params, l.f32})});
      bytes = k.add({k.mul({rest, wsize}), k.mul({layers, l.f32, 4}), k.mul({layers, stored(l.params, l.modules)})});
    }
    r[kind] = bytes;
  }
  return r;
}

MemoryPlan plan_memory(const ModelConfig& c, DType weight_dtype, DType act_dtype, const MemoryLimits& limits,
                       ops::WeightFormat linear_format) {
  const auto asize = static_cast<int64_t>(dtype_size(act_dtype));
  const int64_t seqs = std::max(limits.max_num_seqs, 1), bs = std::max(limits.block_size, 1);
  // Rounded up to whole blocks in int64: max_model_len near INT32_MAX does not wrap.
  const int64_t tokens_per_seq = (static_cast<int64_t>(std::max(limits.max_model_len, 1)) + bs - 1) / bs * bs;
  MemoryPlan p;
  const Checked kw{"weights"};
  int64_t weights = 0;
  for (const auto& [kind, b] : weight_bytes(c, weight_dtype, linear_format)) weights = kw.add({weights, b});
  p.weights = static_cast<size_t>(weights);
  const Checked kk{"KV cache"};
  const int64_t pads = std::max(limits.graph_pad_rows, 0);
  const int64_t kv_tokens = kk.add({kk.mul({tokens_per_seq, seqs}), kk.mul({pads, bs})});
  p.kv_cache = static_cast<size_t>(
      kk.mul({count(c, LayerKind::kAttention), 2, c.num_key_value_heads, c.head_dim,
              limits.kv_cache_fp8 ? int64_t{1} : asize, kv_tokens}));
  const Checked km{"Mamba state"};
  const int64_t mamba_per_seq = km.add({km.mul({c.conv_dim(), c.conv_kernel - 1, asize}),
                                        km.mul({c.mamba_num_heads, c.mamba_head_dim, c.ssm_state_size,
                                                static_cast<int64_t>(dtype_size(limits.ssm_dtype))})});
  const int64_t checkpoints = std::max(limits.mamba_checkpoints, 0);
  p.mamba_checkpoints = static_cast<int32_t>(checkpoints);
  p.mamba_state =
      static_cast<size_t>(km.mul({count(c, LayerKind::kMamba), mamba_per_seq, km.add({seqs, pads, checkpoints})}));

  // Widest intermediates of one token in each mixer kind present (what the forward pass keeps live).
  const Checked ks{"workspace"};
  const int64_t D = c.hidden_size;
  int64_t widest = 0;
  if (count(c, LayerKind::kMamba)) {
    widest = std::max(widest, ks.add({c.in_proj_dim(), c.conv_dim(), ks.mul({3, c.mamba_inner()})}));
  }
  if (count(c, LayerKind::kAttention)) {
    widest = std::max(widest,
                      ks.mul({2, ks.add({c.num_attention_heads, ks.mul({2, c.num_key_value_heads})}), c.head_dim}));
  }
  if (count(c, LayerKind::kMlp)) widest = std::max(widest, ks.mul({2, c.intermediate_size}));
  if (count(c, LayerKind::kMoe)) {
    widest = std::max(
        widest, ks.add({ks.mul({c.num_experts_per_tok,
                                ks.add({ks.mul({2, c.moe_intermediate_size}), ks.mul({2, c.moe_input_dim()})})}),
                        ks.mul({2, c.moe_shared_expert_intermediate_size}), ks.mul({2, c.n_routed_experts}),
                        ks.mul({2, c.moe_latent_size.value_or(0)})}));
  }
  const int64_t tokens = std::max(limits.max_tokens_per_step, 1);
  // 5 x D per token: the residual stream's two buffers (NemotronH::forward_device alternates them), the normed
  // input, the mixer output and the MoE layer's routed output.
  p.workspace = static_cast<size_t>(ks.add({ks.mul({tokens, ks.add({ks.mul({5, D}), widest}), asize}),
                                            ks.mul({seqs, c.vocab_size, 4, 2})}));
  const Checked kt{"total"};
  kt.add({static_cast<int64_t>(p.weights), static_cast<int64_t>(p.kv_cache), static_cast<int64_t>(p.mamba_state),
          static_cast<int64_t>(p.workspace)});  // total() cannot wrap
  return p;
}

std::string gib(size_t bytes) {
  return fmt::format("{:.2f} GiB", static_cast<double>(bytes) / (1ull << 30));
}

void check_memory_plan(const MemoryPlan& p, size_t free_bytes, const std::string& device_name) {
  if (p.total() <= free_bytes) return;
  const std::string checkpoints =
      p.mamba_checkpoints > 0 ? fmt::format(" with {} checkpoints of --mamba-checkpoint-slots", p.mamba_checkpoints)
                              : "";
  invalid_input("needs {} (weights {}, KV {}, Mamba state {}{}, workspace {}) but the {} has {} free", gib(p.total()),
                gib(p.weights), gib(p.kv_cache), gib(p.mamba_state), checkpoints, gib(p.workspace), device_name,
                gib(free_bytes));
}

}  // namespace chimera
