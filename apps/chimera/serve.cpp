// chimera serve: the OpenAI-compatible HTTP server (src/server/) over one Engine on its own thread.
#include <pthread.h>
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <thread>

#include <fmt/core.h>

#include "backends/device_api.h"
#include "chat/chat_template.h"
#include "commands.h"
#include "core/error.h"
#include "runtime/cache_sizing.h"
#include "runtime/engine.h"
#include "runtime/memory_plan.h"
#include "server/engine_loop.h"
#include "server/http_server.h"
#include "server/metrics.h"
#include "server/openai_server.h"

namespace chimera::cli {

void add_serve(CLI::App& app, ServeOptions& o) {
  add_model_source(app, o.source);
  app.add_option("--host", o.host, "Address to listen on")->capture_default_str();
  app.add_option("--port", o.port, "Port to listen on (0: any free port; the address is printed)")
      ->check(CLI::Range(0, 65535))
      ->capture_default_str();
  app.add_option("--served-model-name", o.served_model_name,
                 "Model name of the API (default: the -m path as given, or synthetic-PRESET)");
  app.add_option("--api-key", o.api_key, "Require 'Authorization: Bearer KEY' on /v1 routes");
  app.add_option("--max-num-seqs", o.max_num_seqs,
                 "Sequences the engine runs at once (default: CUDA as many as fit up to 1024, CPU 64)")
      ->check(CLI::PositiveNumber);
  app.add_option("--max-num-batched-tokens", o.max_num_batched_tokens,
                 "Tokens per engine step, prefill chunks + decodes (default: 8192 on a GPU of >= 70 GiB, else 2048)")
      ->check(CLI::PositiveNumber);
  app.add_flag("--disable-log-stats", o.disable_log_stats, "No periodic throughput / load line on standard output");
  app.add_option("--max-model-len", o.max_model_len, "Maximum tokens per sequence (prompt + output)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--gpu-memory-utilization", o.gpu_memory_utilization,
                 "CUDA: fraction of the GPU's memory the engine may use; the KV pool and Mamba slots get what is left "
                 "after weights, workspace and graphs (the CPU sizes them for --max-num-seqs x --max-model-len)")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  app.add_option("--max-waiting-seqs", o.max_waiting_seqs,
                 "Sequences queued beyond --max-num-seqs; past it requests get 503 with Retry-After")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--device", o.device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}))->capture_default_str();
  app.add_option("--dtype", o.dtype, "Weights and activations on CUDA: bfloat16 (default) or float32")
      ->check(CLI::IsMember({"bfloat16", "float32"}));
  add_ssm_cache_dtype_flag(app, o.mamba_ssm_cache_dtype);
  add_speculative_config_flag(app, o.speculative_config);
  add_kv_cache_dtype_flag(app, o.kv_cache_dtype);
  app.add_flag("--enable-prefix-caching,!--no-enable-prefix-caching", o.enable_prefix_caching,
               "Reuse the KV blocks and Mamba state checkpoints of prompt prefixes seen before (default on; "
               "docs/caches.md \"Prefix caching\")");
  app.add_option("--mamba-checkpoint-interval", o.mamba_checkpoint_interval,
                 "Prefix caching: tokens between Mamba state checkpoints (a multiple of the KV block size, 16)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--mamba-checkpoint-slots", o.mamba_checkpoint_slots,
                 "Prefix caching: Mamba state checkpoints kept (LRU); 0: a tenth of the cache memory on CUDA, "
                 "2 x --max-num-seqs on the CPU")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  add_tensor_parallel_flag(app, o.tensor_parallel_size);
  add_moe_split_flag(app, o.moe_split);
  add_node_flags(app, o.nodes);
  app.add_option("--reasoning-parser", o.reasoning_parser, "Split reasoning into reasoning_content: nemotron_v3")
      ->check(CLI::IsMember({"nemotron_v3"}));
  app.add_option("--tool-call-parser", o.tool_call_parser, "Turn the model's tool calls into tool_calls")
      ->check(CLI::IsMember({"nemotron_v3"}));
  app.add_option("--io-threads", o.io_threads, "HTTP I/O threads")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--max-request-body-bytes", o.max_body_bytes, "Larger request bodies get 413")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--request-timeout", o.request_timeout_s,
                 "Seconds a request may take to arrive, a keep-alive connection may idle, a write may wait")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--shutdown-timeout", o.shutdown_timeout_s,
                 "On SIGINT / SIGTERM: seconds in-flight requests may finish before they are aborted")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
}

