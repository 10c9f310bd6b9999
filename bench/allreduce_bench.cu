// The fused AllReduce on 2 GPUs: three benchmarks (chimera_bench filters are substrings: name one of them).
//
// chimera_bench allreduce_latency: Time per call of ONESHOT, TWOSHOT, NCCL (ncclAllReduce +
// our fused residual + RMSNorm kernel, the "separate norm") and AUTO for residual + RMSNorm in bf16 over tokens
// {1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096} x hidden {2688, 4096, 8192}, plus the plain AllReduce through
// NCCL (no norm: the number peers publish). Prints BENCH lines, a BEST line per size (AUTO / best single strategy)
// and a TABLE at the end. CHIMERA_ALLREDUCE_STRATEGY (auto, nccl, oneshot, twoshot), when set, forces the strategy
// of the AUTO column, as it does for the CLI (read once, through runtime/kernel_env.h; the library never reads the
// environment).
//
// chimera_bench allreduce_oneshot: the ONESHOT kernel with and without programmatic dependent launch, for
// residual + RMSNorm in bf16 at hidden {2688, 4096, 8192} x tokens {1, 8, 32, 64, 128, 256}; a TABLE at the end
// with the ratio (the goal: <= 8 us at 64 x 8192 with PDL).
//
// chimera_bench allreduce_sweep: the sweep behind the SM90 lookup table (src/dist/sm90_allreduce_table.inc).
// Every fusion pattern x hidden kSweepHidden x tokens kSweepTokens (src/dist/strategy.h: the powers of two plus
// the models' hidden sizes, half-octave token steps from 128), bf16, each strategy the custom kernels can take at
// the default 64 MiB workspace, one line each, after a SWEEP-GRID line listing the sizes:
//   SWEEP ranks=2 pattern=<name> hidden=<h> tokens=<t> oneshot=<us|-> twoshot=<us|-> nccl=<us|-> best=<name>
// scripts/make_allreduce_table.py runs it and writes the table (bench/run_allreduce_device.sh does both).
//
// Timing: each rank captures `calls` back-to-back calls in a CUDA graph (eager launches if capture fails) and
// reports the median of the replays / calls; the ranks start each replay together (std::barrier) and the slower
// rank's median is reported. NVLink multicast stays off (NCCL_NVLS_ENABLE=0; the custom kernels never use it).
#include <cuda_runtime.h>

#include <algorithm>
#include <barrier>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "backends/device_api.h"
#include "bench/bench_common.h"
#include "runtime/kernel_env.h"

#if defined(CHIMERA_HAVE_NCCL)
#include "dist/allreduce.h"
#include "dist/allreduce_index.h"
#include "dist/strategy.h"

namespace chimera::bench {
namespace {

using dist::AllReduceStrategy;
using dist::FusionPattern;

constexpr int kRanks = 2;
constexpr FusionPattern kPatterns[] = {FusionPattern::kAllReduce, FusionPattern::kResidualRmsNorm,
                                       FusionPattern::kResidualRmsNormFp8, FusionPattern::kResidualRmsNormOutFp8,
                                       FusionPattern::kRmsNorm};
constexpr AllReduceStrategy kSingle[] = {AllReduceStrategy::kOneShot, AllReduceStrategy::kTwoShot,
                                         AllReduceStrategy::kNccl};

struct Buffers {
  void *input, *residual, *residual_out, *norm_out, *fp8_out, *output, *weight;
  cudaStream_t stream;
};

// The ranks, one AllReduceFusion per strategy (each with its own workspace) and per-rank buffers of max_bytes.
struct Rig {
  std::unique_ptr<dist::Communicator> comm;
  std::map<AllReduceStrategy, std::unique_ptr<dist::AllReduceFusion>> fusion;
  Buffers buf[kRanks];
  std::barrier<> sync{kRanks};

