// AllReduce + residual + RMSNorm on 2 GPUs (chimera_bench allreduce): time per call of every strategy and AUTO
// over tokens {1, 2, 4, ..., 4096} x hidden {2688, 4096, 8192}, bf16, pattern kResidualRmsNorm, plus the
// plain AllReduce through NCCL (no norm: the number peers publish). This is also the sweep tool of the SM90
// lookup table (src/dist/strategy.cpp): the BEST lines name the fastest strategy per (hidden, tokens); pasting
// them into the table is still manual (the table is provisional until then).
//
// Timing: each rank captures 50 back-to-back calls in a CUDA graph (falls back to eager launches if capture
// fails, e.g. NCCL without capture support) and reports the median of 20 replays / 50; the ranks start each
// measurement together (std::barrier) and the line reports the slower rank.
//   BENCH kernel=allreduce_<strategy> shape=h<hidden>xt<tokens> us=<per call> ...
//   BEST hidden=<h> tokens=<t> strategy=<fastest> us=<t> auto=<strategy AUTO took> auto_ratio=<AUTO / best>
// Environment: NCCL_NVLS_ENABLE=0 (NVLink multicast stays off; the custom kernels never use it).
#include <cuda_runtime.h>

#include <algorithm>
#include <barrier>
#include <cstdio>
#include <map>
#include <vector>

#include "bench/bench_common.h"

#if defined(CHIMERA_HAVE_NCCL)
#include "dist/allreduce.h"
#include "dist/strategy.h"

