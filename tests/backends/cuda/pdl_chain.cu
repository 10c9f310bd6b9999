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

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// prev, next: [n] uint32; see PdlChain for the recurrence. t_start[step] / t_end[step]: the earliest block entry
// and the latest write of this grid (atomicMin / atomicMax, recorded after the wait as the contract wants).
__global__ void chain_step_kernel(const uint32_t* prev, uint32_t* next, int n, int step, unsigned delay_ns,
                                  unsigned long long* t_start, unsigned long long* t_end) {
  const unsigned long long entered = global_ns();
  const int j = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  const int src = static_cast<int>((static_cast<int64_t>(j) + 7LL * step + 1) % n);
  cuda::pdl_wait();
  cuda::pdl_trigger();  // early: the successor is resident while this grid still sleeps and writes
  if (threadIdx.x == 0) atomicMin(t_start + step, entered);
  if (j >= n) return;
  const uint32_t v = prev[src];
  if (delay_ns > 0 && (blockIdx.x + static_cast<unsigned>(step)) % 4 == 0) __nanosleep(delay_ns);
  next[j] = v * 3u + static_cast<uint32_t>(step) + static_cast<uint32_t>(j);
  if (threadIdx.x == 0) atomicMax(t_end + step, global_ns());
}

struct Buffers {
  uint32_t* buf[2] = {nullptr, nullptr};
  unsigned long long* t_start = nullptr;  // [steps]
  unsigned long long* t_end = nullptr;    // [steps]
};

void enqueue_chain(const PdlChain& c, const Buffers& b, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((c.n + kThreads - 1) / kThreads)), block(kThreads);
  for (int i = 0; i < c.steps; ++i) {
    const uint32_t* prev = b.buf[i % 2];
    uint32_t* next = b.buf[(i + 1) % 2];
    if (is_step(i, c.copy_every)) {
      CHIMERA_CUDA_CHECK(
          cudaMemcpyAsync(next, prev, sizeof(uint32_t) * static_cast<size_t>(c.n), cudaMemcpyDeviceToDevice, stream),
          "pdl_chain copy");
    } else if (is_step(i, c.plain_every)) {
      chain_step_kernel<<<grid, block, 0, stream>>>(prev, next, c.n, i, c.delay_ns, b.t_start, b.t_end);
      CHIMERA_LAUNCH_CHECK("pdl_chain plain launch");
    } else {
      CHIMERA_CUDA_CHECK(
          cuda::launch(chain_step_kernel, grid, block, 0, stream, prev, next, c.n, i, c.delay_ns, b.t_start, b.t_end),
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

PdlChainResult run_pdl_chain(const PdlChain& c, const std::vector<std::vector<uint32_t>>& inputs) {
  const size_t bytes = sizeof(uint32_t) * static_cast<size_t>(c.n);
  const size_t t_bytes = sizeof(unsigned long long) * static_cast<size_t>(c.steps);
  const device::Stream owned = device::Stream::create();
  const auto stream = static_cast<cudaStream_t>(owned.get());
  Buffers b;
  auto release = [&] {
    for (void* p : {static_cast<void*>(b.buf[0]), static_cast<void*>(b.buf[1]), static_cast<void*>(b.t_start),
                    static_cast<void*>(b.t_end)}) {
      if (p != nullptr) cudaFree(p);
    }
  };
  PdlChainResult r;
  try {
    for (auto*& p : b.buf) CHIMERA_CUDA_CHECK(cudaMalloc(&p, bytes), "pdl_chain alloc");
    CHIMERA_CUDA_CHECK(cudaMalloc(&b.t_start, t_bytes), "pdl_chain alloc");
    CHIMERA_CUDA_CHECK(cudaMalloc(&b.t_end, t_bytes), "pdl_chain alloc");
    device::Graph graph;
    if (c.graph) graph = device::Graph::capture(owned.get(), [&] { enqueue_chain(c, b, stream); });
    std::vector<unsigned long long> t_start(static_cast<size_t>(c.steps)), t_end(static_cast<size_t>(c.steps));
    for (const auto& in : inputs) {
      // Poison the second buffer: a step that read before its predecessor wrote could see these values.
      CHIMERA_CUDA_CHECK(cudaMemsetAsync(b.buf[1], 0xA5, bytes, stream), "pdl_chain poison");
      CHIMERA_CUDA_CHECK(cudaMemsetAsync(b.t_start, 0xFF, t_bytes, stream), "pdl_chain times");
      CHIMERA_CUDA_CHECK(cudaMemsetAsync(b.t_end, 0, t_bytes, stream), "pdl_chain times");
      CHIMERA_CUDA_CHECK(cudaMemcpyAsync(b.buf[0], in.data(), bytes, cudaMemcpyHostToDevice, stream), "pdl_chain in");
      if (c.graph) {
        graph.launch(owned.get());
      } else {
        enqueue_chain(c, b, stream);
      }
      std::vector<uint32_t> got(static_cast<size_t>(c.n));
      CHIMERA_CUDA_CHECK(cudaMemcpyAsync(got.data(), b.buf[c.steps % 2], bytes, cudaMemcpyDeviceToHost, stream),
                         "pdl_chain out");
      CHIMERA_CUDA_CHECK(cudaMemcpyAsync(t_start.data(), b.t_start, t_bytes, cudaMemcpyDeviceToHost, stream),
                         "pdl_chain times out");
      CHIMERA_CUDA_CHECK(cudaMemcpyAsync(t_end.data(), b.t_end, t_bytes, cudaMemcpyDeviceToHost, stream),
                         "pdl_chain times out");
      CHIMERA_CUDA_CHECK(cudaStreamSynchronize(stream), "pdl_chain sync");
      r.outputs.push_back(std::move(got));
    }
    r.pdl_pairs = r.overlapped_pairs = 0;
    for (int i = 0; i + 1 < c.steps; ++i) {
      const bool kernels = !is_step(i, c.copy_every) && !is_step(i + 1, c.copy_every);
      if (!kernels || is_step(i + 1, c.plain_every)) continue;
      ++r.pdl_pairs;
      if (t_start[static_cast<size_t>(i) + 1] < t_end[static_cast<size_t>(i)]) ++r.overlapped_pairs;
    }
  } catch (...) {
    release();
    throw;
  }
  release();
  return r;
}

int device_cc_major() {
  int dev = 0, major = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) return 0;
  return major;
}

}  // namespace chimera::test