  Rig(size_t max_bytes, int64_t max_hidden, AllReduceStrategy auto_as) {
    comm = dist::Communicator::create_local({0, 1});
    const dist::Topology topo = dist::detect_topology(comm->devices());
    std::printf("%s", topo.describe().c_str());
    for (AllReduceStrategy s : {AllReduceStrategy::kAuto, AllReduceStrategy::kNccl, AllReduceStrategy::kOneShot,
                                AllReduceStrategy::kTwoShot}) {
      dist::AllReduceConfig c;  // the default 64 MiB workspace: what the engine runs with
      c.strategy = s == AllReduceStrategy::kAuto ? auto_as : s;
      fusion[s] = std::make_unique<dist::AllReduceFusion>(*comm, topo, c);
    }
    for (int r = 0; r < kRanks; ++r) {
      cudaSetDevice(r);
      for (void** p : {&buf[r].input, &buf[r].residual, &buf[r].residual_out, &buf[r].norm_out, &buf[r].output}) {
        cudaMalloc(p, max_bytes);
        cudaMemset(*p, 0x3c, max_bytes);  // bf16 0x3c3c ~ 0.0115: finite, not the Lamport pattern
      }
      cudaMalloc(&buf[r].fp8_out, max_bytes / 2);
      cudaMalloc(&buf[r].weight, static_cast<size_t>(max_hidden) * 2);
      cudaMemset(buf[r].weight, 0x3f, static_cast<size_t>(max_hidden) * 2);
      cudaStreamCreateWithFlags(&buf[r].stream, cudaStreamNonBlocking);
    }
  }
  ~Rig() {
    for (int r = 0; r < kRanks; ++r) {
      cudaSetDevice(r);
      cudaStreamSynchronize(buf[r].stream);
      for (void* p : {buf[r].input, buf[r].residual, buf[r].residual_out, buf[r].norm_out, buf[r].fp8_out,
                      buf[r].output, buf[r].weight}) {
        cudaFree(p);
      }
      cudaStreamDestroy(buf[r].stream);
    }
    fusion.clear();
  }

  dist::AllReduceParams params(int r, FusionPattern pattern, int64_t tokens, int64_t hidden) const {
    dist::AllReduceParams p;
    p.pattern = pattern;
    p.dtype = DType::kBF16;
    p.tokens = tokens;
    p.hidden = hidden;
    p.input = buf[r].input;
    p.residual_in = buf[r].residual;
    p.residual_out = buf[r].residual_out;
    p.norm_out = buf[r].norm_out;
    p.fp8_out = buf[r].fp8_out;
    p.output = buf[r].output;
    p.norm_weight = buf[r].weight;
    p.fp8_scale = 1.0f;
    return p;
  }

  // Median microseconds per call on this rank: `calls` calls per graph, `replays` replays. took: what ran.
  double time_rank(dist::AllReduceFusion& ar, int rank, const dist::AllReduceParams& p, int calls, int replays,
                   AllReduceStrategy* took) {
    cudaStream_t st = buf[rank].stream;
    // Warm-up: sizes any NCCL scratch before capture.
    for (int i = 0; i < 3; ++i) *took = ar.run(rank, p, st);
    cudaStreamSynchronize(st);
    sync.arrive_and_wait();
    cudaGraphExec_t exec = nullptr;
    cudaGraph_t graph = nullptr;
    bool graphed = cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal) == cudaSuccess;
    if (graphed) {
      try {
        for (int i = 0; i < calls; ++i) ar.run(rank, p, st);
      } catch (const std::exception&) {
        graphed = false;
      }
      graphed = cudaStreamEndCapture(st, &graph) == cudaSuccess && graphed &&
                cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess;
    }
    (void)cudaGetLastError();
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    std::vector<float> ms;
    for (int rep = 0; rep < replays; ++rep) {
      sync.arrive_and_wait();
      cudaEventRecord(a, st);
      if (graphed) {
        cudaGraphLaunch(exec, st);
      } else {
        for (int i = 0; i < calls; ++i) ar.run(rank, p, st);
      }
      cudaEventRecord(b, st);
      cudaEventSynchronize(b);
      float t = 0;
      cudaEventElapsedTime(&t, a, b);
      ms.push_back(t);
    }
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) std::printf("BENCH-ERROR allreduce rank %d: %s\n", rank, cudaGetErrorString(err));
    std::sort(ms.begin(), ms.end());
    return 1000.0 * ms[ms.size() / 2] / calls;
  }

