// chimera info: the layer plan, parameter counts by layer kind, memory needed per weight dtype, and the memory
// plan for --max-num-seqs / --max-model-len against the device's free memory.
#include <algorithm>
#include <cmath>
#include <fstream>
#include <string>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "backends/device_api.h"
#include "commands.h"
#include "core/error.h"
#include "io/quant_config.h"
#include "model_loading.h"
#include "models/tensor_parallel.h"
#include "runtime/memory_plan.h"
#include "runtime/state_cache.h"

namespace chimera::cli {

void add_info(CLI::App& app, InfoOptions& o) {
  add_model_source(app, o.source);
  app.add_option("--max-num-seqs", o.max_num_seqs, "Memory plan: sequences in flight")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--max-model-len", o.max_model_len, "Memory plan: tokens per sequence")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--dtype", o.dtype, "Memory plan: weight and activation dtype on the GPU")
      ->check(CLI::IsMember({"bfloat16", "float16", "float32"}))
      ->capture_default_str();
  add_ssm_cache_dtype_flag(app, o.mamba_ssm_cache_dtype);
  add_kv_cache_dtype_flag(app, o.kv_cache_dtype);
  add_tensor_parallel_flag(app, o.tensor_parallel_size);
  app.add_option("--dump-config", o.dump_config,
                 "Write the model's config as a transformers config.json to FILE (e.g. a --synthetic preset, "
                 "for bench/peers/engine_peers.py)");
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

// transformers 5.x's layers_block_type names.
const char* hf_block_type(LayerKind k) {
  switch (k) {
    case LayerKind::kMamba: return "linear_attention";
    case LayerKind::kAttention: return "full_attention";
    case LayerKind::kMlp: return "mlp";
    case LayerKind::kMoe: return "moe";
  }
  return "?";
}

// A float as transformers' config serialiser writes it: non-finite values as {"__float__": "Infinity"}.
nlohmann::json hf_float(float v) {
  if (std::isinf(v)) return {{"__float__", v > 0 ? "Infinity" : "-Infinity"}};
  if (std::isnan(v)) return {{"__float__", "NaN"}};
  return std::stod(fmt::format("{}", v));  // the float's shortest decimal (1e-05), not its double expansion
}

// The config as transformers 5.x writes config.json (field names of the fixtures' config.json, every field of
// ModelConfig), so NemotronHConfig(**json) builds the same shapes. Layers are the (possibly truncated) list.
nlohmann::json hf_config_json(const ModelConfig& c) {
  using nlohmann::json;
  json blocks = json::array(), mtp = json::array();
  for (LayerKind k : c.layers) blocks.push_back(hf_block_type(k));
  for (LayerKind k : c.mtp_layers) mtp.push_back(hf_block_type(k));
  json j = {
      {"architectures", {"NemotronHForCausalLM"}},
      {"model_type", c.model_type},
      {"vocab_size", c.vocab_size},
      {"hidden_size", c.hidden_size},
      {"layers_block_type", blocks},
      {"num_attention_heads", c.num_attention_heads},
      {"num_key_value_heads", c.num_key_value_heads},
      {"head_dim", c.head_dim},
      {"attention_bias", c.attention_bias},
      {"max_position_embeddings", c.max_position_embeddings},
      {"sliding_window", c.sliding_window ? json(*c.sliding_window) : json(nullptr)},
      {"intermediate_size", c.intermediate_size},
      {"mlp_hidden_act", c.mlp_hidden_act},
      {"mlp_bias", c.mlp_bias},
      {"mamba_num_heads", c.mamba_num_heads},
      {"mamba_head_dim", c.mamba_head_dim},
      {"ssm_state_size", c.ssm_state_size},
      {"n_groups", c.n_groups},
      {"conv_kernel", c.conv_kernel},
      {"expand", c.expand},
      {"chunk_size", c.chunk_size},
      {"use_conv_bias", c.use_conv_bias},
      {"use_bias", c.use_bias},
      {"mamba_hidden_act", c.mamba_hidden_act},
      {"time_step_limit", {hf_float(c.time_step_limit_min), hf_float(c.time_step_limit_max)}},
      {"time_step_min", hf_float(c.time_step_min)},
      {"time_step_max", hf_float(c.time_step_max)},
      {"time_step_floor", hf_float(c.time_step_floor)},
      {"mamba_ssm_cache_dtype", c.mamba_ssm_cache_dtype},
      {"n_routed_experts", c.n_routed_experts},
      {"num_experts_per_tok", c.num_experts_per_tok},
      {"moe_intermediate_size", c.moe_intermediate_size},
      {"moe_shared_expert_intermediate_size", c.moe_shared_expert_intermediate_size},
      {"n_shared_experts", c.n_shared_experts},
      {"moe_latent_size", c.moe_latent_size ? json(*c.moe_latent_size) : json(nullptr)},
      {"routed_scaling_factor", hf_float(c.routed_scaling_factor)},
      {"n_group", c.n_group},
      {"topk_group", c.topk_group},
      {"norm_topk_prob", c.norm_topk_prob},
      {"num_nextn_predict_layers", c.num_nextn_predict_layers},
      {"layer_norm_epsilon", hf_float(c.layer_norm_epsilon)},
      {"residual_in_fp32", c.residual_in_fp32},
      {"tie_word_embeddings", c.tie_word_embeddings},
      {"dtype", c.torch_dtype},
      {"bos_token_id", c.bos_token_id},
      {"pad_token_id", c.pad_token_id},
  };
  if (!mtp.empty()) j["mtp_layers_block_type"] = mtp;
  j["eos_token_id"] = c.eos_token_ids.size() == 1 ? json(c.eos_token_ids[0]) : json(c.eos_token_ids);
  return j;
}
}  // namespace