int run_serve(const ServeOptions& o) {
  check_tensor_parallel_size(o.tensor_parallel_size, o.device, o.nodes.nnodes);
  check_node_options(o.nodes, o.tensor_parallel_size);
  ModelOptions model_options = model_options_from_flags(o.device, o.dtype);

  // vLLM's defaults where the flags are not given: on a GPU of >= 70 GiB 8192 tokens a step and as many sequences
  // as the memory holds up to 1024; on a smaller GPU 2048 tokens; on the CPU 2048 tokens and 64 sequences.
  const bool cuda = model_options.device == Device::kCuda;
  device::MemoryInfo gpu_memory;
  if (cuda) gpu_memory = device::memory_info(Device::kCuda);
  int32_t max_num_batched_tokens = o.max_num_batched_tokens;
  if (max_num_batched_tokens == 0) {
    max_num_batched_tokens = cuda && gpu_memory.total >= kLargeGpuBytes ? kLargeGpuMaxNumBatchedTokens
                                                                        : kSmallGpuMaxNumBatchedTokens;
  }
  int32_t max_num_seqs = o.max_num_seqs != 0 ? o.max_num_seqs : cuda ? 0 : kCpuDefaultMaxNumSeqs;

  EngineConfig ec;
  ec.speculative = speculative_config_from_flag(o.speculative_config);
  ec.scheduler.max_num_batched_tokens = max_num_batched_tokens;
  ec.cache.max_model_len = o.max_model_len;
  ec.cache.ssm_dtype = resolve_ssm_cache_dtype(o.mamba_ssm_cache_dtype, load_source_config(o.source));
  MemoryLimits limits;
  limits.ssm_dtype = ec.cache.ssm_dtype;
  ec.cache.kv_cache_fp8 = limits.kv_cache_fp8 = o.kv_cache_dtype == "fp8";
  ec.cache.prefix_caching = o.enable_prefix_caching;
  ec.cache.checkpoint_interval = o.mamba_checkpoint_interval;
  ec.cache.checkpoint_slots = o.mamba_checkpoint_slots > 0 ? o.mamba_checkpoint_slots : 2 * max_num_seqs;
  if (o.enable_prefix_caching) limits.mamba_checkpoints = ec.cache.checkpoint_slots;
  limits.max_num_seqs = max_num_seqs;
  limits.max_model_len = o.max_model_len;
  limits.max_tokens_per_step = max_num_batched_tokens;
  limits.block_size = ec.cache.block_size;
  // On CUDA the caches are sized from the device's memory after the weights (--gpu-memory-utilization), so the
  // load-time check covers the weights and one sequence only.
  if (cuda) {
    limits.max_num_seqs = 1;
    limits.mamba_checkpoints = 0;  // size_caches plans them
  }
  model_options.tp.expert_parallel =
      resolve_expert_parallel(o.moe_split, load_source_config(o.source), o.tensor_parallel_size);
  // Another node's ranks serve no HTTP: they run node 0's steps until node 0 stops (or goes away: an error).
  // SIGINT / SIGTERM end such a node at once (node 0's next step then fails naming it).
  if (o.nodes.node_rank != 0) {
    run_worker_node(o.source, model_options, o.tensor_parallel_size, o.nodes, limits, o.allreduce_strategy);
    return 0;
  }
  // Signals go to the waiting main thread only (blocked here, before any thread starts, so every thread
  // inherits the mask).
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  // With --tensor-parallel-size N the plan is N ranks', each holding its shard and its copy of the caches (on the
  // CPU all in host memory, on CUDA each rank on its own GPU).
  const EngineModel em =
      load_engine_model(o.source, model_options, o.tensor_parallel_size, limits, o.nodes, o.allreduce_strategy);
  const LoadedModel& m = em.loaded;
  const Model& model = em.model();
  if (cuda) {
    CacheSizingRequest req;
    req.gpu_memory_utilization = o.gpu_memory_utilization;
    req.max_num_seqs = max_num_seqs;
    req.max_model_len = o.max_model_len;
    req.max_num_batched_tokens = max_num_batched_tokens;
    req.block_size = ec.cache.block_size;
    req.cuda_graphs = ec.cuda_graphs;
    req.ssm_dtype = ec.cache.ssm_dtype;
    req.kv_cache_fp8 = ec.cache.kv_cache_fp8;
    req.num_speculative_tokens = ec.speculative.num_speculative_tokens;
    req.prefix_caching = o.enable_prefix_caching;
    req.mamba_checkpoint_interval = o.mamba_checkpoint_interval;
    req.mamba_checkpoint_slots = o.mamba_checkpoint_slots;
    req.cuda_graphs = ec.cuda_graphs && model.tensor_parallel_size() == 1;  // as the engine captures them
    const DType act = model.activation_dtype();
    // One rank's caches on one rank's GPU (every rank holds the same sizes: its heads, whole logits rows), after
    // that rank's weights as the GPU holds them (quantized layers as stored), on the GPU with the least free memory.
    const NemotronH& rank0 = em.tp ? em.tp->rank(0) : *m.model;
    int64_t weights = 0;
    for (const auto& [kind, k] : weight_summary(m.config, rank0.weights())) weights += kind == "mtp" ? 0 : k.bytes;
    device::MemoryInfo memory = device::memory_info(Device::kCuda);
    for (const int d : model.tensor_parallel_devices()) {
      const device::DeviceGuard on(d);
      const device::MemoryInfo rank_memory = device::memory_info(Device::kCuda);
      if (rank_memory.free < memory.free) memory = rank_memory;
    }
    const CacheSizingPlan plan = size_caches(model.config(), act, static_cast<size_t>(weights), memory, req);
    ec.cache = plan.cache_sizes();
    max_num_seqs = plan.mamba_slots;
    fmt::print("chimera serve: {}\n", format_cache_sizing(plan, "GPU"));
  }
  ec.scheduler.max_num_seqs = max_num_seqs;
  ec.cache.max_seqs = max_num_seqs;
  Engine engine(model, ops::Context{model_options.device, nullptr}, ec);
  if (const std::string graphs = format_graph_capture(engine); !graphs.empty()) {
    fmt::print("chimera serve: {}\n", graphs);
  }

  std::string name = o.served_model_name;
  if (name.empty()) name = o.source.is_synthetic() ? "synthetic-" + o.source.synthetic : o.source.model_dir;
  server::Metrics metrics(name, o.max_model_len);
  server::EngineLoopConfig lc;
  lc.max_waiting_seqs = o.max_waiting_seqs;
  if (o.disable_log_stats) lc.log_stats_interval_s = 0;
  server::EngineLoop loop(engine, metrics, lc, max_num_seqs);
  // The chat template from the model directory (-m; with --synthetic, the directory lending the tokenizer). A
  // synthetic byte-level tokenizer has no template: its ids are not the -m model's.
  std::optional<chat::ChatTemplate> chat_template;
  if (m.tokenizer && !m.synthetic_tokenizer && std::filesystem::is_directory(o.source.model_dir)) {
    chat_template = chat::ChatTemplate::load(o.source.model_dir);
  }
  if ((!o.reasoning_parser.empty() || !o.tool_call_parser.empty()) && !chat_template) {
    invalid_input("--reasoning-parser / --tool-call-parser: {} has no chat template", o.source.model_dir);
  }
  server::ServerConfig sc;
  sc.served_model_name = name;
  sc.api_key = o.api_key;
  sc.max_model_len = o.max_model_len;
  sc.vocab_size = m.config.vocab_size;
  sc.reasoning_parser = o.reasoning_parser;
  sc.tool_call_parser = o.tool_call_parser;
  server::OpenAiServer api(sc, m.tokenizer ? &*m.tokenizer : nullptr, chat_template ? &*chat_template : nullptr, loop,
                           metrics);
  server::HttpServerConfig hc;
  hc.host = o.host;
  hc.port = static_cast<uint16_t>(o.port);
  hc.io_threads = o.io_threads;
  hc.max_body_bytes = o.max_body_bytes;
  hc.request_timeout_s = o.request_timeout_s;
  server::HttpServer http(hc, [&api](server::HttpRequest req, std::shared_ptr<server::Responder> r) {
    api.handle(std::move(req), std::move(r));
  });
  const uint16_t port = http.listen();
  http.start();
  fmt::print("chimera serve: model {} ({} {}{}), max_num_seqs {}, max_num_batched_tokens {}, max_model_len {}\n", name,
             o.device, dtype_name(model.activation_dtype()),
             em.tensor_parallel_size() > 1 ? fmt::format(", tensor parallel {}", em.tensor_parallel_size()) : "",
             max_num_seqs, max_num_batched_tokens, o.max_model_len);
  fmt::print("chimera serve: chat template {}{}{}\n", chat_template ? "from the model" : "none",
             o.reasoning_parser.empty() ? "" : ", reasoning parser " + o.reasoning_parser,
             o.tool_call_parser.empty() ? "" : ", tool-call parser " + o.tool_call_parser);
  fmt::print("chimera serve: listening on http://{}:{}\n", o.host, port);
  std::fflush(stdout);

  int sig = 0;
  sigwait(&signals, &sig);
  fmt::print("chimera serve: {} received; no new connections, {} request(s) in flight get {} s\n",
             sig == SIGINT ? "SIGINT" : "SIGTERM", http.active_requests(), o.shutdown_timeout_s);
  std::fflush(stdout);
  http.stop_accepting();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(o.shutdown_timeout_s);
  while (std::chrono::steady_clock::now() < deadline && (loop.in_flight() > 0 || http.active_requests() > 0)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  // Whatever is left is aborted; its clients get their last chunk (finish_reason "abort") before the I/O stops.
  loop.stop();
  const auto flush_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (std::chrono::steady_clock::now() < flush_deadline && http.active_requests() > 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  http.stop();
  fmt::print("chimera serve: stopped\n");
  return 0;
}

}  // namespace chimera::cli