  // The slower rank's median; `took`: the strategy the call ran.
  double measure(dist::AllReduceFusion& ar, FusionPattern pattern, int64_t tokens, int64_t hidden, int calls,
                 int replays, AllReduceStrategy* took, bool pdl = true) {
    double us[kRanks] = {};
    AllReduceStrategy ran[kRanks] = {};
    comm->run_ranks([&](int r) {
      const device::LaunchScope launch_scope(pdl);  // the rank thread's launches
      us[r] = time_rank(ar, r, params(r, pattern, tokens, hidden), calls, replays, &ran[r]);
    });
    if (took) *took = ran[0];
    return std::max(us[0], us[1]);
  }
};

// The BENCH shape of a (hidden, tokens) message, as bench/peers/allreduce_peers.py writes it: "h8192xt64".
std::string size_shape(int64_t hidden, int64_t tokens) {
  char s[48];
  std::snprintf(s, sizeof(s), "h%lldxt%lld", static_cast<long long>(hidden), static_cast<long long>(tokens));
  return s;
}

// Calls per graph: ~50 for small messages, fewer for large ones (each replay stays within a few ms).
int calls_for(int64_t bytes) {
  return static_cast<int>(std::clamp<int64_t>((int64_t{128} << 20) / std::max<int64_t>(bytes, 1), 4, 50));
}

// CHIMERA_ALLREDUCE_STRATEGY through the environment registry (runtime/kernel_env.h), validated there.
bool env_forced(AllReduceStrategy* s) {
  *s = allreduce_strategy_from_env();
  return *s != AllReduceStrategy::kAuto;
}

void print_setup(const char* what) {
  std::printf("%s: PDL %s\n", what, device::pdl_enabled() ? "on" : "off");
}

bool have_two_gpus(const char* what) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count < kRanks) {
    std::printf("BENCH-SKIP %s: needs 2 GPUs\n", what);
    return false;
  }
  return true;
}

