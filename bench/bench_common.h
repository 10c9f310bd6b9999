// The kernel benchmark harness (a separate binary, never a test): CUDA-event timing of a launch sequence,
// and one report line per case with time, achieved bandwidth or FLOP rate, and the ratio to the machine's
// measured ceiling (docs/perf.md, "Method and floors": 4.2 TB/s device copy, ~790 TFLOP/s dense bf16).
//
//   CHIMERA_BENCH(ssu_fp32_state) { ... ctx.run("selective_state_update", shape, bytes, flops, [&] { launch(); }); }
//
// Output (stdout), one line per case, parsed by bench/peers/*.py and docs/perf.md tables:
//   BENCH kernel=<name> shape=<text> us=<median> gbps=<x> tflops=<y> floor_ratio=<r>
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "ops/ops.h"

namespace chimera::bench {

inline constexpr double kCopyBandwidthGBs = 4200.0;  // measured device-to-device copy, read + write
inline constexpr double kBf16PeakTflops = 790.0;      // measured dense bf16
inline constexpr int kGraphLaunches = 20;             // calls per CUDA graph in run_graph

struct Context {
  int warmup = 5;
  int iters = 50;
  // Times fn (a sequence of launches on the default stream) and prints the report line. bytes: bytes that
  // must move (read + write); flops: useful floating-point operations. Either may be 0.
  // Returns the median time in microseconds.
  double run(const std::string& kernel, const std::string& shape, double bytes, double flops,
             const std::function<void()>& fn) const;
  // As run(), for an fn that issues `launches` launches of the kernel back to back (a CUDA graph replay,
  // say): bytes and flops are per launch and the line reports the time per launch, so the host's launch
  // overhead between synchronised iterations is not counted (device time of a kernel in a stream).
  double run_launches(const std::string& kernel, const std::string& shape, double bytes, double flops, int launches,
                      const std::function<void()>& fn) const;
  // Device time per call inside a CUDA graph, reported as kernel "<kernel>-graph": op(stream, 0) once eagerly
  // (first-use plans, scratch, pointer tables), then `launches` calls of op(stream, i) captured in one graph on a
  // stream of its own (allocations from a private pool, as the engine's decode graphs) and replayed. What a kernel
  // costs inside a captured decode step, without the host's per-call launch overhead that run() includes (~5 us).
  double run_graph(const std::string& kernel, const std::string& shape, double bytes, double flops,
                   const std::function<void(cudaStream_t, int)>& op, int launches = kGraphLaunches) const;
};

// Prefix caching's Mamba checkpoints for one T-token sequence (batch index 0): a cut every `spacing` rows before T
// (none for 0), checkpoint i in state slot i + 1 (slot 0 is the sequence's own).
inline std::vector<ops::StateCheckpoint> checkpoints_every(int32_t T, int32_t spacing) {
  std::vector<ops::StateCheckpoint> cuts;
  for (int32_t r = spacing; spacing > 0 && r < T; r += spacing) {
    cuts.push_back({0, r, static_cast<int32_t>(cuts.size()) + 1});
  }
  return cuts;
}

using BenchFn = void (*)(const Context&);
struct Registration {
  Registration(const char* name, BenchFn fn);
};
struct Case {
  std::string name;
  BenchFn fn;
};
std::vector<Case>& registry();

#define CHIMERA_BENCH(name)                                                             \
  static void chimera_bench_##name(const ::chimera::bench::Context&);                   \
  static const ::chimera::bench::Registration chimera_bench_reg_##name(#name,           \
                                                                       chimera_bench_##name); \
  static void chimera_bench_##name(const ::chimera::bench::Context& ctx)

}  // namespace chimera::bench
