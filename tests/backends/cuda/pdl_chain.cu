// The kernels and host driver of pdl_chain.h.
#include "backends/cuda/pdl_chain.h"

#include <cuda_runtime.h>

#include "backends/cuda/cuda_common.cuh"
#include "backends/cuda/launch.cuh"
#include "backends/device_api.h"

namespace chimera::test {
namespace {

constexpr int kThreads = 128;

bool is_step(int i, int every) {
  return every > 0 && i % every == every / 2;
}

// prev, next: [n] uint32; see PdlChain for the recurrence.
__global__ void chain_step_kernel(const uint32_t* prev, uint32_t* next, int n, int step, unsigned delay_ns) {
  const int j = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  const int src = static_cast<int>((static_cast<int64_t>(j) + 7LL * step + 1) % n);
  cuda::pdl_wait();
  cuda::pdl_trigger();  // early: the successor is resident while this grid still sleeps and writes
  if (j >= n) return;
  const uint32_t v = prev[src];
  if (delay_ns > 0 && (blockIdx.x + static_cast<unsigned>(step)) % 4 == 0) __nanosleep(delay_ns);
  next[j] = v * 3u + static_cast<uint32_t>(step) + static_cast<uint32_t>(j);
}

void enqueue_chain(const PdlChain& c, uint32_t* const buf[2], cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((c.n + kThreads - 1) / kThreads)), block(kThreads);
  for (int i = 0; i < c.steps; ++i) {
    const uint32_t* prev = buf[i % 2];
    uint32_t* next = buf[(i + 1) % 2];
    if (is_step(i, c.copy_every)) {
      CHIMERA_CUDA_CHECK(
          cudaMemcpyAsync(next, prev, sizeof(uint32_t) * static_cast<size_t>(c.n), cudaMemcpyDeviceToDevice, stream),
          "pdl_chain copy");
    } else if (is_step(i, c.plain_every)) {
      chain_step_kernel<<<grid, block, 0, stream>>>(prev, next, c.n, i, c.delay_ns);
      CHIMERA_LAUNCH_CHECK("pdl_chain plain launch");
    } else {
      CHIMERA_CUDA_CHECK(cuda::launch(chain_step_kernel, grid, block, 0, stream, prev, next, c.n, i, c.delay_ns),
                         "pdl_chain launch");
    }
  }
}

}  // namespace

std::vector<uint32_t> pdl_chain_reference(const PdlChain& c, std::vector<uint32_t> x) {
  std::vector<uint32_t> next(x.size());
  const int64_t n = c.n;
  for (int i = 0; i < c.steps; ++i) {
    if (is_step(i, c.copy_every)) continue;  // next = prev
    for (int64_t j = 0; j < n; ++j) {
      next[static_cast<size_t>(j)] =
          x[static_cast<size_t>((j + 7LL * i + 1) % n)] * 3u + static_cast<uint32_t>(i) + static_cast<uint32_t>(j);
    }
    x.swap(next);
  }
  return x;
}

std::vector<std::vector<uint32_t>> run_pdl_chain(const PdlChain& c, const std::vector<std::vector<uint32_t>>& inputs) {
  const size_t bytes = sizeof(uint32_t) * static_cast<size_t>(c.n);
  const device::Stream owned = device::Stream::create();
  const auto stream = static_cast<cudaStream_t>(owned.get());
  uint32_t* buf[2] = {nullptr, nullptr};
  for (auto*& b : buf) CHIMERA_CUDA_CHECK(cudaMalloc(&b, bytes), "pdl_chain alloc");
  std::vector<std::vector<uint32_t>> out;
  try {
    device::Graph graph;
    if (c.graph) graph = device::Graph::capture(owned.get(), [&] { enqueue_chain(c, buf, stream); });
    for (const auto& in : inputs) {
      // Poison the second buffer: a step that read before its predecessor wrote would see these values.
      CHIMERA_CUDA_CHECK(cudaMemsetAsync(buf[1], 0xA5, bytes, stream), "pdl_chain poison");
      CHIMERA_CUDA_CHECK(cudaMemcpyAsync(buf[0], in.data(), bytes, cudaMemcpyHostToDevice, stream), "pdl_chain in");
      if (c.graph) {
        graph.launch(owned.get());
      } else {
        enqueue_chain(c, buf, stream);
      }
      std::vector<uint32_t> got(static_cast<size_t>(c.n));
      CHIMERA_CUDA_CHECK(cudaMemcpyAsync(got.data(), buf[c.steps % 2], bytes, cudaMemcpyDeviceToHost, stream),
                         "pdl_chain out");
      CHIMERA_CUDA_CHECK(cudaStreamSynchronize(stream), "pdl_chain sync");
      out.push_back(std::move(got));
    }
  } catch (...) {
    for (auto* b : buf) cudaFree(b);
    throw;
  }
  for (auto* b : buf) CHIMERA_CUDA_CHECK(cudaFree(b), "pdl_chain free");
  return out;
}

int device_cc_major() {
  int dev = 0, major = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) return 0;
  return major;
}

}  // namespace chimera::test
