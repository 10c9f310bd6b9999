// chimera generate: tokenize, run the engine, stream the text, optionally dump every logits row.
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <iterator>
#include <memory>
#include <sstream>

#include <fmt/core.h>

#include "backends/device_api.h"
#include "commands.h"
#include "core/error.h"
#include "io/npy.h"
#include "model_loading.h"
#include "runtime/engine.h"
#include "runtime/kernel_env.h"

namespace chimera::cli {

void add_generate(CLI::App& app, GenerateOptions& o) {
  add_model_source(app, o.source);
  app.add_option("-p,--prompt", o.prompt, "Prompt text");
  app.add_option("--prompt-ids", o.prompt_ids, "Prompt as comma-separated token ids instead of text");
  app.add_option("--prompt-file", o.prompt_file, "Read the prompt text from FILE ('-': standard input)");
  app.add_option("-n,--max-tokens", o.sampling.max_new_tokens, "Maximum number of tokens to generate")
      ->capture_default_str();
  app.add_option("--temperature", o.sampling.temperature, "Sampling temperature (0 = greedy)")->capture_default_str();
  app.add_option("--top-k", o.sampling.top_k, "Keep the k most likely tokens (0 = off)")->capture_default_str();
  app.add_option("--top-p", o.sampling.top_p, "Nucleus sampling mass (1 = off)")->capture_default_str();
  app.add_option("--min-p", o.sampling.min_p, "Keep tokens with p >= min_p * p_max (0 = off)")->capture_default_str();
  app.add_option("--presence-penalty", o.sampling.presence_penalty,
                 "Subtract this from the logit of every token generated so far (0 = off)")
      ->capture_default_str();
  app.add_option("--frequency-penalty", o.sampling.frequency_penalty,
                 "Subtract this times its count from the logit of every token generated so far (0 = off)")
      ->capture_default_str();
  app.add_option("--repetition-penalty", o.sampling.repetition_penalty,
                 "Divide positive (multiply negative) logits of prompt and generated tokens by this (1 = off)")
      ->capture_default_str();
  app.add_option("--stop-token-ids", o.sampling.stop_token_ids,
                 "Token ids that end the generation (comma-separated; the stop token is generated)")
      ->delimiter(',');
  app.add_option("--seed", o.sampling.seed, "Random seed for sampling")->capture_default_str();
  app.add_flag("--ignore-eos", o.sampling.ignore_eos, "Keep generating past end-of-sequence tokens");
  app.add_option("--device", o.device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}))->capture_default_str();
  app.add_option("--dtype", o.dtype,
                 "Weights and activations on CUDA: bfloat16 (default) or float32; the CPU computes in float32")
      ->check(CLI::IsMember({"bfloat16", "float32"}));
  add_ssm_cache_dtype_flag(app, o.mamba_ssm_cache_dtype);
  add_kv_cache_dtype_flag(app, o.kv_cache_dtype);
  add_speculative_config_flag(app, o.speculative_config);
  app.add_option("--max-model-len", o.max_model_len, "Maximum tokens per sequence (prompt + output)")
      ->capture_default_str();
  app.add_option("--logits-out", o.logits_out,
                 "Write float32 logits of every prompt position and every generated step to FILE.npy");
  app.add_option("--dump-activations", o.dump_activations,
                 "Debugging: write each layer's input (and a MoE layer's experts) of the prefill to DIR as .npy");
  add_tensor_parallel_flag(app, o.tensor_parallel_size);
  add_moe_split_flag(app, o.moe_split);
  add_node_flags(app, o.nodes);
  app.add_flag("--no-special-tokens", o.no_special_tokens, "Do not add the tokenizer's special tokens (BOS)");
  app.add_flag("-q,--quiet", o.quiet, "No statistics on stderr");
}

namespace {
std::vector<int32_t> parse_ids(const std::string& text) {
  std::vector<int32_t> ids;
  // getline drops one trailing empty field: "1,2," would pass as "1,2".
  const auto last = text.find_last_not_of(" \t");
  if (last != std::string::npos && text[last] == ',') invalid_input("--prompt-ids: empty entry in '{}'", text);
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    const auto b = item.find_first_not_of(" \t"), e = item.find_last_not_of(" \t");
    if (b == std::string::npos) invalid_input("--prompt-ids: empty entry in '{}'", text);
    item = item.substr(b, e - b + 1);
    try {
      size_t used = 0;
      const long long v = std::stoll(item, &used);
      if (used != item.size() || v < 0 || v > INT32_MAX) throw std::invalid_argument(item);
      ids.push_back(static_cast<int32_t>(v));
    } catch (const std::exception&) {
      invalid_input("--prompt-ids: '{}' is not a token id", item);
    }
  }
  if (ids.empty()) invalid_input("--prompt-ids: no ids given");
  return ids;
}