int run_info(const InfoOptions& o) {
  // A checkpoint's weights are memory-mapped (cheap); a synthetic model's counts come from the config alone
  // (generating 120B random weights to count them would be absurd).
  LoadedModel m = load_model(o.source, /*with_weights=*/!o.source.is_synthetic());
  const ModelConfig& c = m.config;
  // The plan is for one of N ranks: a size that does not split fails here, naming the config field, as the
  // loader would.
  const int tp_size = o.tensor_parallel_size;
  check_tensor_parallel_size(tp_size, "cpu");  // the plan's numbers hold for any device
  if (tp_size > 1) rank_config(c, TensorParallel{0, tp_size});
  if (!o.dump_config.empty()) {
    std::ofstream f(o.dump_config);
    if (!f) invalid_input("--dump-config: cannot write '{}'", o.dump_config);
    f << hf_config_json(c).dump(2) << "\n";
    if (!f) runtime_error("--dump-config: writing '{}' failed", o.dump_config);
  }
  if (o.source.is_synthetic()) {
    fmt::print("model      synthetic {} ({} layers, random weights, seed {})\n", o.source.synthetic,
               c.num_hidden_layers(), o.source.synthetic_seed);
  } else {
    fmt::print("model      {}\n", o.source.model_dir);
  }
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
    fmt::print("  MTP       {} block(s), pattern {} ({})\n", c.num_nextn_predict_layers, mtp,
               !m.model                    ? "from the config"
               : m.model->mtp_blocks() > 0 ? "loaded"
                                           : "not in the checkpoint");
  }

  fmt::print("\nparameters\n");
  int64_t total = 0;
  for (const auto& [kind, n] : m.model ? m.model->parameter_counts() : parameter_counts(c)) {
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

  // Each kind's format and the bytes its weights take as stored: a loaded checkpoint's own tensors (CPU: zero-copy in
  // the file's dtypes, quantized modules as the file stores them); a config alone: --dtype, with the linear layers as
  // --quantization says.
  const ops::WeightFormat quantize = o.source.quantize();
  const DType dtype = o.dtype == "float32" ? DType::kF32 : o.dtype == "float16" ? DType::kF16 : DType::kBF16;
  fmt::print("\nweights by kind (format, bytes as stored{})\n",
             m.model ? "" : fmt::format(", {}", dtype_name(dtype)));
  int64_t stored = 0;
  if (m.model) {
    for (const auto& [kind, k] : weight_summary(c, m.model->weights())) {
      fmt::print("  {:<11} {:<11} {:>14}\n", kind, k.formats, human_bytes(static_cast<double>(k.bytes)));
      stored += k.bytes;
    }
  } else {
    for (const auto& [kind, b] : weight_bytes(c, dtype, quantize)) {
      const bool linear = kind != "embeddings" && kind != "norm_f" && kind != "lm_head";
      fmt::print("  {:<11} {:<11} {:>14}\n", kind, linear ? ops::weight_format_name(quantize) : "dense",
                 human_bytes(static_cast<double>(b)));
      stored += b;
    }
  }
  fmt::print("  {:<11} {:<11} {:>14}\n", "total", "", human_bytes(static_cast<double>(stored)));
  fmt::print("\nmemory for state\n");
  // Per SSM state dtype (--mamba-ssm-cache-dtype): a 16-bit state halves the SSM part, so more slots fit.
  for (auto [name, dt] : {std::pair{"fp32", DType::kF32}, {"bf16", DType::kBF16}, {"fp16", DType::kF16}}) {
    const size_t per_seq = StateCache::mamba_state_bytes_per_seq(c, dt);
    fmt::print("  Mamba state (conv fp32 + SSM {}) per sequence  {}  ({} slots per GiB)\n", name,
               human_bytes(static_cast<double>(per_seq)), per_seq == 0 ? 0 : (size_t{1} << 30) / per_seq);
  }
  fmt::print("  KV cache (fp32) per token                    {}\n",
             human_bytes(static_cast<double>(StateCache::kv_bytes_per_token(c))));
  fmt::print("  KV cache (bf16) per token                    {}\n",
             human_bytes(static_cast<double>(StateCache::kv_bytes_per_token(c, 2))));
  fmt::print("  KV cache (fp8) per token                     {}\n",
             human_bytes(static_cast<double>(StateCache::kv_bytes_per_token(c, 1))));

  MemoryLimits limits;
  limits.max_num_seqs = o.max_num_seqs;
  limits.max_model_len = o.max_model_len;
  limits.ssm_dtype = resolve_ssm_cache_dtype(o.mamba_ssm_cache_dtype, c);
  limits.kv_cache_fp8 = o.kv_cache_dtype == "fp8";
  MemoryPlan plan = plan_rank_memory(c, tp_size, dtype, dtype, limits, quantize);
  if (!o.source.is_synthetic() && load_quant_config(o.source.model_dir)) {
    // A ModelOpt checkpoint's bytes as stored: rank 0's share of each tensor.
    plan.weights = quantized_checkpoint_weight_bytes(o.source.model_dir, dtype, TensorParallel{0, tp_size});
  }
  fmt::print(
      "\nmemory plan{} ({}{}, {} sequences x {} tokens, {} tokens per step, SSM state {}, KV cache {})\n",
      tp_size > 1 ? fmt::format(" per rank of --tensor-parallel-size {}", tp_size) : "", dtype_name(dtype),
      quantize == ops::WeightFormat::kDense ? "" : fmt::format(", linear layers {}", ops::weight_format_name(quantize)),
      o.max_num_seqs, o.max_model_len, limits.max_tokens_per_step, ssm_cache_dtype_name(limits.ssm_dtype),
      limits.kv_cache_fp8 ? "fp8" : dtype_name(dtype));
  // GiB for reading, bytes for comparing (a rank's sharded parts are the whole model's divided by the size).
  auto row = [](const char* name, size_t bytes, const char* note = "") {
    fmt::print("  {:<11} {:>14}  {:>16} B{}\n", name, gib(bytes), bytes, note);
  };
  row("weights", plan.weights);
  row("KV cache", plan.kv_cache);
  row("Mamba state", plan.mamba_state);
  row("workspace", plan.workspace, "  (estimate)");
  row("total", plan.total());
  if (tp_size > 1) {
    fmt::print("  {} ranks     {:>14}  (each rank holds its shard and its copy of the caches)\n", tp_size,
               gib(plan.total() * static_cast<size_t>(tp_size)));
    if (std::count(c.layers.begin(), c.layers.end(), LayerKind::kMoe) > 0) {
      // What --moe-split auto picks (the bytes a rank holds are the same either way).
      fmt::print("  routed experts split {} (--moe-split auto)\n",
                 expert_parallel_by_rule(c, tp_size)
                     ? fmt::format("by expert: {} whole experts a rank", c.n_routed_experts / tp_size)
                     : fmt::format("by intermediate column: {} of {} a rank",
                                   c.moe_intermediate_size / tp_size, c.moe_intermediate_size));
    }
  }
  if (device::cuda_available()) {
    const size_t free_b = device::memory_info(Device::kCuda).free;
    fmt::print("  GPU free    {:>14}  -> {}\n", gib(free_b), plan.total() <= free_b ? "fits" : "does NOT fit");
  } else {
    fmt::print("  GPU         none ({})\n", device::describe_cuda());
  }
  return 0;
}

}  // namespace chimera::cli
