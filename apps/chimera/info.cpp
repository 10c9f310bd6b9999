// chimera info: the layer plan, parameter counts by layer kind, memory needed per weight dtype.
#include <algorithm>

#include <fmt/core.h>

#include "commands.h"
#include "model_loading.h"
#include "runtime/state_cache.h"

namespace chimera::cli {

void add_info(CLI::App& app, InfoOptions& o) {
  o.model_dir = default_model_dir();
  app.add_option("-m,--model", o.model_dir, "Model directory")->capture_default_str();
}

namespace {
std::string human_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024.0 && u < 4) {
    b /= 1024.0;
    ++u;
  }
  return fmt::format("{:.2f} {}", b, units[u]);
}
}  // namespace

int run_info(const InfoOptions& o) {
  LoadedModel m = load_model_dir(o.model_dir);
  const ModelConfig& c = m.config;
  fmt::print("model      {}\n", o.model_dir);
  fmt::print("type       {} | hidden {} | vocab {} | {} layers\n", c.model_type, c.hidden_size, c.vocab_size,
             c.num_hidden_layers());
  fmt::print("pattern    {}\n", c.pattern());
  for (LayerKind k : {LayerKind::kMamba, LayerKind::kAttention, LayerKind::kMlp, LayerKind::kMoe}) {
    const auto n = std::count(c.layers.begin(), c.layers.end(), k);
    if (n == 0) continue;
    std::string detail;
    switch (k) {
      case LayerKind::kMamba:
        detail = fmt::format("heads {} x {}, state {}, groups {}, conv {}, chunk {}", c.mamba_num_heads,
                             c.mamba_head_dim, c.ssm_state_size, c.n_groups, c.conv_kernel, c.chunk_size);
        break;
      case LayerKind::kAttention:
        detail = fmt::format("heads {} / kv {} x {}, no positional encoding", c.num_attention_heads,
                             c.num_key_value_heads, c.head_dim);
        break;
      case LayerKind::kMlp: detail = fmt::format("relu2, intermediate {}", c.intermediate_size); break;
      case LayerKind::kMoe:
        detail = fmt::format("{} experts top-{}, intermediate {}, shared {}, latent {}, scale {}", c.n_routed_experts,
                             c.num_experts_per_tok, c.moe_intermediate_size, c.moe_shared_expert_intermediate_size,
                             c.moe_latent_size ? std::to_string(*c.moe_latent_size) : "none",
                             c.routed_scaling_factor);
        break;
    }
    fmt::print("  {} {:<9} x{:<3} {}\n", layer_kind_char(k), layer_kind_name(k), n, detail);
  }
  if (c.num_nextn_predict_layers > 0) {
    std::string mtp;
    for (LayerKind k : c.mtp_layers) mtp += layer_kind_char(k);
    fmt::print("  MTP       {} block(s), pattern {} ({} tensors present)\n", c.num_nextn_predict_layers, mtp,
               m.model->mtp_tensors().size());
  }

  fmt::print("\nparameters\n");
  int64_t total = 0;
  for (const auto& [kind, n] : m.model->parameter_counts()) {
    fmt::print("  {:<11} {:>16}\n", kind, n);
    total += n;
  }
  fmt::print("  {:<11} {:>16}\n", "total", total);
  int64_t routed = 0;
  for (size_t i = 0; i < c.layers.size(); ++i) {
    if (c.layers[i] == LayerKind::kMoe) {
      routed += 2 * c.n_routed_experts * c.moe_intermediate_size * c.moe_input_dim();
    }
  }
  if (routed > 0) {
    const int64_t active = total - routed + routed / c.n_routed_experts * c.num_experts_per_tok;
    fmt::print("  {:<11} {:>16}  (per token: top-{} of {} experts)\n", "active", active, c.num_experts_per_tok,
               c.n_routed_experts);
  }

  fmt::print("\nmemory for weights\n");
  for (auto [name, bytes] : {std::pair{"fp32", 4.0}, {"bf16/fp16", 2.0}, {"fp8", 1.0}}) {
    fmt::print("  {:<11} {:>14}\n", name, human_bytes(static_cast<double>(total) * bytes));
  }
  fmt::print("\nmemory for state\n");
  fmt::print("  Mamba state (conv + SSM, fp32) per sequence  {}\n",
             human_bytes(static_cast<double>(StateCache::mamba_state_bytes_per_seq(c))));
  fmt::print("  KV cache (fp32) per token                    {}\n",
             human_bytes(static_cast<double>(StateCache::kv_bytes_per_token(c))));
  fmt::print("  KV cache (bf16) per token                    {}\n",
             human_bytes(static_cast<double>(StateCache::kv_bytes_per_token(c)) / 2));
  return 0;
}

}  // namespace chimera::cli