// A prompt file, or standard input for "-", read whole.
std::string read_prompt_file(const std::string& path) {
  if (path == "-") {
    std::string text((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
    if (std::cin.bad()) runtime_error("--prompt-file -: reading standard input failed");
    return text;
  }
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) invalid_input("--prompt-file: '{}' is a directory", path);
  std::ifstream in(path, std::ios::binary);
  if (!in) invalid_input("--prompt-file: cannot open '{}': {}", path, std::strerror(errno));
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) runtime_error("--prompt-file: reading '{}' failed", path);
  return text;
}

// Standard output must take everything: a full disk or a closed pipe is an error, not a silent exit 0.
void flush_stdout() {
  if (std::fflush(stdout) != 0 || std::ferror(stdout)) {
    runtime_error("writing to standard output failed: {}", std::strerror(errno));
  }
}
}  // namespace

int run_generate(const GenerateOptions& o) {
  check_tensor_parallel_size(o.tensor_parallel_size, o.device, o.nodes.nnodes);
  check_node_options(o.nodes, o.tensor_parallel_size);
  ModelOptions model_options = model_options_from_flags(o.device, o.dtype);
  if (!o.prompt.empty() + !o.prompt_ids.empty() + !o.prompt_file.empty() != 1) {
    invalid_input("give exactly one of --prompt, --prompt-ids and --prompt-file");
  }
  o.sampling.validate();
  if (o.max_model_len < 1) invalid_input("--max-model-len must be >= 1, got {}", o.max_model_len);
  // The other nodes of a multi-process run neither read the prompt nor write anything.
  const bool node_zero = o.nodes.node_rank == 0;
  // Outputs are checked before the work: an unwritable --logits-out fails now, not after the generation.
  if (node_zero && !o.logits_out.empty()) {
    std::error_code ec;
    if (std::filesystem::is_directory(o.logits_out, ec)) invalid_input("--logits-out: '{}' is a directory", o.logits_out);
    std::ofstream probe(o.logits_out, std::ios::binary | std::ios::trunc);
    if (!probe) invalid_input("--logits-out: cannot write '{}': {}", o.logits_out, std::strerror(errno));
  }
  const std::string prompt_text = o.prompt_file.empty() || !node_zero ? o.prompt : read_prompt_file(o.prompt_file);
  if (node_zero && !o.prompt_file.empty() && prompt_text.empty()) {
    invalid_input("--prompt-file: '{}' is empty", o.prompt_file);
  }

  const auto t0 = std::chrono::steady_clock::now();
  EngineConfig ec;
  ec.speculative = speculative_config_from_flag(o.speculative_config);
  ec.cache.ssm_dtype = resolve_ssm_cache_dtype(o.mamba_ssm_cache_dtype, load_source_config(o.source));
  MemoryLimits limits;
  limits.ssm_dtype = ec.cache.ssm_dtype;
  ec.cache.kv_cache_fp8 = limits.kv_cache_fp8 = o.kv_cache_dtype == "fp8";
  limits.max_num_seqs = 1;
  limits.max_model_len = o.max_model_len;
  limits.max_tokens_per_step = std::min(ec.scheduler.max_num_batched_tokens, o.max_model_len);
  limits.block_size = ec.cache.block_size;
  const int tp_size = o.tensor_parallel_size;
  if (tp_size > 1 && !o.dump_activations.empty()) {
    invalid_input("--dump-activations: not with --tensor-parallel-size {}", tp_size);
  }
  model_options.tp.expert_parallel = resolve_expert_parallel(o.moe_split, load_source_config(o.source), tp_size);
  if (!node_zero) {  // another node's ranks: no engine, no output
    run_worker_node(o.source, model_options, tp_size, o.nodes, limits, o.allreduce_strategy);
    return 0;
  }
  const EngineModel em = load_engine_model(o.source, model_options, tp_size, limits, o.nodes, o.allreduce_strategy);
  const LoadedModel& m = em.loaded;
  const Model& model = em.model();
  if (!o.dump_activations.empty()) {
    try {
      m.model->set_activation_dump(o.dump_activations);
    } catch (const Error& e) {
      invalid_input("--dump-activations: {}", e.what());
    }
  }
  std::vector<int32_t> prompt;
  if (!o.prompt_ids.empty()) {
    prompt = parse_ids(o.prompt_ids);
  } else {
    if (!m.tokenizer) {
      invalid_input("{}: no tokenizer.json{}; pass the prompt as --prompt-ids",
                    o.source.is_synthetic() ? "--synthetic " + o.source.synthetic : o.source.model_dir,
                    o.source.is_synthetic() ? " with this vocabulary" : "");
    }
    prompt = m.tokenizer->encode(prompt_text, !o.no_special_tokens);
    if (prompt.empty()) invalid_input("--prompt: the prompt encodes to no tokens");
  }
  const auto t_loaded = std::chrono::steady_clock::now();

  // No silent truncation (as vLLM): a prompt beyond the sequence limit is an error; -n beyond it is capped with
  // a notice. The limit is --max-model-len, and the model's max_position_embeddings where that is smaller.
  const int64_t max_pos = m.config.max_position_embeddings;
  const int64_t limit = std::min<int64_t>(o.max_model_len, max_pos);
  const std::string limit_name = o.max_model_len <= max_pos
                                     ? fmt::format("--max-model-len {}", o.max_model_len)
                                     : fmt::format("the model's max_position_embeddings {}", max_pos);
  const auto prompt_len = static_cast<int64_t>(prompt.size());
  if (prompt_len > limit) {
    invalid_input("the prompt is {} tokens, longer than {}; shorten it{}", prompt_len, limit_name,
                  o.max_model_len <= max_pos ? " or raise --max-model-len" : "");
  }
  SamplingParams sampling = o.sampling;
  if (prompt_len + sampling.max_new_tokens > limit) {
    sampling.max_new_tokens = static_cast<int32_t>(limit - prompt_len);
    fmt::print(stderr, "chimera: notice: -n {} capped to {}: the prompt's {} tokens plus the output reach {}\n",
               o.sampling.max_new_tokens, sampling.max_new_tokens, prompt_len, limit_name);
  }

  ec.cache.max_seqs = 1;
  ec.cache.max_model_len = static_cast<int32_t>(std::max<int64_t>(limit, prompt_len + 1));
  ec.scheduler.max_num_seqs = 1;
  ec.return_prompt_logits = !o.logits_out.empty();
  // The kernel configuration: the defaults with the environment registry's overrides (runtime/kernel_env.h).
  Engine engine(model, ops::Context{model_options.device, nullptr, nullptr, kernel_config_from_env()}, ec);
  // Reported after the text with the other figures, so the output starts with the prompt.
  const std::string graphs = format_graph_capture(engine);
  std::vector<float> logit_rows;
  if (!o.logits_out.empty()) {
    engine.on_logits = [&](int32_t, std::span<const float> row) {
      logit_rows.insert(logit_rows.end(), row.begin(), row.end());
    };
  }
  engine.add_request(prompt, sampling);

  std::optional<StreamingDecoder> stream;
  if (m.tokenizer) {
    stream.emplace(*m.tokenizer, /*skip_special_tokens=*/true);
    if (o.prompt_ids.empty()) fmt::print("{}", prompt_text);
  }
  int32_t generated = 0;
  std::chrono::steady_clock::time_point t_first{};
  while (engine.has_unfinished()) {
    for (const TokenEvent& ev : engine.step()) {
      // Non-finite logits: nothing of this step is printed; the error ends the command (exit 1).
      if (ev.finish == FinishReason::kError) {
        fmt::print("\n");
        std::fflush(stdout);
        runtime_error("{}", ev.error);
      }
      if (ev.token < 0) continue;
      if (generated++ == 0) t_first = std::chrono::steady_clock::now();
      if (stream) {
        fmt::print("{}", stream->feed(ev.token));
      } else {
        fmt::print("{}{}", generated > 1 ? "," : "", ev.token);
      }
      flush_stdout();
    }
  }
  if (stream) fmt::print("{}", stream->flush());
  fmt::print("\n");
  flush_stdout();
  const auto t_end = std::chrono::steady_clock::now();

  if (!o.logits_out.empty()) {
    const int64_t V = m.config.vocab_size;
    const int64_t rows = static_cast<int64_t>(logit_rows.size()) / V;
    write_npy(o.logits_out, Tensor::from_f32({rows, V}, logit_rows));
  }
  if (!o.quiet) {
    using ms = std::chrono::duration<double, std::milli>;
    const double load_ms = ms(t_loaded - t0).count();
    const double ttft = generated ? ms(t_first - t_loaded).count() : 0.0;
    const double decode_ms = generated > 1 ? ms(t_end - t_first).count() : 0.0;
    if (!graphs.empty()) fmt::print(stderr, "[chimera] {}\n", graphs);
    if (ec.speculative.enabled()) {
      fmt::print(stderr, "[chimera] speculative decoding (mtp, K = {}): {}\n", ec.speculative.num_speculative_tokens,
                 engine.speculative_stats().summary());
    }
    fmt::print(stderr, "[chimera] prompt {} tokens, generated {} | load {:.0f} ms, first token {:.1f} ms{} | {} {}\n",
               prompt.size(), generated, load_ms, ttft,
               generated > 1 ? fmt::format(", decode {:.1f} tok/s", (generated - 1) / (decode_ms / 1000.0)) : "",
               o.device, dtype_name(model.activation_dtype()));
  }
  return 0;
}

}  // namespace chimera::cli
