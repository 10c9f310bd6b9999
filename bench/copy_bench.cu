// What a plain memory stream reaches at the sizes of the kernel targets (docs/perf.md, "Kernel targets": fractions
// of the 4.2 TB/s copy rate measured on large copies): the same bytes moved by the simplest kernels, timed as the
// kernels are (graph timing, 20 calls per graph, buffers rotated over >= 256 MB so nothing is served from L2).
//   copy-memcpy:   cudaMemcpyAsync device to device of bytes / 2 (read + write = bytes)
//   copy-kernel:   a grid-stride 16-byte copy kernel, launched with PDL like the engine's kernels, grid = 4
//                  blocks of 256 threads per SM
//   copy-inplace:  the same kernel reading and writing one buffer (+1 to every 32-bit word: the read-modify-write
//                  pattern of the conv update and the selective state update, which rewrite their state in place)
// Sizes (read + write): 10.5 MB (conv1d update, Super, batch 64), 42 MB (conv1d prefill 1K and update batch 256),
// 134 MB (SSU bf16 state, Nano, batch 64), 268 MB (SSU bf16 Super / f32 Nano, batch 64), 537 MB (SSU f32 Super,
// batch 64), 1.34 GB (conv1d prefill 32K). The ratio of a kernel to copy-kernel at its own size says how much of
// its gap to 4.2 TB/s is the size (launch, ramp-up, drain) rather than the kernel.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "backends/cuda/cuda_common.cuh"
#include "backends/cuda/launch.cuh"
#include "backends/device_api.h"
#include "bench/bench_common.h"
#include "core/tensor.h"

namespace chimera::bench {
namespace {

constexpr double kRotateBytes = 256.0 * (1 << 20);

// dst[i] = src[i] (kInPlace: dst == src, every 32-bit word + 1) over n 16-byte vectors.
template <bool kInPlace>
__global__ void __launch_bounds__(256) copy_kernel(const uint4* src, uint4* dst, int64_t n) {
  cuda::pdl_wait();
  cuda::pdl_trigger();
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint4 v = src[i];
    if constexpr (kInPlace) v.x += 1, v.y += 1, v.z += 1, v.w += 1;
    dst[i] = v;
  }
}

void bench_copy(const Context& ctx, double mb) {
  const auto half = static_cast<int64_t>(mb * 1e6 / 2) / 16 * 16;  // bytes read (= bytes written)
  const double bytes = 2.0 * static_cast<double>(half);
  const int sets = std::clamp(static_cast<int>(kRotateBytes / bytes) + 1, 2, 64);
  const Tensor a = device::empty(Device::kCuda, DType::kU8, {sets * half});
  const Tensor b = device::empty(Device::kCuda, DType::kU8, {sets * half});
  CHIMERA_CUDA_CHECK(cudaMemset(a.data(), 1, static_cast<size_t>(sets * half)), "bench copy memset");
  auto src = [&](int i) { return static_cast<const char*>(a.data()) + (i % sets) * half; };
  auto dst = [&](int i) { return static_cast<char*>(b.data()) + (i % sets) * half; };
  const int blocks = 4 * cuda::sm_count();
  const std::string shape = "bytes=" + std::to_string(static_cast<int64_t>(bytes));
  ctx.run_graph("copy-memcpy", shape, bytes, 0, [&](cudaStream_t st, int i) {
    CHIMERA_CUDA_CHECK(cudaMemcpyAsync(dst(i), src(i), static_cast<size_t>(half), cudaMemcpyDeviceToDevice, st),
                       "bench copy memcpy");
  });
  ctx.run_graph("copy-kernel", shape, bytes, 0, [&](cudaStream_t st, int i) {
    CHIMERA_CUDA_CHECK(cuda::launch(copy_kernel<false>, dim3(blocks), dim3(256), 0, st,
                                    reinterpret_cast<const uint4*>(src(i)), reinterpret_cast<uint4*>(dst(i)),
                                    half / 16),
                       "bench copy kernel");
  });
  ctx.run_graph("copy-inplace", shape, bytes, 0, [&](cudaStream_t st, int i) {
    char* p = dst(i);
    CHIMERA_CUDA_CHECK(cuda::launch(copy_kernel<true>, dim3(blocks), dim3(256), 0, st,
                                    reinterpret_cast<const uint4*>(p), reinterpret_cast<uint4*>(p), half / 16),
                       "bench copy in place");
  });
}

}  // namespace

CHIMERA_BENCH(copy_floor) {
  for (double mb : {10.5, 42.0, 134.0, 268.0, 537.0, 1340.0}) bench_copy(ctx, mb);
}

}  // namespace chimera::bench
