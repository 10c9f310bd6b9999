// chimera bench: end-to-end throughput through the Engine, as `generate` uses it.
//   prefill  one sequence of each --input-lens length: time to first token (chunked prefill by the scheduler's
//            token budget, as in the product), tokens/s = input length / TTFT
//   decode   --batch-sizes sequences, each after a --decode-context-token prefill: time per output token = the
//            time of one engine step with every sequence decoding; tokens/s = batch / step time
// Prompts are random token ids (seeded), sampling is greedy with ignore_eos. Beside the numbers: the batch-1
// decode roofline (runtime/roofline.h) and the ratio achieved / roofline. A size whose caches do not fit the
// device's free memory (runtime/memory_plan.h) is reported as skipped, not failed.
// --profile: after the timed runs, one more prefill (the first --input-lens length, every step up to the first
// token) and one more decode step per batch size run with the profiler armed (runtime/profiler.h): time per op
// kind, the ops' sum, and the step's wall time, printed after the tables and written to the JSON.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <limits>
#include <memory>
#include <random>
#include <set>
#include <thread>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "backends/device_api.h"
#include "commands.h"
#include "core/error.h"
#include "core/parallel.h"
#include "dist/strategy.h"
#include "model_loading.h"
#include "runtime/cache_sizing.h"
#include "runtime/engine.h"
#include "runtime/kernel_env.h"
#include "runtime/memory_plan.h"
#include "runtime/profiler.h"
#include "runtime/roofline.h"

#ifndef CHIMERA_GIT_COMMIT
#define CHIMERA_GIT_COMMIT "unknown"
#endif

namespace chimera::cli {

void add_bench(CLI::App& app, BenchOptions& o) {
  const CLI::Range kPositiveInt(1, std::numeric_limits<int32_t>::max());
  add_model_source(app, o.source);
  app.add_option("--device", o.device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}))->capture_default_str();
  app.add_option("--dtype", o.dtype,
                 "Weights and activations on CUDA: bfloat16 (default) or float32; the CPU computes in float32")
      ->check(CLI::IsMember({"bfloat16", "float32"}));
  add_ssm_cache_dtype_flag(app, o.mamba_ssm_cache_dtype);
  add_speculative_config_flag(app, o.speculative_config);
  add_kv_cache_dtype_flag(app, o.kv_cache_dtype);
  app.add_option("--input-lens", o.input_lens, "Prefill: prompt lengths, comma-separated (one sequence each)")
      ->delimiter(',')
      ->check(kPositiveInt)
      ->capture_default_str();
  app.add_option("--batch-sizes", o.batch_sizes, "Decode: batch sizes, comma-separated")
      ->delimiter(',')
      ->check(kPositiveInt)
      ->capture_default_str();
  app.add_option("--decode-context", o.decode_context, "Decode: prompt tokens per sequence before decoding")
      ->check(kPositiveInt)
      ->capture_default_str();
  app.add_option("--decode-steps", o.decode_steps, "Decode: timed steps per batch size")
      ->check(kPositiveInt)
      ->capture_default_str();
  app.add_option("--warmup", o.warmup, "Untimed runs (prefill) / steps (decode) before each measurement")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_flag("!--no-cuda-graphs", o.cuda_graphs,
               "CUDA: run every decode step eagerly instead of replaying the CUDA graphs captured at start-up");
  app.add_flag("!--no-pdl", o.pdl,
               "CUDA: launch kernels without programmatic dependent launch (each kernel starts only after its "
               "predecessor has drained), to measure what PDL buys");
  app.add_option("--bandwidth-gbs", o.bandwidth_gbs,
                 "Memory bandwidth for the batch-1 roofline, GB/s (default: the H200's measured copy rate)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--seed", o.seed, "Seed of the random prompt ids")->capture_default_str();
  app.add_option("--json-out", o.json_out, "Write every measurement, with date, commit and device, to FILE (JSON)");
  add_tensor_parallel_flag(app, o.tensor_parallel_size);
  add_node_flags(app, o.nodes);
  add_moe_split_flag(app, o.moe_split);
  app.add_flag("--profile", o.profile,
               "Also time one prefill (first --input-lens length) and one decode step per batch size per op kind "
               "(NVTX ranges + CUDA events; steady_clock on the CPU)");
}

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::vector<int32_t> random_ids(std::mt19937_64& rng, int64_t vocab, int32_t n) {
  std::uniform_int_distribution<int32_t> dist(0, static_cast<int32_t>(vocab - 1));
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (int32_t& id : ids) id = dist(rng);
  return ids;
}

