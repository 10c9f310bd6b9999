#include "model_loading.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <functional>

#include <fmt/core.h>

#include "backends/device_api.h"
#include "core/error.h"
#include "io/model_presets.h"
#include "io/quant_config.h"
#include "models/remote_ranks.h"
#include "models/tensor_parallel.h"
#include "runtime/state_cache.h"
#include "tokenizer/synthetic_tokenizer.h"

namespace chimera::cli {

std::string default_model_dir() {
  return CHIMERA_DEFAULT_MODEL_DIR;
}

void add_model_source(CLI::App& app, ModelSource& s) {
  s.model_dir = default_model_dir();
  app.add_option("-m,--model", s.model_dir, "Model directory (config.json, *.safetensors, tokenizer.json)")
      ->capture_default_str();
  std::string presets;
  for (const std::string& n : model_preset_names()) presets += (presets.empty() ? "" : ", ") + n;
  app.add_option("--synthetic", s.synthetic,
                 "Random-weight model from a config preset instead of a checkpoint: " + presets);
  app.add_option("--num-layers", s.num_layers, "With --synthetic: keep the first N layers of the pattern")
      ->check(CLI::PositiveNumber);
  app.add_option("--synthetic-seed", s.synthetic_seed, "With --synthetic: seed of the random weights")
      ->capture_default_str();
  app.add_option("--quantization", s.quantization,
                 "Quantize a dense checkpoint's or a --synthetic model's linear layers at load, as ModelOpt's weight "
                 "quantizers do (fp8: per-tensor scale; nvfp4: 16-element blocks); weight-only (no calibration); "
                 "lm_head, the router, conv1d and the embeddings stay dense")
      ->check(CLI::IsMember({"fp8", "nvfp4"}));
}

ops::WeightFormat ModelSource::quantize() const {
  if (quantization == "fp8") return ops::WeightFormat::kFp8;
  if (quantization == "nvfp4") return ops::WeightFormat::kNvfp4;
  if (!quantization.empty()) invalid_input("--quantization {}: expected fp8 or nvfp4", quantization);
  return ops::WeightFormat::kDense;
}

void add_speculative_config_flag(CLI::App& app, std::string& value) {
  app.add_option("--speculative-config", value,
                 "Speculative decoding as JSON, e.g. '{\"method\": \"mtp\", \"num_speculative_tokens\": 3}': "
                 "the checkpoint's multi-token-prediction head drafts K tokens a step, verified in one step");
}

SpeculativeConfig speculative_config_from_flag(const std::string& value) {
  if (value.empty()) return {};
  return parse_speculative_config(value, "--speculative-config");
}

void add_ssm_cache_dtype_flag(CLI::App& app, std::string& value) {
  app.add_option("--mamba-ssm-cache-dtype", value,
                 "Mamba SSM state cache: float32, bfloat16 (round to nearest even), float16 (stochastic rounding) "
                 "or auto (the checkpoint config's mamba_ssm_cache_dtype, float32 when it has none)")
      ->check(CLI::IsMember({"auto", "float32", "bfloat16", "float16"}))
      ->default_str("auto");
}

DType resolve_ssm_cache_dtype(const std::string& flag, const ModelConfig& config) {
  if (!flag.empty() && flag != "auto") return parse_ssm_cache_dtype(flag, "--mamba-ssm-cache-dtype");
  return parse_ssm_cache_dtype(config.mamba_ssm_cache_dtype, "config.json field 'mamba_ssm_cache_dtype'");
}

void add_kv_cache_dtype_flag(CLI::App& app, std::string& value) {
  app.add_option("--kv-cache-dtype", value,
                 "KV cache: auto (the activation dtype) or fp8 (E4M3 with per-tensor k / v scales, 1 byte an element)")
      ->check(CLI::IsMember({"auto", "fp8"}))
      ->capture_default_str();
}

ModelConfig load_source_config(const ModelSource& src) {
  if (!src.is_synthetic()) {
    if (src.num_layers != 0) invalid_input("--num-layers needs --synthetic (a checkpoint has all its layers)");
    std::error_code ec;
    if (!std::filesystem::exists(src.model_dir, ec)) invalid_input("model directory '{}' does not exist", src.model_dir);
    if (!std::filesystem::is_directory(src.model_dir, ec)) {
      invalid_input("-m {}: is a file; -m names a model directory (config.json, *.safetensors, tokenizer.json)",
                    src.model_dir);
    }
    return load_model_config(src.model_dir);
  }
  ModelConfig c = model_preset(src.synthetic);
  if (src.num_layers != 0) truncate_layers(c, src.num_layers);
  return c;
}

void check_tokenizer_fits(const Tokenizer& tok, const ModelConfig& config, const std::string& tokenizer_path,
                          const std::string& config_path) {
  // Fewer ids than embedding rows: the model can sample an id the tokenizer cannot decode, mid-generation.
  // More: the tokenizer can produce an id the embedding has no row for.
  if (tok.vocab_size() != config.vocab_size) {
    invalid_input("{} has {} token ids but {} says vocab_size {}: the tokenizer does not belong to this model",
                  tokenizer_path, tok.vocab_size(), config_path, config.vocab_size);
  }
}

ModelOptions model_options_from_flags(const std::string& device, const std::string& dtype) {
  ModelOptions mo;
  if (device == "cuda") {
    // A build without CUDA or a machine without a GPU: say which, before loading anything.
    if (!device::cuda_available()) invalid_input("--device cuda: {}", device::describe_cuda());
    mo.device = Device::kCuda;
    mo.dtype = dtype == "float32" ? DType::kF32 : DType::kBF16;
  } else if (!dtype.empty() && dtype != "float32") {
    invalid_input("--dtype {}: the CPU backend computes in float32 (use --device cuda for {})", dtype, dtype);
  }
  return mo;
}

size_t quantized_checkpoint_weight_bytes(const std::string& dir, DType dtype, const TensorParallel& tp) {
  // Quantized tensors (F8_E4M3 / U8 weights and block scales, F32 scales) go to the GPU as stored, float tensors in
  // `dtype`, the small parameters NemotronH keeps in fp32 at 4 bytes; mtp.* tensors stay on the host.
  const Checkpoint ck = Checkpoint::open(dir);
  const auto share = rank_shares(load_model_config(dir), tp);
  const auto wsize = static_cast<int64_t>(dtype_size(dtype));
  double bytes = 0;
  for (const std::string& name : ck.names()) {
    if (name.rfind("mtp.", 0) == 0) continue;
    const TensorInfo& info = ck.info(name);
    int64_t n = 1;
    for (const int64_t d : info.shape) n *= d;
    const bool scale = name.find("_scale") != std::string::npos;
    const bool f32 = name.ends_with("A_log") || name.ends_with(".D") || name.ends_with("dt_bias") ||
                     name.ends_with("e_score_correction_bias") || name.ends_with("mixer.gate.weight");
    const int64_t stored = info.dtype == DType::kF8E4M3 || info.dtype == DType::kU8 || scale
                               ? n * static_cast<int64_t>(dtype_size(info.dtype))
                               : n * (f32 ? 4 : wsize);
    bytes += static_cast<double>(stored) * share(name, n);
  }
  return static_cast<size_t>(std::llround(bytes));
}

LoadedModel load_model(const ModelSource& src, bool with_weights, const ModelOptions& flag_options,
                       const std::optional<MemoryLimits>& limits) {
  namespace fs = std::filesystem;
  ModelOptions options = flag_options;
  options.quantize = src.quantize();
  LoadedModel m;
  m.config = load_source_config(src);
  if (with_weights && limits) {
    // Synthetic weights are generated in options.dtype; a checkpoint goes to the GPU in options.dtype, and on the
    // CPU is memory-mapped (its weights take no allocation: only the caches and workspace are checked).
    const DType act = options.device == Device::kCpu ? DType::kF32 : options.dtype;
    MemoryPlan plan = plan_memory(m.config, options.dtype, act, *limits, options.quantize);
    if (options.device == Device::kCpu && !src.is_synthetic()) {
      plan.weights = 0;
    } else if (!src.is_synthetic() && load_quant_config(src.model_dir)) {
      plan.weights = quantized_checkpoint_weight_bytes(src.model_dir, options.dtype);
    }
    check_memory_plan(plan, device::memory_info(options.device).free, options.device == Device::kCuda ? "GPU" : "host");
  }
  if (src.is_synthetic()) {
    if (with_weights) {
      m.model = std::make_unique<NemotronH>(NemotronH::synthetic(m.config, options, src.synthetic_seed));
    }
    // Borrow -m's tokenizer when that model has the preset's vocabulary size (its ids mean the same thing).
    const fs::path dir(src.model_dir), tok = dir / "tokenizer.json";
    if (fs::exists(tok) && fs::exists(dir / "config.json") &&
        load_model_config(dir).vocab_size == m.config.vocab_size) {
      m.tokenizer.emplace(Tokenizer::load(tok));
    } else {
      // No tokenizer with the published vocabulary is at hand: a byte-level one of the same size lets text
      // prompts and text output work (its ids are not the real model's, nor are the random weights).
      m.tokenizer.emplace(synthetic_byte_level_tokenizer(m.config.vocab_size, m.config.eos_token_ids));
      m.synthetic_tokenizer = true;
    }
    return m;
  }
  // The tokenizer first: a mismatch with the config is found before any weights are read.
  const fs::path tok = fs::path(src.model_dir) / "tokenizer.json";
  std::error_code ec;
  if (fs::exists(tok, ec)) {
    m.tokenizer.emplace(Tokenizer::load(tok));
    check_tokenizer_fits(*m.tokenizer, m.config, tok.string(), (fs::path(src.model_dir) / "config.json").string());
  }
  m.checkpoint = std::make_unique<Checkpoint>(Checkpoint::open(src.model_dir));
  if (with_weights) m.model = std::make_unique<NemotronH>(NemotronH::load(m.config, *m.checkpoint, options));
  return m;
}

void add_tensor_parallel_flag(CLI::App& app, int& size) {
  app.add_option("--tensor-parallel-size", size,
                 "Shard the model over N ranks: threads of this process, one GPU each with --device cuda (with "
                 "--nnodes: threads of several processes, possibly on several hosts)")
      ->capture_default_str();
}

void add_moe_split_flag(CLI::App& app, std::string& value) {
  app.add_option("--moe-split", value,
                 "With --tensor-parallel-size: split the routed experts by expert (each rank holds E / N whole "
                 "experts), by their intermediate dimension, or auto (by expert where the intermediate slices would "
                 "be narrow)")
      ->check(CLI::IsMember({"auto", "expert", "intermediate"}))
      ->capture_default_str();
}

bool resolve_expert_parallel(const std::string& flag, const ModelConfig& config, int tp_size) {
  if (flag == "expert") return true;
  if (flag == "intermediate") return false;
  if (!flag.empty() && flag != "auto") invalid_input("--moe-split {}: expected auto, expert or intermediate", flag);
  return expert_parallel_by_rule(config, tp_size);
}

void check_tensor_parallel_size(int size, const std::string& device, int nnodes) {
  if (size < 1) invalid_input("--tensor-parallel-size must be >= 1, got {}", size);
  const int local = nnodes > 1 && size % nnodes == 0 ? size / nnodes : size;
  if (size > 1 && device != "cpu" && device::device_count() < local) {
    if (local == size) {
      invalid_input("--tensor-parallel-size {}: needs {} GPUs (one per rank), this machine has {}", size, size,
                    device::device_count());
    }
    invalid_input(
        "--tensor-parallel-size {} over --nnodes {}: needs {} GPUs on every node (one per rank), this "
        "machine has {}",
        size, nnodes, local, device::device_count());
  }
}

MemoryPlan plan_rank_memory(const ModelConfig& config, int tp_size, DType weight_dtype, DType act_dtype,
                            const MemoryLimits& limits, ops::WeightFormat linear_format) {
  if (tp_size == 1) return plan_memory(config, weight_dtype, act_dtype, limits, linear_format);
  const ModelConfig local = rank_config(config, TensorParallel{0, tp_size});
  // The caches and workspace as the engine sizes them (TensorParallelModel::config(): the rank's config with the
  // whole vocabulary, the width of the gathered logits); the weights with the rank's vocabulary rows.
  ModelConfig engine = local;
  engine.vocab_size = config.vocab_size;
  MemoryPlan plan = plan_memory(engine, weight_dtype, act_dtype, limits, linear_format);
  plan.weights = plan_memory(local, weight_dtype, act_dtype, limits, linear_format).weights;
  return plan;
}

void add_node_flags(CLI::App& app, NodeOptions& nodes) {
  app.add_option("--nnodes", nodes.nnodes,
                 "Processes (nodes) the --tensor-parallel-size ranks are spread over (each holds an equal share)")
      ->capture_default_str();
  app.add_option("--node-rank", nodes.node_rank, "This process's node (0 runs the engine and listens)")
      ->capture_default_str();
  app.add_option("--master-addr", nodes.master_addr, "Node 0's address, which the other nodes connect to")
      ->capture_default_str();
  app.add_option("--master-port", nodes.master_port, "The port node 0 listens on")->capture_default_str();
  app.add_option("--dist-timeout", nodes.timeout_s,
                 "Seconds a node waits for the others to join, and in each collective")
      ->capture_default_str();
}

void check_node_options(const NodeOptions& nodes, int tp_size) {
  if (nodes.nnodes < 1) invalid_input("--nnodes must be >= 1, got {}", nodes.nnodes);
  if (nodes.node_rank < 0 || nodes.node_rank >= nodes.nnodes) {
    invalid_input("--node-rank {}: must be in 0..{} for --nnodes {}", nodes.node_rank, nodes.nnodes - 1, nodes.nnodes);
  }
  if (tp_size % nodes.nnodes != 0) {
    invalid_input("--nnodes {}: --tensor-parallel-size {} (every rank) does not split over them", nodes.nnodes,
                  tp_size);
  }
  if (nodes.master_port < 1 || nodes.master_port > 65535) {
    invalid_input("--master-port {}: must be in 1..65535", nodes.master_port);
  }
  if (!(nodes.timeout_s > 0)) invalid_input("--dist-timeout {}: must be positive", nodes.timeout_s);
}

namespace {

// `count` ranks of plan `rank` each, all in this host's memory (CPU ranks: every rank holds its shard and its copy
// of the caches).
void check_host_ranks_plan(const MemoryPlan& rank, int count) {
  const auto n = static_cast<size_t>(count);
  MemoryPlan all = rank;
  all.weights *= n;
  all.kv_cache *= n;
  all.mamba_state *= n;
  all.workspace *= n;
  check_memory_plan(all, device::memory_info(Device::kCpu).free,
                    fmt::format("host ({} ranks of {} each)", count, gib(rank.total())));
}

// One rank's model of `src` (options.tp says which): synthetic weights, or its shard of the checkpoint.
std::function<NemotronH(const ModelOptions&)> rank_maker(const LoadedModel& loaded, const ModelSource& src) {
  return [&loaded, &src](const ModelOptions& rank_options) {
    return src.is_synthetic() ? NemotronH::synthetic(loaded.config, rank_options, src.synthetic_seed)
                              : NemotronH::load(loaded.config, *loaded.checkpoint, rank_options);
  };
}

// This node's GPUs for `count` CUDA ranks: 0, 1, ... (empty on the CPU).
std::vector<int> node_devices(const ModelOptions& options, int count) {
  std::vector<int> devices;
  for (int i = 0; options.device == Device::kCuda && i < count; ++i) devices.push_back(i);
  return devices;
}

// The memory plan of `devices.size()` CUDA ranks (one per GPU) or `count` CPU ranks, checked as load_engine_model
// says; a ModelOpt checkpoint's weights count as stored, rank `first`'s share.
void check_ranks_plan(const ModelSource& src, const ModelConfig& c, const ModelOptions& options, int tp_size, int first,
                      int count, const std::vector<int>& devices, const MemoryLimits& limits) {
  const bool cuda = options.device == Device::kCuda;
  const DType act = cuda ? options.dtype : DType::kF32;
  MemoryPlan rank = plan_rank_memory(c, tp_size, options.dtype, act, limits, options.quantize);
  if (cuda && !src.is_synthetic() && load_quant_config(src.model_dir)) {
    rank.weights = quantized_checkpoint_weight_bytes(src.model_dir, options.dtype, TensorParallel{first, tp_size});
  }
  if (!cuda) return check_host_ranks_plan(rank, count);
  for (size_t i = 0; i < devices.size(); ++i) {
    const device::DeviceGuard on(devices[i]);
    check_memory_plan(rank, device::memory_info(Device::kCuda).free,
                      fmt::format("GPU {} (rank {} of {})", devices[i], first + static_cast<int>(i), tp_size));
  }
}

// The ranks [first, first + count) of tp_size (rank first + i on devices[i] with CUDA), with their memory plan
// checked first.
std::vector<NemotronH> load_ranks(const LoadedModel& loaded, const ModelSource& src, const ModelOptions& flag_options,
                                  int tp_size, int first, int count, const std::vector<int>& devices,
                                  const std::optional<MemoryLimits>& limits) {
  ModelOptions options = flag_options;
  options.quantize = src.quantize();
  if (limits) check_ranks_plan(src, loaded.config, options, tp_size, first, count, devices, *limits);
  return TensorParallelModel::make_ranks(tp_size, first, count, options, rank_maker(loaded, src), devices);
}

std::unique_ptr<dist::HostGroup> join_nodes(int tp_size, const NodeOptions& nodes) {
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(nodes.timeout_s * 1000.0 + 0.5));
  return std::make_unique<dist::HostGroup>(tp_size, nodes.nnodes, nodes.node_rank, nodes.master_addr, nodes.master_port,
                                           std::max(timeout, std::chrono::milliseconds(1)));
}

}  // namespace