void run_latency() {
  if (!have_two_gpus("allreduce_latency")) return;
  AllReduceStrategy forced = AllReduceStrategy::kAuto;
  const bool is_forced = env_forced(&forced);
  if (is_forced) {
    std::printf("allreduce_latency: CHIMERA_ALLREDUCE_STRATEGY=%s: the auto column runs that strategy\n",
                std::string(dist::strategy_name(forced)).c_str());
  }
  std::printf("allreduce_latency: lookup table for 2 ranks %s\n",
              dist::sm90_table_measured(2) ? "measured" : "PROVISIONAL (default rule, not measured)");
  const int64_t tokens_list[] = {1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096};
  const int64_t hidden_list[] = {2688, 4096, 8192};
  const int64_t max_hidden = 8192;
  print_setup("allreduce_latency");
  Rig rig(static_cast<size_t>(4096 * max_hidden * 2), max_hidden, forced);
  struct Row {
    int64_t hidden, tokens;
    std::map<std::string, double> us;
    std::string best, auto_took;
  };
  std::vector<Row> rows;
  for (int64_t hidden : hidden_list) {
    for (int64_t tokens : tokens_list) {
      const std::string shape = size_shape(hidden, tokens);
      const double bytes = static_cast<double>(tokens * hidden * 2);
      const int calls = calls_for(static_cast<int64_t>(bytes));
      Row row{hidden, tokens, {}, {}, {}};
      auto one = [&](const std::string& name, dist::AllReduceFusion& ar, FusionPattern pattern) {
        AllReduceStrategy took = AllReduceStrategy::kAuto;
        const double us = rig.measure(ar, pattern, tokens, hidden, calls, 20, &took);
        row.us[name] = us;
        if (name == "auto") row.auto_took = dist::strategy_name(took);
        // bytes: this rank's input read + residual read + two outputs written (the HBM floor of the fusion)
        std::printf("BENCH kernel=allreduce_%s shape=%s us=%.2f gbps=%.1f tflops=0 floor_ratio=0 took=%s\n",
                    name.c_str(), shape.c_str(), us, 4.0 * bytes / (us * 1e-6) / 1e9,
                    std::string(dist::strategy_name(took)).c_str());
        std::fflush(stdout);
      };
      one("oneshot", *rig.fusion[AllReduceStrategy::kOneShot], FusionPattern::kResidualRmsNorm);
      one("twoshot", *rig.fusion[AllReduceStrategy::kTwoShot], FusionPattern::kResidualRmsNorm);
      one("nccl", *rig.fusion[AllReduceStrategy::kNccl], FusionPattern::kResidualRmsNorm);
      one("auto", *rig.fusion[AllReduceStrategy::kAuto], FusionPattern::kResidualRmsNorm);
      one("nccl_ar", *rig.fusion[AllReduceStrategy::kNccl], FusionPattern::kAllReduce);
      row.best = "oneshot";
      for (const char* s : {"twoshot", "nccl"})
        if (row.us[s] < row.us[row.best]) row.best = s;
      std::printf("BEST hidden=%lld tokens=%lld strategy=%s us=%.2f auto=%.2f auto_took=%s auto_ratio=%.3f\n",
                  static_cast<long long>(hidden), static_cast<long long>(tokens), row.best.c_str(),
                  row.us[row.best], row.us["auto"], row.auto_took.c_str(), row.us["auto"] / row.us[row.best]);
      std::fflush(stdout);
      rows.push_back(row);
    }
  }
  std::printf("TABLE allreduce + residual + RMSNorm, bf16, 2 ranks: us per call (median of 20 graph replays, slower "
              "rank); nccl = ncclAllReduce + fused norm kernel; nccl_ar = ncclAllReduce alone (no norm)\n");
  std::printf("TABLE %6s %6s %9s %9s %9s %9s %9s  %-8s %-8s %9s\n", "hidden", "tokens", "oneshot", "twoshot",
              "nccl", "auto", "nccl_ar", "best", "auto_is", "auto/best");
  double worst_ratio = 0;
  for (Row& r : rows) {
    const double ratio = r.us["auto"] / r.us[r.best];
    worst_ratio = std::max(worst_ratio, ratio);
    std::printf("TABLE %6lld %6lld %9.2f %9.2f %9.2f %9.2f %9.2f  %-8s %-8s %9.3f%s\n",
                static_cast<long long>(r.hidden), static_cast<long long>(r.tokens), r.us["oneshot"], r.us["twoshot"],
                r.us["nccl"], r.us["auto"], r.us["nccl_ar"], r.best.c_str(), r.auto_took.c_str(), ratio,
                ratio > 1.05 ? "  auto > 1.05" : "");
  }
  std::printf("TABLE worst auto/best %.3f (goal <= 1.05)\n", worst_ratio);
}

void run_sweep() {
  if (!have_two_gpus("allreduce_sweep")) return;
  const int64_t max_message = dist::AllReduceConfig{}.max_message_bytes;
  const int64_t max_hidden = 16384;
  print_setup("allreduce_sweep");
  Rig rig(static_cast<size_t>(max_message), max_hidden, AllReduceStrategy::kAuto);
  // The grid, for scripts/make_allreduce_table.py: the table lists exactly these sizes.
  auto join = [](std::span<const int64_t> v) {
    std::string out;
    for (size_t i = 0; i < v.size(); ++i) {
      if (i) out += ',';
      out += std::to_string(v[i]);
    }
    return out;
  };
  const std::string grid = "SWEEP-GRID hidden=" + join(dist::kSweepHidden) + " tokens=" + join(dist::kSweepTokens);
  std::printf("%s\n", grid.c_str());
  for (FusionPattern pattern : kPatterns) {
    for (int64_t hidden : dist::kSweepHidden) {
      for (int64_t tokens : dist::kSweepTokens) {
        dist::StrategyQuery q;
        q.n_ranks = kRanks;
        q.pattern = pattern;
        q.hidden = hidden;
        q.tokens = tokens;
        q.elem_bytes = 2;
        q.peer_access = rig.fusion[AllReduceStrategy::kAuto]->custom_kernels_available();
        q.max_message_bytes = max_message;
        std::string line = "SWEEP ranks=2 pattern=" + std::string(dist::pattern_name(pattern)) +
                           " hidden=" + std::to_string(hidden) + " tokens=" + std::to_string(tokens);
        if (!dist::custom_eligible(q)) {  // the table entry is never read: NCCL whatever it says
          std::printf("%s oneshot=- twoshot=- nccl=- best=-\n", line.c_str());
          continue;
        }
        const int calls = calls_for(tokens * hidden * 2);
        std::string best;
        double best_us = 0;
        for (AllReduceStrategy s : kSingle) {
          const double us = rig.measure(*rig.fusion[s], pattern, tokens, hidden, calls, 10, nullptr);
          char buf[48];
          std::snprintf(buf, sizeof(buf), " %s=%.2f", std::string(dist::strategy_name(s)).c_str(), us);
          line += buf;
          if (best.empty() || us < best_us) {
            best = dist::strategy_name(s);
            best_us = us;
          }
        }
        std::printf("%s best=%s\n", line.c_str(), best.c_str());
        std::fflush(stdout);
      }
    }
  }
}