std::string cpu_description() {
  std::ifstream f("/proc/cpuinfo");
  std::string line, name = "unknown CPU";
  while (std::getline(f, line)) {
    if (line.rfind("model name", 0) == 0) {
      const auto c = line.find(':');
      if (c != std::string::npos) name = line.substr(line.find_first_not_of(" \t", c + 1));
      break;
    }
  }
  return fmt::format("CPU: {}, {} threads", name, num_threads());
}

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

// The weights' dtype: what a synthetic model is generated in / a checkpoint is uploaded in; a checkpoint on
// the CPU stays in its own dtype (zero-copy).
DType weight_dtype_of(const BenchOptions& o, const ModelConfig& c, const ModelOptions& mo) {
  if (mo.device == Device::kCuda || o.source.is_synthetic()) return mo.dtype;
  if (c.torch_dtype == "float32") return DType::kF32;
  if (c.torch_dtype == "float16") return DType::kF16;
  return DType::kBF16;
}

nlohmann::json profile_json(const StepProfile& p) {
  nlohmann::json ops = nlohmann::json::array();
  for (const OpStat& s : p.ops) {
    ops.push_back({{"op", s.op},
                   {"calls", s.calls},
                   {"total_ms", s.total_ms},
                   {"percent_of_step", p.wall_ms > 0 ? 100.0 * s.total_ms / p.wall_ms : 0.0}});
  }
  return {{"step", p.name},
          {"wall_ms", p.wall_ms},
          {"span_ms", p.span_ms},
          {"ops_sum_ms", p.ops_ms},
          {"host_overhead_ms", p.wall_ms - p.ops_ms},  // wall - sum: launch gaps and host work
          {"calls", p.calls},
          {"untimed_calls", p.untimed_calls},
          {"ops", ops}};
}

struct Runner {
  const BenchOptions& o;
  const Model& model;  // one NemotronH, or the TensorParallelModel of --tensor-parallel-size ranks
  ops::Context ctx;  // ctx.profiler is set with --profile (passive until a step is armed)
  DType weight_dtype;
  SchedulerConfig sched_defaults;
  std::vector<StepProfile>* profiles = nullptr;  // --profile: the profiled steps, in order
  DType ssm_dtype = DType::kF32;                  // --mamba-ssm-cache-dtype

  // Caches and workspace of an engine for these limits (the weights are loaded already), or "" when they fit.
  std::string does_not_fit(int32_t seqs, int32_t model_len) const {
    MemoryLimits lim;
    if (ctx.device == Device::kCuda && o.cuda_graphs) {  // the engine's buckets (runtime/engine.h)
      const int32_t k = speculative_config_from_flag(o.speculative_config).num_speculative_tokens;
      lim.graph_pad_rows = cuda_graph_pad_rows(k > 0 ? speculative_graph_batch_sizes(seqs, k, CacheSizes{}.block_size)
                                                     : cuda_graph_batch_sizes(seqs));
    }
    lim.max_num_seqs = seqs;
    lim.max_model_len = model_len;
    lim.max_tokens_per_step = std::min(sched_defaults.max_num_batched_tokens, model_len);
    lim.block_size = CacheSizes{}.block_size;
    lim.ssm_dtype = ssm_dtype;
    lim.kv_cache_fp8 = o.kv_cache_dtype == "fp8";
    // With tensor parallelism model.config() is one rank's (its caches' geometry); every rank holds a copy.
    const MemoryPlan p = plan_memory(model.config(), weight_dtype, model.activation_dtype(), lim);
    const size_t need = (p.total() - p.weights) * static_cast<size_t>(model.tensor_parallel_size());
    const size_t free_b = device::memory_info(ctx.device).free;
    if (need <= free_b) return "";
    return fmt::format("skipped (needs {} beyond the weights: KV {}, Mamba state {}, workspace {}; {} free)", gib(need),
                       gib(p.kv_cache), gib(p.mamba_state), gib(p.workspace), gib(free_b));
  }

