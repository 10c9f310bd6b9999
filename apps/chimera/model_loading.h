// Loading a model for the CLI: config, checkpoint, weights and (optionally) the tokenizer; or a synthetic
// (random-weight) model built in memory from a config preset (--synthetic PRESET [--num-layers N]).
#pragma once

#include <memory>
#include <optional>
#include <string>

#include <CLI/CLI.hpp>

#include "io/model_config.h"
#include "io/safetensors.h"
#include "models/nemotron_h.h"
#include "models/tensor_parallel_model.h"
#include "runtime/memory_plan.h"
#include "runtime/speculative.h"
#include "tokenizer/tokenizer.h"

namespace chimera::cli {

// Where the model comes from: -m DIR, or --synthetic PRESET (then -m only lends its tokenizer.json, used when
// its vocabulary fits the preset's, e.g. the bundled tiny model's tokenizer for `--synthetic tiny`; any other
// preset gets synthetic_byte_level_tokenizer of its vocab_size).
struct ModelSource {
  std::string model_dir;
  std::string synthetic;        // preset name; "" = read model_dir
  int64_t num_layers = 0;       // 0 = all layers of the pattern
  uint64_t synthetic_seed = 0;  // weights of a synthetic model
  // --quantization fp8 | nvfp4: the linear layers quantized at load (ModelOptions::quantize); "" = as stored.
  std::string quantization;
  bool is_synthetic() const { return !synthetic.empty(); }
  ops::WeightFormat quantize() const;
};
// Registers -m, --synthetic, --num-layers, --synthetic-seed, --quantization.
void add_model_source(CLI::App& app, ModelSource& src);
// The model options of --device cpu|cuda and --dtype: cuda needs a CUDA build and a GPU (bf16 unless --dtype
// float32); the CPU computes in float32 only. Otherwise kInvalidInput naming the flag.
ModelOptions model_options_from_flags(const std::string& device, const std::string& dtype);

struct LoadedModel {
  ModelConfig config;
  std::unique_ptr<Checkpoint> checkpoint;  // absent for a synthetic model
  std::unique_ptr<NemotronH> model;
  std::optional<Tokenizer> tokenizer;  // absent when a checkpoint has no tokenizer.json
  bool synthetic_tokenizer = false;    // tokenizer is synthetic_byte_level_tokenizer's (no -m directory behind it)
};

// The config of a source (a preset, truncated by --num-layers, or DIR/config.json), without weights.
ModelConfig load_source_config(const ModelSource& src);

// Registers --mamba-ssm-cache-dtype (vLLM's flag): float32, bfloat16, float16 or auto (the default).
void add_ssm_cache_dtype_flag(CLI::App& app, std::string& value);
// --speculative-config JSON (vLLM's): '{"method": "mtp", "num_speculative_tokens": K}'; "" = off.
void add_speculative_config_flag(CLI::App& app, std::string& value);
SpeculativeConfig speculative_config_from_flag(const std::string& value);
// The SSM state dtype: the flag's, or for "" / "auto" the config's mamba_ssm_cache_dtype (float32 when config.json
// has none). kInvalidInput naming the flag or the config field for anything else.
DType resolve_ssm_cache_dtype(const std::string& flag, const ModelConfig& config);
// Registers --kv-cache-dtype (vLLM's flag): auto (the activation dtype, the default) or fp8 (E4M3, per-tensor scales).
void add_kv_cache_dtype_flag(CLI::App& app, std::string& value);

// `options` say where the weights go (ModelOptions: CPU zero-copy, or uploaded to the GPU in a dtype). When
// `limits` is given the memory plan is checked first against the device's free memory (the host's for a
// synthetic model on the CPU; a checkpoint on the CPU is memory-mapped and not checked): kInvalidInput
// "needs X GiB (...) but the GPU has Y GiB free" before anything is allocated.
LoadedModel load_model(const ModelSource& src, bool with_weights = true, const ModelOptions& options = {},
                       const std::optional<MemoryLimits>& limits = std::nullopt);
// The GPU bytes of a quantized (ModelOpt) checkpoint's weights: quantized tensors as stored, float ones in `dtype`;
// with tensor parallelism those of rank tp's shard (each tensor's share by the name table's shard column).
size_t quantized_checkpoint_weight_bytes(const std::string& dir, DType dtype, const TensorParallel& tp = {});
// kInvalidInput naming both files unless the tokenizer's ids are exactly the model's embedding rows.
void check_tokenizer_fits(const Tokenizer& tok, const ModelConfig& config, const std::string& tokenizer_path,
                          const std::string& config_path);
LoadedModel load_model_dir(const std::string& dir, bool with_weights = true, const ModelOptions& options = {});

// Tensor parallelism in the CLI (docs/architecture.md "Tensor parallelism"): generate, bench, serve and info share
// the flag, its checks, the per-rank memory plan and the model construction.
// Registers --tensor-parallel-size N.
void add_tensor_parallel_flag(CLI::App& app, int& size);
// Registers --moe-split auto|expert|intermediate: how tensor-parallel ranks split the routed experts.
void add_moe_split_flag(CLI::App& app, std::string& value);
// Whether the ranks split the routed experts by expert (TensorParallel::expert_parallel): "expert" or
// "intermediate" as asked, "auto" (or "") by expert_parallel_by_rule (models/tensor_parallel.h).
bool resolve_expert_parallel(const std::string& flag, const ModelConfig& config, int tp_size);
// kInvalidInput naming the flag: a size below 1, or above 1 with --device `device` other than cpu on a machine
// with fewer GPUs than this node's ranks (one GPU per rank; size / nnodes ranks a node). Checked before --device
// cuda is (model_options_from_flags), so a build without CUDA says the same.
void check_tensor_parallel_size(int size, const std::string& device, int nnodes = 1);
// The memory plan of one of `tp_size` ranks: its shard of the weights (weight_bytes of the rank's config,
// models/tensor_parallel.h rank_config: the rank's heads, groups, intermediate columns and vocabulary rows), the
// KV cache of its KV heads, the Mamba state of its heads, and a workspace with whole logits rows (every rank
// gathers them). tp_size 1: plan_memory. A size that does not split is rank_config's kInvalidInput naming the
// config field.
MemoryPlan plan_rank_memory(const ModelConfig& config, int tp_size, DType weight_dtype, DType act_dtype,
                            const MemoryLimits& limits, ops::WeightFormat linear_format = ops::WeightFormat::kDense);

// Tensor parallelism over processes, possibly on several hosts (generate, bench and serve; dist::HostGroup):
// --nnodes N processes each hold --tensor-parallel-size / N ranks (node k: ranks [k * size / N, (k + 1) * size /
// N)); node 0 (listening on --master-port) runs the engine (and the command's output, or the server), the others
// (connecting to --master-addr:--master-port) run their ranks' part of every step until node 0 ends. Every node is
// started with the same flags but --node-rank. With --device cuda a node's ranks take its GPUs 0, 1, ... in order
// (CUDA_VISIBLE_DEVICES picks which, e.g. two nodes on one host).
struct NodeOptions {
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  double timeout_s = 60;  // --dist-timeout: joining, and each collective
  bool remote() const { return nnodes > 1; }
};
void add_node_flags(CLI::App& app, NodeOptions& nodes);
// kInvalidInput naming the flag: nnodes < 1, a node rank out of range, a size that does not split over the nodes,
// a port out of range, a timeout <= 0.
void check_node_options(const NodeOptions& nodes, int tp_size);
// A node other than 0: its ranks' models, joined to node 0, serving its steps until it stops (or fails:
// kRuntime naming the node that went away). With `limits` the memory plan of its ranks is checked first.
// `allreduce`: as load_engine_model's (every node must pass the same).
void run_worker_node(const ModelSource& src, const ModelOptions& options, int tp_size, const NodeOptions& nodes,
                     const std::optional<MemoryLimits>& limits = std::nullopt,
                     dist::AllReduceStrategy allreduce = dist::AllReduceStrategy::kAuto);

// The model an Engine runs: the loaded NemotronH, or with tensor parallelism the TensorParallelModel of its ranks
// (each made here with its shard; `loaded` then keeps the config, checkpoint and tokenizer but no model).
struct EngineModel {
  LoadedModel loaded;
  std::unique_ptr<TensorParallelModel> tp;
  const Model& model() const { return tp ? static_cast<const Model&>(*tp) : *loaded.model; }
  int tensor_parallel_size() const { return tp ? tp->tensor_parallel_size() : 1; }
};
// load_model for tp_size 1; otherwise the ranks' models, on the CPU or rank r on GPU r. With `limits` the memory
// plan is checked first as load_model does: for tp_size ranks of plan_rank_memory against the host's free memory
// on the CPU (a sharded tensor is a copy, not a view of the checkpoint's mapping, so a checkpoint's weights count
// too), one rank's plan against each GPU's free memory on CUDA.
// With `nodes` spanning several processes this is node 0's part: its ranks, joined to the other nodes.
// `allreduce`: the strategy of CUDA ranks' fused AllReduce (--allreduce-strategy; kAuto: the tuned table).
EngineModel load_engine_model(const ModelSource& src, const ModelOptions& options, int tp_size,
                              const std::optional<MemoryLimits>& limits = std::nullopt, const NodeOptions& nodes = {},
                              dist::AllReduceStrategy allreduce = dist::AllReduceStrategy::kAuto);

}  // namespace chimera::cli