// The ONESHOT kernel with and without programmatic dependent launch, on the same instance and buffers.
void run_oneshot() {
  if (!have_two_gpus("allreduce_oneshot")) return;
  const int64_t tokens_list[] = {1, 8, 32, 64, 128, 256};
  const int64_t hidden_list[] = {2688, 4096, 8192};
  const int64_t max_hidden = 8192;
  Rig rig(static_cast<size_t>(256 * max_hidden * 2), max_hidden, AllReduceStrategy::kOneShot);
  const bool pdl_default = device::pdl_enabled();
  std::printf("allreduce_oneshot: PDL available %s\n", pdl_default ? "yes" : "no");
  struct Row {
    int64_t hidden, tokens;
    double pdl, nopdl;
  };
  std::vector<Row> rows;
  for (int64_t hidden : hidden_list) {
    for (int64_t tokens : tokens_list) {
      const std::string shape = size_shape(hidden, tokens);
      const double bytes = static_cast<double>(tokens * hidden * 2);
      const int calls = calls_for(static_cast<int64_t>(bytes));
      Row row{hidden, tokens, 0, 0};
      auto one = [&](const char* name, bool pdl) {
        const double us = rig.measure(*rig.fusion[AllReduceStrategy::kOneShot], FusionPattern::kResidualRmsNorm,
                                      tokens, hidden, calls, 20, nullptr, pdl && pdl_default);
        std::printf("BENCH kernel=allreduce_oneshot%s shape=%s us=%.2f gbps=%.1f tflops=0 floor_ratio=0\n", name,
                    shape.c_str(), us, 4.0 * bytes / (us * 1e-6) / 1e9);
        std::fflush(stdout);
        return us;
      };
      row.pdl = one("", true);
      row.nopdl = one("_nopdl", false);
      rows.push_back(row);
    }
  }
  std::printf("TABLE ONESHOT + residual + RMSNorm, bf16, 2 ranks: us per call (median of 20 graph replays of "
              "back-to-back calls, slower rank)\n");
  std::printf("TABLE %6s %6s %9s %9s %9s %s\n", "hidden", "tokens", "pdl", "no_pdl", "pdl/no", "goal");
  for (const Row& r : rows) {
    std::printf("TABLE %6lld %6lld %9.2f %9.2f %9.3f%s\n", static_cast<long long>(r.hidden),
                static_cast<long long>(r.tokens), r.pdl, r.nopdl, r.pdl / r.nopdl,
                r.hidden == 8192 && r.tokens == 64 ? (r.pdl <= 8.0 ? "  <= 8 us: met" : "  <= 8 us: MISSED") : "");
  }
}

}  // namespace

CHIMERA_BENCH(allreduce_oneshot) { (void)ctx; run_oneshot(); }
CHIMERA_BENCH(allreduce_latency) { (void)ctx; run_latency(); }
CHIMERA_BENCH(allreduce_sweep) { (void)ctx; run_sweep(); }

}  // namespace chimera::bench

#endif