  EngineConfig engine_config(int32_t seqs, int32_t model_len) const {
    EngineConfig ec;
    ec.scheduler = sched_defaults;
    ec.scheduler.max_num_seqs = seqs;
    ec.cache.max_seqs = seqs;
    ec.cache.max_model_len = model_len;
    ec.cache.ssm_dtype = ssm_dtype;
    ec.cache.kv_cache_fp8 = o.kv_cache_dtype == "fp8";
    ec.cuda_graphs = o.cuda_graphs;
    ec.speculative = speculative_config_from_flag(o.speculative_config);
    return ec;
  }

  nlohmann::json prefill(int32_t len, bool profile_prefill) const {
    nlohmann::json r = {{"input_len", len}};
    const int32_t model_len = len + 1;
    if (std::string why = does_not_fit(1, model_len); !why.empty()) {
      r["status"] = "skipped";
      r["reason"] = why;
      return r;
    }
    Engine engine(model, ctx, engine_config(1, model_len));
    std::mt19937_64 rng(o.seed + static_cast<uint64_t>(len));
    SamplingParams sp;  // greedy
    sp.max_new_tokens = 1;
    sp.ignore_eos = true;
    double secs = 0;
    int32_t steps = 0, first_token = -1;
    for (int32_t run = 0; run <= o.warmup; ++run) {  // the last run is timed
      const std::vector<int32_t> prompt = random_ids(rng, model.config().vocab_size, len);
      steps = 0;
      const auto t0 = Clock::now();
      engine.add_request(prompt, sp);
      bool first = false;
      while (!first && engine.has_unfinished()) {
        ++steps;
        for (const TokenEvent& ev : engine.step()) {
          if (ev.token >= 0) first = true, first_token = ev.token;
        }
      }
      secs = seconds_since(t0);
      while (engine.has_unfinished()) engine.step();
      engine.take_finished();
    }
    r["status"] = "ok";
    r["ttft_ms"] = secs * 1e3;
    r["tokens_per_s"] = len / secs;
    r["steps"] = steps;
    r["first_token"] = first_token;  // greedy: runs of one seed compare by it (e.g. tensor parallel vs one rank)
    if (profile_prefill) {  // one more prefill, armed from the request to its first token
      engine.add_request(random_ids(rng, model.config().vocab_size, len), sp);
      ctx.profiler->begin_step(fmt::format("prefill input_len={}", len));
      int32_t prof_steps = 0;
      bool first = false;
      while (!first && engine.has_unfinished()) {
        ++prof_steps;
        for (const TokenEvent& ev : engine.step()) first |= ev.token >= 0;
      }
      StepProfile p = ctx.profiler->end_step();
      if (prof_steps > 1)
        p.name += fmt::format(" ({} steps of <= {} tokens)", prof_steps, sched_defaults.max_num_batched_tokens);
      while (engine.has_unfinished()) engine.step();
      engine.take_finished();
      r["profile"] = profile_json(p);
      profiles->push_back(std::move(p));
    }
    return r;
  }