void run_worker_node(const ModelSource& src, const ModelOptions& options, int tp_size, const NodeOptions& nodes,
                     const std::optional<MemoryLimits>& limits, dist::AllReduceStrategy allreduce) {
  check_tensor_parallel_size(tp_size, options.device == Device::kCpu ? "cpu" : "cuda", nodes.nnodes);
  check_node_options(nodes, tp_size);
  const LoadedModel loaded = load_model(src, /*with_weights=*/false, options);
  const int local = tp_size / nodes.nnodes;
  const std::vector<int> devices = node_devices(options, local);
  std::vector<NemotronH> ranks =
      load_ranks(loaded, src, options, tp_size, nodes.node_rank * local, local, devices, limits);
  const std::unique_ptr<dist::HostGroup> group = join_nodes(tp_size, nodes);
  run_remote_ranks(*group, ranks, ops::Context{options.device, nullptr, nullptr, {}}, devices, allreduce);
}

EngineModel load_engine_model(const ModelSource& src, const ModelOptions& flag_options, int tp_size,
                              const std::optional<MemoryLimits>& limits, const NodeOptions& nodes,
                              dist::AllReduceStrategy allreduce) {
  check_tensor_parallel_size(tp_size, flag_options.device == Device::kCpu ? "cpu" : "cuda", nodes.nnodes);
  check_node_options(nodes, tp_size);
  EngineModel e;
  if (tp_size == 1) {
    e.loaded = load_model(src, /*with_weights=*/true, flag_options, limits);
    return e;
  }
  e.loaded = load_model(src, /*with_weights=*/false, flag_options);
  const int local = tp_size / nodes.nnodes;
  std::vector<int> devices = node_devices(flag_options, local);  // CUDA: rank r on GPU r
  std::vector<NemotronH> ranks = load_ranks(e.loaded, src, flag_options, tp_size, 0, local, devices, limits);
  if (nodes.remote()) {
    e.tp = std::make_unique<TensorParallelModel>(std::move(ranks), join_nodes(tp_size, nodes), std::move(devices),
                                                 allreduce);
  } else {
    e.tp = std::make_unique<TensorParallelModel>(std::move(ranks), std::chrono::seconds(60), std::move(devices),
                                                 allreduce);
  }
  return e;
}

LoadedModel load_model_dir(const std::string& dir, bool with_weights, const ModelOptions& options) {
  ModelSource src;
  src.model_dir = dir;
  return load_model(src, with_weights, options);
}

}  // namespace chimera::cli