namespace chimera::bench {
namespace {

using dist::AllReduceStrategy;
using dist::FusionPattern;

constexpr int kRanks = 2;
constexpr int kCallsPerGraph = 50;
constexpr int kReplays = 20;

struct Buffers {
  void *input, *residual, *residual_out, *norm_out, *output, *weight;
  cudaStream_t stream;
};

// Median microseconds per call on this rank.
double time_rank(dist::AllReduceFusion& ar, int rank, const dist::AllReduceParams& p, cudaStream_t st,
                 std::barrier<>& sync) {
  for (int i = 0; i < 5; ++i) ar.run(rank, p, st);  // warm-up (also sizes any NCCL scratch before capture)
  cudaStreamSynchronize(st);
  cudaGraphExec_t exec = nullptr;
  cudaGraph_t graph = nullptr;
  bool graphed = cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal) == cudaSuccess;
  if (graphed) {
    for (int i = 0; i < kCallsPerGraph; ++i) ar.run(rank, p, st);
    graphed = cudaStreamEndCapture(st, &graph) == cudaSuccess && cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess;
  }
  (void)cudaGetLastError();
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<float> ms;
  for (int rep = 0; rep < kReplays; ++rep) {
    sync.arrive_and_wait();
    cudaEventRecord(a, st);
    if (graphed) {
      cudaGraphLaunch(exec, st);
    } else {
      for (int i = 0; i < kCallsPerGraph; ++i) ar.run(rank, p, st);
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
  std::sort(ms.begin(), ms.end());
  return 1000.0 * ms[ms.size() / 2] / kCallsPerGraph;
}

void run_allreduce_bench() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count < kRanks) {
    std::printf("BENCH-SKIP allreduce: needs 2 GPUs\n");
    return;
  }
  auto comm = dist::Communicator::create_local({0, 1});
  const dist::Topology topo = dist::detect_topology(comm->devices());
  std::printf("%s", topo.describe().c_str());
  std::map<AllReduceStrategy, std::unique_ptr<dist::AllReduceFusion>> fusion;
  for (AllReduceStrategy s : {AllReduceStrategy::kAuto, AllReduceStrategy::kNccl, AllReduceStrategy::kOneShot,
                              AllReduceStrategy::kTwoShot}) {
    dist::AllReduceConfig c;
    c.strategy = s;
    fusion[s] = std::make_unique<dist::AllReduceFusion>(*comm, topo, c);
  }
  const int64_t max_tokens = 4096, max_hidden = 8192;
  const size_t max_bytes = static_cast<size_t>(max_tokens * max_hidden * 2);
  Buffers buf[kRanks];
  for (int r = 0; r < kRanks; ++r) {
    cudaSetDevice(r);
    for (void** p : {&buf[r].input, &buf[r].residual, &buf[r].residual_out, &buf[r].norm_out, &buf[r].output}) {
      cudaMalloc(p, max_bytes);
      cudaMemset(*p, 0x3c, max_bytes);  // bf16 0x3c3c ~ 0.0115: finite, not the Lamport pattern
    }
    cudaMalloc(&buf[r].weight, static_cast<size_t>(max_hidden) * 2);
    cudaMemset(buf[r].weight, 0x3f, static_cast<size_t>(max_hidden) * 2);
    cudaStreamCreateWithFlags(&buf[r].stream, cudaStreamNonBlocking);
  }
  std::barrier<> sync(kRanks);
  for (int64_t hidden : {2688, 4096, 8192}) {
    for (int64_t tokens = 1; tokens <= max_tokens; tokens *= 2) {
      char shape_buf[64];  // snprintf: g++ 12 flags "h" + std::to_string(...) with a false -Wrestrict
      std::snprintf(shape_buf, sizeof(shape_buf), "h%lldxt%lld", static_cast<long long>(hidden),
                    static_cast<long long>(tokens));
      const std::string shape = shape_buf;
      const double bytes = static_cast<double>(tokens * hidden * 2);
      std::map<std::string, double> us;
      auto measure = [&](const std::string& name, dist::AllReduceFusion& ar, FusionPattern pattern) {
        double worst = 0;
        AllReduceStrategy took = AllReduceStrategy::kAuto;
        comm->run_ranks([&](int r) {
          dist::AllReduceParams p;
          p.pattern = pattern;
          p.dtype = DType::kBF16;
          p.tokens = tokens;
          p.hidden = hidden;
          p.input = buf[r].input;
          p.residual_in = buf[r].residual;
          p.residual_out = buf[r].residual_out;
          p.norm_out = buf[r].norm_out;
          p.output = buf[r].output;
          p.norm_weight = buf[r].weight;
          if (r == 0) took = ar.choose(p);
          const double t = time_rank(ar, r, p, buf[r].stream, sync);
          if (r == 0) worst = std::max(worst, t);
          sync.arrive_and_wait();
          if (r == 1) worst = std::max(worst, t);
        });
        us[name] = worst;
        // bytes: this rank's input read + residual read + two outputs written (the HBM floor of the fusion)
        std::printf("BENCH kernel=allreduce_%s shape=%s us=%.2f gbps=%.1f tflops=0 floor_ratio=0 took=%s\n",
                    name.c_str(), shape.c_str(), worst, 4.0 * bytes / (worst * 1e-6) / 1e9,
                    std::string(dist::strategy_name(took)).c_str());
        std::fflush(stdout);
      };
      measure("oneshot", *fusion[AllReduceStrategy::kOneShot], FusionPattern::kResidualRmsNorm);
      measure("twoshot", *fusion[AllReduceStrategy::kTwoShot], FusionPattern::kResidualRmsNorm);
      measure("nccl", *fusion[AllReduceStrategy::kNccl], FusionPattern::kResidualRmsNorm);
      measure("auto", *fusion[AllReduceStrategy::kAuto], FusionPattern::kResidualRmsNorm);
      measure("nccl_allreduce_only", *fusion[AllReduceStrategy::kNccl], FusionPattern::kAllReduce);
      std::string best = "oneshot";
      for (const char* s : {"twoshot", "nccl"})
        if (us[s] < us[best]) best = s;
      std::printf("BEST hidden=%lld tokens=%lld strategy=%s us=%.2f auto=%.2f auto_ratio=%.3f\n",
                  static_cast<long long>(hidden), static_cast<long long>(tokens), best.c_str(), us[best], us["auto"],
                  us["auto"] / us[best]);
    }
  }
  for (int r = 0; r < kRanks; ++r) {
    cudaSetDevice(r);
    cudaStreamSynchronize(buf[r].stream);
    for (void* p : {buf[r].input, buf[r].residual, buf[r].residual_out, buf[r].norm_out, buf[r].output, buf[r].weight})
      cudaFree(p);
    cudaStreamDestroy(buf[r].stream);
  }
}

}  // namespace

CHIMERA_BENCH(allreduce) { (void)ctx; run_allreduce_bench(); }

}  // namespace chimera::bench

#endif