  // `cuda_graphs`: the engine replays its start-up CUDA graphs (CUDA); `profile`: one more step, armed (it
  // must be eager: a graph replay dispatches no op).
  nlohmann::json decode(int32_t batch, double roofline_tps, bool cuda_graphs, bool profile) const {
    nlohmann::json r = {{"batch_size", batch}, {"decode_context", o.decode_context}};
    // Sequences that finish their prefill early decode while the others prefill (as in the product); leave
    // room for those tokens, the warm-up and the timed steps, so no sequence finishes before the timing ends.
    const int64_t budget = sched_defaults.max_num_batched_tokens;
    const int64_t prefill_steps = (int64_t{batch} * o.decode_context + budget - 1) / budget + batch;
    // A verify step emits up to K + 1 tokens per sequence.
    const int64_t per_step = int64_t{1} + speculative_config_from_flag(o.speculative_config).num_speculative_tokens;
    const auto new_tokens =
        static_cast<int32_t>(prefill_steps + per_step * (o.warmup + o.decode_steps + 1 + (profile ? 1 : 0)));
    const int32_t model_len = o.decode_context + new_tokens;
    if (std::string why = does_not_fit(batch, model_len); !why.empty()) {
      r["status"] = "skipped";
      r["reason"] = why;
      return r;
    }
    EngineConfig ec = engine_config(batch, model_len);
    ec.cuda_graphs = cuda_graphs;
    Engine engine(model, ctx, ec);
    std::mt19937_64 rng(o.seed + 7919 * static_cast<uint64_t>(batch));
    SamplingParams sp;  // greedy
    sp.max_new_tokens = new_tokens;
    sp.ignore_eos = true;
    std::vector<int32_t> generated(static_cast<size_t>(batch), 0);
    std::vector<int32_t> first_tokens;  // sequence 0's tokens, greedy: runs of one seed compare by them
    for (int32_t i = 0; i < batch; ++i) {
      engine.add_request(random_ids(rng, model.config().vocab_size, o.decode_context), sp);
    }
    auto count = [&](const std::vector<TokenEvent>& evs) {
      for (const TokenEvent& ev : evs) {
        if (ev.token < 0) continue;
        ++generated[static_cast<size_t>(ev.seq_id)];
        if (ev.seq_id == 0) first_tokens.push_back(ev.token);
      }
    };
    // Prefill every sequence (until each has its first token), then the warm-up steps.
    const auto t_prefill = Clock::now();
    while (std::any_of(generated.begin(), generated.end(), [](int32_t g) { return g == 0; })) {
      if (!engine.has_unfinished()) runtime_error("bench: a sequence finished before its first token");
      count(engine.step());
    }
    const double prefill_s = seconds_since(t_prefill);
    // The engine captured its CUDA graphs when it was built: the warm-up steps replay them already.
    for (int32_t s = 0; s < o.warmup; ++s) count(engine.step());
    double context_sum = 0;
    for (int32_t g : generated) context_sum += o.decode_context + g;
    int32_t partial_steps = 0;  // steps in which not every sequence decoded (should be none)
    int64_t timed_tokens = 0;   // tokens the timed steps emitted (K + 1 a sequence at most with speculation)
    const SpeculativeStats spec_before = engine.speculative_stats();
    double verify_s = 0.0, draft_s = 0.0;  // speculation: the timed steps' two parts (Engine::StepStats)
    const auto t0 = Clock::now();
    for (int32_t s = 0; s < o.decode_steps; ++s) {
      const std::vector<TokenEvent> evs = engine.step();
      verify_s += engine.last_step().verify_seconds;
      draft_s += engine.last_step().draft_seconds;
      std::set<int32_t> seqs;
      for (const TokenEvent& ev : evs) {
        if (ev.token >= 0) ++timed_tokens, seqs.insert(ev.seq_id);
      }
      if (static_cast<int32_t>(seqs.size()) != batch) ++partial_steps;
      count(evs);
    }
    const double secs = seconds_since(t0);
    if (profile) {  // one more step, armed
      ctx.profiler->begin_step(fmt::format("decode batch={}", batch));
      const std::vector<TokenEvent> evs = engine.step();
      StepProfile p = ctx.profiler->end_step();
      if (static_cast<int32_t>(evs.size()) != batch) p.name += fmt::format(" (only {} sequences decoded)", evs.size());
      count(evs);
      r["profile"] = profile_json(p);
      profiles->push_back(std::move(p));
    }
    r["status"] = "ok";
    r["step_ms"] = secs / o.decode_steps * 1e3;
    r["tpot_ms"] = secs / (static_cast<double>(timed_tokens) / batch) * 1e3;  // per token of one sequence
    r["tokens_per_s"] = static_cast<double>(timed_tokens) / secs;
    if (ec.speculative.enabled()) {  // the timed steps' drafts only
      const SpeculativeStats t = engine.speculative_stats().since(spec_before);
      r["speculative"] = {{"num_speculative_tokens", ec.speculative.num_speculative_tokens},
                          {"verify_ms", verify_s / o.decode_steps * 1e3},
                          {"draft_ms", draft_s / o.decode_steps * 1e3},
                          {"num_drafts", t.num_drafts},
                          {"num_draft_tokens", t.num_draft_tokens},
                          {"num_accepted_tokens", t.num_accepted_tokens},
                          {"accepted_per_position", t.accepted_per_position},
                          {"acceptance_rate", t.acceptance_rate()},
                          {"mean_acceptance_length", t.mean_acceptance_length()}};
    }
    r["steps"] = o.decode_steps;
    r["mean_context_at_start"] = context_sum / batch;
    r["prefill_ms"] = prefill_s * 1e3;
    r["partial_steps"] = partial_steps;
    r["tokens_of_sequence_0"] = first_tokens;
    r["cuda_graph"] = !engine.graph_batch_sizes().empty();
    if (r["cuda_graph"].get<bool>()) {
      r["graph_capture_s"] = engine.graph_capture_seconds();
      r["graph_pool_bytes"] = engine.graph_pool_bytes();
      r["graph_batch_sizes"] = engine.graph_batch_sizes();
    }
    if (batch == 1) r["roofline_ratio"] = r["tokens_per_s"].get<double>() / roofline_tps;
    return r;
  }
};

