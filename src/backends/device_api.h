// Backend-neutral device services: is there a GPU, device memory, host <-> device copies.
// Built against CUDA when CHIMERA_HAVE_CUDA (src/backends/cuda/device_api.cu), otherwise a stub
// (src/backends/device_api_stub.cpp) whose cuda_available() is false and whose CUDA paths throw.
#pragma once

#include <cstddef>

#include "core/tensor.h"

namespace chimera::device {

// True when the CUDA backend is built and a CUDA device answers (cudaGetDeviceCount > 0).
bool cuda_available();
// One line naming the device ("NVIDIA H200, sm_90, 132 SMs, 139.8 GiB") or why there is none.
std::string describe_cuda();

// Uninitialised tensor on `device` (CUDA: from the caching allocator, freed back to it with the last view).
Tensor empty(Device device, DType dtype, Shape shape);
// Copy to `device`, converting float dtypes on the way when `dtype` differs (host-side conversion).
Tensor to_device(const Tensor& t, Device device, DType dtype);
inline Tensor to_device(const Tensor& t, Device device) { return to_device(t, device, t.dtype()); }
// Host copy in the same dtype; and a host F32 copy of any float tensor.
Tensor to_host(const Tensor& t);
Tensor to_host_f32(const Tensor& t);
// Copies between tensors of equal dtype and size on any devices (synchronous).
void copy(const Tensor& dst, const Tensor& src);
// Sets every byte of `t` to zero (host: memset; CUDA: cudaMemset on the default stream, ordered before the ops
// that run on it). Fresh Mamba state slots and KV pools start from zeros.
void zero(const Tensor& t);
// Waits for all work on the device.
void synchronize(Device device);
// Bytes held by the CUDA caching allocator (in use, cached).
std::pair<size_t, size_t> cuda_memory_stats();

// Free and total bytes of a device's memory, for the memory plan (runtime/memory_plan.h).
//   CUDA: cudaMemGetInfo of the current device, plus what the caching allocator holds cached (reusable).
//   CPU:  MemAvailable / MemTotal of /proc/meminfo (sysconf as a fallback): host_memory_info().
struct MemoryInfo {
  size_t free = 0;
  size_t total = 0;
};
MemoryInfo memory_info(Device device);
MemoryInfo host_memory_info();  // src/backends/cpu/host_memory.cpp, in every build

}  // namespace chimera::device
