// chimera_bench [FILTER...]: runs every registered kernel benchmark whose name contains one of the filters.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "backends/device_api.h"
#include "bench/bench_common.h"

namespace chimera::bench {

std::vector<Case>& registry() {
  static std::vector<Case> r;
  return r;
}

Registration::Registration(const char* name, BenchFn fn) { registry().push_back({name, fn}); }

double Context::run(const std::string& kernel, const std::string& shape, double bytes, double flops,
                    const std::function<void()>& fn) const {
  return run_launches(kernel, shape, bytes, flops, 1, fn);
}

double Context::run_launches(const std::string& kernel, const std::string& shape, double bytes, double flops,
                             int launches, const std::function<void()>& fn) const {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  for (int i = 0; i < warmup; ++i) fn();
  cudaDeviceSynchronize();
  std::vector<float> ms(static_cast<size_t>(iters));
  for (int i = 0; i < iters; ++i) {
    cudaEventRecord(a);
    fn();
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    cudaEventElapsedTime(&ms[static_cast<size_t>(i)], a, b);
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) std::printf("BENCH-ERROR kernel=%s %s\n", kernel.c_str(), cudaGetErrorString(err));
  std::sort(ms.begin(), ms.end());
  const double us = 1000.0 * ms[ms.size() / 2] / std::max(1, launches);
  const double gbps = bytes > 0 ? bytes / (us * 1e-6) / 1e9 : 0.0;
  const double tflops = flops > 0 ? flops / (us * 1e-6) / 1e12 : 0.0;
  const double ratio = std::max(gbps / kCopyBandwidthGBs, tflops / kBf16PeakTflops);
  std::printf("BENCH kernel=%s shape=%s us=%.2f gbps=%.1f tflops=%.2f floor_ratio=%.3f\n", kernel.c_str(),
              shape.c_str(), us, gbps, tflops, ratio);
  std::fflush(stdout);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return us;
}

double Context::run_graph(const std::string& kernel, const std::string& shape, double bytes, double flops,
                          const std::function<void(cudaStream_t, int)>& op, int launches) const {
  const device::Stream stream = device::Stream::create();
  const auto st = static_cast<cudaStream_t>(stream.get());
  const device::AllocPool pool;  // declared before the graph: outlives it
  device::Graph graph;
  {
    const device::ScopedAllocPool scoped(pool);
    op(st, 0);
    stream.synchronize();
    graph = device::Graph::capture(stream.get(), [&] {
      for (int i = 0; i < launches; ++i) op(st, i);
    });
  }
  const double us =
      run_launches(kernel + "-graph", shape, bytes, flops, launches, [&] { graph.launch(stream.get()); });
  stream.synchronize();
  return us;
}

}  // namespace chimera::bench

int main(int argc, char** argv) {
  using namespace chimera;
  if (!device::cuda_available()) {
    std::printf("chimera_bench: %s\n", device::describe_cuda().c_str());
    return 2;
  }
  std::printf("device: %s\n", device::describe_cuda().c_str());
  bench::Context ctx;
  for (const auto& c : bench::registry()) {
    bool take = argc < 2;
    for (int i = 1; i < argc; ++i) take |= std::strstr(c.name.c_str(), argv[i]) != nullptr;
    if (take) c.fn(ctx);
  }
  return 0;
}