std::string cell(const nlohmann::json& r, const char* key, const char* fmt_spec) {
  if (!r.contains(key)) return "-";
  return fmt::format(fmt::runtime(fmt_spec), r[key].get<double>());
}

}  // namespace

int run_bench(const BenchOptions& o) {
  check_tensor_parallel_size(o.tensor_parallel_size, o.device, o.nodes.nnodes);
  check_node_options(o.nodes, o.tensor_parallel_size);
  ModelOptions mo = model_options_from_flags(o.device, o.dtype);
  mo.tp.expert_parallel = resolve_expert_parallel(o.moe_split, load_source_config(o.source), o.tensor_parallel_size);
  if (o.input_lens.empty() && o.batch_sizes.empty()) invalid_input("--input-lens and --batch-sizes are both empty");
  // The kernel configuration: the environment registry's overrides (runtime/kernel_env.h), then the flags.
  ops::KernelConfig kernels = kernel_config_from_env();
  if (!o.pdl) kernels.pdl = false;

  // Weights first (they must fit: a model that does not load is an error, not a skipped size).
  MemoryLimits load_limits;
  load_limits.max_num_seqs = 1;
  load_limits.max_model_len = CacheSizes{}.block_size;
  load_limits.max_tokens_per_step = load_limits.max_model_len;
  if (o.nodes.node_rank != 0) {  // another node's ranks: they follow node 0's engines, which print everything
    run_worker_node(o.source, mo, o.tensor_parallel_size, o.nodes, load_limits, o.allreduce_strategy);
    return 0;
  }
  const auto t_load = Clock::now();
  const EngineModel em =
      load_engine_model(o.source, mo, o.tensor_parallel_size, load_limits, o.nodes, o.allreduce_strategy);
  const double load_s = seconds_since(t_load);
  const ModelConfig& c = em.loaded.config;
  const int tp_size = em.tensor_parallel_size();
  // The weights' formats from rank 0 (every rank's layers are stored alike).
  const NemotronH& rank0 = em.tp ? em.tp->rank(0) : *em.loaded.model;

  // --profile: engines get a context with a profiler; it costs nothing until a step is armed. The profiled steps
  // must run eagerly (a replayed CUDA graph dispatches no ops:: call, so there would be nothing to time).
  std::unique_ptr<Profiler> profiler = o.profile ? std::make_unique<Profiler>(mo.device) : nullptr;
  std::vector<StepProfile> profiles;
  Runner run{o,
             em.model(),
             ops::Context{mo.device, nullptr, profiler.get(), kernels},
             weight_dtype_of(o, c, mo),
             SchedulerConfig{},
             &profiles,
             resolve_ssm_cache_dtype(o.mamba_ssm_cache_dtype, c)};
  DecodeRoofline roof = batch1_decode_roofline(c, run.weight_dtype, o.bandwidth_gbs * 1e9);
  // Quantized layers (a ModelOpt checkpoint or --quantization): the bytes the loaded weights take as stored.
  bool quantized = false;
  for (const auto& [kind, k] : weight_summary(c, rank0.weights())) {
    quantized = quantized || k.formats.find("fp8") != std::string::npos || k.formats.find("nvfp4") != std::string::npos;
  }
  if (quantized) {
    // With tensor parallelism: what all ranks read together.
    roof.bytes_per_token = 0;
    for (int r = 0; r < tp_size; ++r) {
      roof.bytes_per_token += decode_bytes_per_token(c, em.tp ? em.tp->rank(r).weights() : rank0.weights());
    }
    roof.tokens_per_s = roof.bandwidth / roof.bytes_per_token;
  }
  const std::string device_desc = mo.device == Device::kCuda ? device::describe_cuda() : cpu_description();
  const std::string model_name =
      o.source.is_synthetic() ? fmt::format("synthetic {} ({} layers)", o.source.synthetic, c.num_hidden_layers())
                              : o.source.model_dir;
  const std::string act = std::string(dtype_name(em.model().activation_dtype()));
  std::string wdt = std::string(dtype_name(run.weight_dtype));
  if (quantized) {
    wdt += ", linear layers";
    std::set<std::string> formats;
    for (const auto& [kind, k] : weight_summary(c, rank0.weights())) {
      if (k.formats != "dense") formats.insert(k.formats);
    }
    for (const std::string& f : formats) wdt += " " + f;
  }

  // The ranks' AllReduce: the fused kernels' strategy (forced, or the tuned table's) between GPUs; through host
  // memory for CPU ranks and ranks that share a GPU.
  const bool device_collectives = em.tp && em.tp->has_device_collectives();
  const std::string allreduce =
      device_collectives ? std::string(dist::strategy_name(o.allreduce_strategy)) : std::string("host");
  const std::string allreduce_note =
      fmt::format("{}, AllReduce {}", mo.tp.expert_parallel ? " (experts by expert)" : "", allreduce);
  // PDL as the kernels will see it: on by default on sm_90+, off with --no-pdl or CHIMERA_PDL=0.
  const bool pdl = mo.device == Device::kCuda && kernels.pdl && device::pdl_enabled();
  fmt::print("chimera bench | {} | {} {} (weights {}, SSM state {}, KV cache {}){} | {} | PDL {} | commit {}\n",
             model_name, o.device, act, wdt, ssm_cache_dtype_name(run.ssm_dtype), o.kv_cache_dtype,
             tp_size > 1 ? fmt::format(" | tensor parallel {}{}", tp_size, allreduce_note) : "", device_desc,
             pdl ? "on" : "off", CHIMERA_GIT_COMMIT);
  fmt::print(
      "roofline   batch-1 decode {:.1f} tok/s = {:.3f} GB/token at {:.0f} GB/s ({:.3f} B active params, "
      "{:.3f} B read per token)\n",
      roof.tokens_per_s, roof.bytes_per_token / 1e9, o.bandwidth_gbs, roof.active_params / 1e9, roof.params_read / 1e9);
  std::fflush(stdout);

  nlohmann::json prefill = nlohmann::json::array(), decode = nlohmann::json::array();
  bool failed = false;
  auto guarded = [&](auto&& measure, nlohmann::json base) {
    try {
      return measure();
    } catch (const Error& e) {
      failed = true;
      base["status"] = "failed";
      base["reason"] = e.what();
      return base;
    }
  };
  if (!o.input_lens.empty()) {
    fmt::print("\nprefill (1 sequence, time to first token)\n  {:>10} {:>12} {:>14}\n", "input len", "TTFT ms",
               "tok/s");
    for (size_t i = 0; i < o.input_lens.size(); ++i) {
      const int32_t len = o.input_lens[i];
      nlohmann::json r = guarded([&] { return run.prefill(len, o.profile && i == 0); }, {{"input_len", len}});
      if (r["status"] == "ok") {
        fmt::print("  {:>10} {:>12} {:>14}\n", len, cell(r, "ttft_ms", "{:.2f}"), cell(r, "tokens_per_s", "{:.1f}"));
      } else {
        fmt::print("  {:>10} {}\n", len, r["reason"].get<std::string>());
      }
      std::fflush(stdout);
      prefill.push_back(std::move(r));
    }
  }
  if (!o.batch_sizes.empty()) {
    fmt::print(
        "\ndecode ({}-token prefill per sequence; time per output token = step time / tokens a sequence gets a step, "
        "{} "
        "steps; CUDA graphs {}; "
        "PDL {})\n"
        "  {:>10} {:>12} {:>14} {:>14}\n",
        o.decode_context, o.decode_steps,
        mo.device == Device::kCuda && o.cuda_graphs ? (o.speculative_config.empty() ? "on" : "on (speculative steps)")
                                                    : "off",
        pdl ? "on" : "off", "batch", "TPOT ms", "tok/s", "vs roofline");
    for (int32_t b : o.batch_sizes) {
      const bool graphs = mo.device == Device::kCuda && o.cuda_graphs;
      nlohmann::json r =
          guarded([&] { return run.decode(b, roof.tokens_per_s, graphs, o.profile && !graphs); }, {{"batch_size", b}});
      if (o.profile && graphs && r["status"] == "ok") {
        // The timed engine replays CUDA graphs, which dispatch no op: profile the same decode on an eager engine.
        nlohmann::json e = guarded([&] { return run.decode(b, roof.tokens_per_s, false, true); }, {{"batch_size", b}});
        if (e.contains("profile")) {
          r["profile"] = e["profile"];
          r["profile"]["engine"] = "eager (the timed run used CUDA graphs)";
          r["profile"]["eager_tpot_ms"] = e["tpot_ms"];
          profiles.back().name += fmt::format(" (eager engine; its TPOT {:.3f} ms)", e["tpot_ms"].get<double>());
        }
      }
      if (r["status"] == "ok") {
        fmt::print("  {:>10} {:>12} {:>14} {:>14}\n", b, cell(r, "tpot_ms", "{:.3f}"),
                   cell(r, "tokens_per_s", "{:.1f}"),
                   r.contains("roofline_ratio") ? fmt::format("{:.2f}%", 100 * r["roofline_ratio"].get<double>()) : "");
        if (r.contains("speculative")) {
          const nlohmann::json& sp = r["speculative"];
          fmt::print(
              "  {:>10} speculative K = {}: step {:.3f} ms (verify {:.3f}, drafts {:.3f}), acceptance {:.1f} %, mean "
              "acceptance length {:.2f}\n",
              "", sp["num_speculative_tokens"].get<int>(), r["step_ms"].get<double>(), sp["verify_ms"].get<double>(),
              sp["draft_ms"].get<double>(), 100 * sp["acceptance_rate"].get<double>(),
              sp["mean_acceptance_length"].get<double>());
        }
        if (r.contains("graph_capture_s")) {  // the engine's start-up capture, as `serve` prints it
          const auto sizes = r["graph_batch_sizes"].get<std::vector<int32_t>>();
          fmt::print("  {:>10} CUDA graphs: {} {} batch sizes ({} to {}) captured in {:.2f} s, {}\n", "", sizes.size(),
                     r.contains("speculative") ? "speculative step" : "decode", sizes.front(), sizes.back(),
                     r["graph_capture_s"].get<double>(), gib(r["graph_pool_bytes"].get<size_t>()));
        }
      } else {
        fmt::print("  {:>10} {}\n", b, r["reason"].get<std::string>());
      }
      std::fflush(stdout);
      decode.push_back(std::move(r));
    }
  }

  if (o.profile) {
    fmt::print("\nprofile (time per op kind of one step; CUDA events / steady_clock, NVTX range per op)\n");
    for (const StepProfile& p : profiles) fmt::print("\n  {}\n{}", p.name, format_profile(p, "    "));
    std::fflush(stdout);
  }

  if (!o.json_out.empty()) {
    nlohmann::json j;
    j["date"] = utc_now();
    j["commit"] = CHIMERA_GIT_COMMIT;  // HEAD when the build was configured
    j["device"] = device_desc;
    j["device_kind"] = o.device;
    j["model"] = {{"source", o.source.is_synthetic() ? "synthetic" : "checkpoint"},
                  {"name", o.source.is_synthetic() ? o.source.synthetic : o.source.model_dir},
                  {"num_layers", c.num_hidden_layers()},
                  {"pattern", c.pattern()},
                  {"parameters", parameter_count(c)}};
    j["dtype"] = act;
    j["weight_dtype"] = wdt;
    j["mamba_ssm_cache_dtype"] = ssm_cache_dtype_name(run.ssm_dtype);
    j["kv_cache_dtype"] = o.kv_cache_dtype;
    j["tensor_parallel_size"] = tp_size;
    if (tp_size > 1) {
      j["allreduce_strategy"] = allreduce;
      j["expert_parallel"] = mo.tp.expert_parallel;
      j["moe_split"] = o.moe_split;
    }
    j["settings"] = {{"decode_context", o.decode_context},
                     {"decode_steps", o.decode_steps},
                     {"warmup", o.warmup},
                     {"cuda_graphs", mo.device == Device::kCuda && o.cuda_graphs},
                     {"pdl", pdl},
                     {"seed", o.seed},
                     {"max_num_batched_tokens", run.sched_defaults.max_num_batched_tokens},
                     {"sampling", "greedy, ignore_eos"},
                     {"load_s", load_s},
                     {"profile", o.profile}};
    j["roofline"] = {{"active_params", roof.active_params},
                     {"params_read_per_token", roof.params_read},
                     {"bytes_per_token", roof.bytes_per_token},
                     {"bandwidth_bytes_per_s", roof.bandwidth},
                     {"batch1_tokens_per_s", roof.tokens_per_s}};
    j["prefill"] = prefill;
    j["decode"] = decode;
    std::ofstream f(o.json_out);
    if (!f) invalid_input("--json-out: cannot write '{}'", o.json_out);
    f << j.dump(2) << "\n";
    if (!f) runtime_error("--json-out: writing '{}' failed", o.json_out);
  }
  return failed ? 1 : 0;
}

}  // namespace chimera::cli
