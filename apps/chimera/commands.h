// The chimera CLI's subcommands. Each registers its flags on a CLI11 subcommand and runs from a plain options
// struct (flags -> one validated options value -> run; no getenv deep in code).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "bench_serve/bench_serve.h"
#include "dist/allreduce_types.h"
#include "model_loading.h"
#include "runtime/sampler.h"

namespace chimera::cli {

struct GenerateOptions {
  ModelSource source;
  std::string prompt;
  std::string prompt_ids;  // "1,2,3"
  std::string prompt_file;  // --prompt-file FILE, "-" = standard input
  std::string device = "cpu";
  std::string dtype;  // "" = the device's default: float32 on the CPU, bfloat16 on CUDA
  std::string logits_out;
  std::string dump_activations;  // --dump-activations DIR (NemotronH::set_activation_dump)
  SamplingParams sampling;
  int32_t max_model_len = 4096;
  std::string mamba_ssm_cache_dtype;  // --mamba-ssm-cache-dtype; "" / "auto": the config's (resolve_ssm_cache_dtype)
  std::string kv_cache_dtype = "auto";  // --kv-cache-dtype auto | fp8
  bool no_special_tokens = false;
  bool quiet = false;  // no stats on stderr
  std::string speculative_config;  // --speculative-config JSON; "" = off
  // --tensor-parallel-size N: the model sharded over N ranks that are threads of this process
  // (models/tensor_parallel_model.h): CPU threads, or one GPU per rank.
  int tensor_parallel_size = 1;
  std::string moe_split = "auto";  // --moe-split auto | expert | intermediate (resolve_expert_parallel)
  // --nnodes, --node-rank, --master-addr, --master-port, --dist-timeout: those ranks spread over processes.
  NodeOptions nodes;
  // Tensor-parallel AllReduce strategy of CUDA ranks on distinct GPUs (--allreduce-strategy /
  // CHIMERA_ALLREDUCE_STRATEGY, read once by CLI11 at parse time).
  dist::AllReduceStrategy allreduce_strategy = dist::AllReduceStrategy::kAuto;
};

struct InfoOptions {
  ModelSource source;
  // The memory plan printed for these limits, weights in `dtype`.
  int32_t max_num_seqs = 8;
  int32_t max_model_len = 4096;
  std::string dtype = "bfloat16";
  std::string mamba_ssm_cache_dtype;  // the SSM state's dtype in the memory plan ("" / "auto": the config's)
  std::string kv_cache_dtype = "auto";  // the KV cache's in the memory plan: auto | fp8
  // Write the model's config as a transformers config.json (what `--synthetic PRESET [--num-layers N]`
  // builds), so a peer (bench/peers/engine_peers.py) runs the same shapes.
  std::string dump_config;
  // --tensor-parallel-size N: the memory plan of one of N ranks (plan_rank_memory).
  int tensor_parallel_size = 1;
};

// chimera bench (bench.cpp): prefill and decode throughput through the Engine, beside the batch-1 roofline.
struct BenchOptions {
  ModelSource source;
  std::string device = "cpu";
  std::string dtype;  // "" = the device's default: float32 on the CPU, bfloat16 on CUDA
  std::vector<int32_t> input_lens = {1024, 8192, 32768};
  std::vector<int32_t> batch_sizes = {1, 8, 64, 256};
  int32_t decode_context = 1024;
  int32_t decode_steps = 32;
  std::string mamba_ssm_cache_dtype;  // "" / "auto": the config's (resolve_ssm_cache_dtype)
  std::string kv_cache_dtype = "auto";  // auto | fp8
  int32_t warmup = 2;
  bool cuda_graphs = true;        // --no-cuda-graphs: every decode step eager
  bool pdl = true;                // --no-pdl: kernels launched without programmatic dependent launch (device_api.h)
  double bandwidth_gbs = 4200.0;  // runtime/roofline.h kH200MeasuredBandwidth
  uint64_t seed = 0;
  std::string json_out;
  // Also break one prefill step (the first --input-lens length) and one decode step per batch size into time
  // per op kind (runtime/profiler.h).
  bool profile = false;
  std::string speculative_config;  // --speculative-config JSON; "" = off (decode steps verify the head's drafts)
  int tensor_parallel_size = 1;    // --tensor-parallel-size N: the ranks of EngineModel
  std::string moe_split = "auto";  // --moe-split auto | expert | intermediate (resolve_expert_parallel)
  NodeOptions nodes;  // --nnodes, --node-rank, --master-addr, --master-port, --dist-timeout
  dist::AllReduceStrategy allreduce_strategy = dist::AllReduceStrategy::kAuto;  // --allreduce-strategy
};

// chimera serve (serve.cpp): the OpenAI-compatible server; flags named as vLLM's.
// chimera serve on the CPU without --max-num-seqs.
inline constexpr int32_t kCpuDefaultMaxNumSeqs = 64;

struct ServeOptions {
  ModelSource source;
  std::string host = "127.0.0.1";
  int32_t port = 8000;
  std::string served_model_name;
  std::string api_key;
  int32_t max_num_seqs = 0;            // 0: automatic (run_serve)
  int32_t max_num_batched_tokens = 0;  // 0: automatic (run_serve)
  int32_t max_model_len = 4096;
  double gpu_memory_utilization = 0.9;
  bool disable_log_stats = false;
  std::string mamba_ssm_cache_dtype;  // "" / "auto": the config's (resolve_ssm_cache_dtype)
  std::string kv_cache_dtype = "auto";  // auto | fp8
  int32_t max_waiting_seqs = 1024;
  std::string device = "cpu";
  std::string dtype;
  std::string reasoning_parser;
  std::string tool_call_parser;
  int32_t io_threads = 4;
  size_t max_body_bytes = size_t{32} << 20;
  int32_t request_timeout_s = 30;
  double shutdown_timeout_s = 30.0;
  std::string speculative_config;  // --speculative-config JSON; "" = off
  // Prefix caching (runtime/prefix_cache.h): --enable-prefix-caching / --no-enable-prefix-caching, the Mamba
  // checkpoints' spacing in tokens and their slots (0: automatic, CacheSizingRequest::mamba_checkpoint_slots).
  // On by default: it measured no cost on prompts it cannot help (docs/perf.md "Prefix caching").
  bool enable_prefix_caching = true;
  int32_t mamba_checkpoint_interval = 2048;
  int32_t mamba_checkpoint_slots = 0;
  int tensor_parallel_size = 1;  // --tensor-parallel-size N: the ranks of EngineModel
  std::string moe_split = "auto";  // --moe-split auto | expert | intermediate (resolve_expert_parallel)
  NodeOptions nodes;             // --nnodes, --node-rank, --master-addr, --master-port, --dist-timeout
  dist::AllReduceStrategy allreduce_strategy = dist::AllReduceStrategy::kAuto;  // --allreduce-strategy
};

void add_generate(CLI::App& app, GenerateOptions& opt);
void add_info(CLI::App& app, InfoOptions& opt);
int run_generate(const GenerateOptions& opt);
int run_info(const InfoOptions& opt);
void add_bench(CLI::App& app, BenchOptions& opt);
int run_bench(const BenchOptions& opt);
void add_serve(CLI::App& app, ServeOptions& opt);
int run_serve(const ServeOptions& opt);
// chimera bench serve (bench_serve.cpp): vLLM's `vllm bench serve` flags; backend is --backend.
void add_bench_serve(CLI::App& app, bench_serve::BenchServeOptions& opt, std::string& backend);
int run_bench_serve(bench_serve::BenchServeOptions opt, const std::string& backend);

// The model bundled with the source tree (used when -m is not given).
std::string default_model_dir();

}  // namespace chimera::cli
