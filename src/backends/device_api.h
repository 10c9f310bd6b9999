// Backend-neutral device services: is there a GPU, device memory, host <-> device copies.
// Built against CUDA when CHIMERA_HAVE_CUDA (src/backends/cuda/device_api.cu), otherwise a stub
// (src/backends/device_api_stub.cpp) whose cuda_available() is false and whose CUDA paths throw.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>

#include "core/tensor.h"

namespace chimera::device {

// True when the CUDA backend is built and a CUDA device answers (cudaGetDeviceCount > 0).
bool cuda_available();
// CUDA devices (0 without CUDA), the calling thread's current one, and setting it (tensor-parallel ranks on
// several GPUs: each rank's thread works on its own; device memory comes from the current device's allocator).
int device_count();
int current_device();
void set_current_device(int ordinal);
// GPU `ordinal`'s UUID as text ("GPU-..." as nvidia-smi prints it): unique across hosts, so processes can tell
// whether two of their ranks share a GPU.
std::string device_uuid(int ordinal);
// `ordinal` current on the calling thread for the guard's lifetime, the previous one after; ordinal < 0: no-op.
class DeviceGuard {
 public:
  explicit DeviceGuard(int ordinal) : previous_(ordinal >= 0 ? current_device() : -1) {
    if (ordinal >= 0 && ordinal != previous_) set_current_device(ordinal);
  }
  ~DeviceGuard() {
    if (previous_ >= 0 && current_device() != previous_) set_current_device(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_;
};
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
// Waits for the work queued on one CUDA stream (a cudaStream_t).
void synchronize_stream(void* stream);
// Programmatic dependent launch for the kernels launched through cuda/launch.cuh: whether the calling thread's next
// launch asks for it: the device supports it (sm_90+) and the innermost live LaunchScope of this thread allows it
// (no scope: allowed, ops::KernelConfig's default).
bool pdl_enabled();
// The launch options of the CUDA kernels the calling thread launches while the scope lives. ops:: installs one from
// ctx.kernels around every CUDA op, so a kernel's launch follows the context of the op that launches it; code that
// launches kernels outside ops:: (the AllReduce, benchmarks, tests) installs its own. Scopes nest (the destructor
// restores the enclosing one); a captured CUDA graph keeps the options it was captured with.
class LaunchScope {
 public:
  explicit LaunchScope(bool pdl);
  ~LaunchScope();
  LaunchScope(const LaunchScope&) = delete;
  LaunchScope& operator=(const LaunchScope&) = delete;

 private:
  bool previous_;
};
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

// ---- streams, pinned staging, CUDA graphs (what the engine's graph-captured decode step needs) ----------

// A CUDA stream owned by its holder (cudaStreamCreate: blocking, so it still orders with the legacy default stream
// that device::copy / zero use). Graph capture needs a stream other than the legacy default one.
class Stream {
 public:
  static Stream create();  // CUDA only; kRuntime without a GPU
  void* get() const { return handle_.get(); }
  void synchronize() const;

 private:
  std::shared_ptr<void> handle_;
};

// Page-locked host memory (cudaMallocHost), so that copy_async really is asynchronous and can be ordered on a
// stream. CUDA only.
Tensor empty_pinned(DType dtype, Shape shape);
// Stream-ordered copy between tensors of equal dtype and size (host side pinned); returns at once.
void copy_async(const Tensor& dst, const Tensor& src, void* stream);

// A private memory pool for CUDA-graph captures. While a ScopedAllocPool is alive on a thread, device::empty(kCuda)
// on that thread draws from the pool instead of the shared caching allocator, and those blocks go back to the pool
// when their tensors die. A captured graph keeps using the addresses it saw, so its blocks must never be handed to
// ordinary tensors or returned to the driver while the graph lives: the pool keeps every block until the pool
// itself is destroyed (after its graphs). Graphs replayed one after another on one stream may share a pool.
class AllocPool {
 public:
  AllocPool();  // CUDA only
  struct Impl;
  Impl* impl() const { return impl_.get(); }
  size_t bytes() const;  // bytes of device memory the pool holds

 private:
  std::shared_ptr<Impl> impl_;
};
class ScopedAllocPool {
 public:
  explicit ScopedAllocPool(const AllocPool& pool);
  ~ScopedAllocPool();
  ScopedAllocPool(const ScopedAllocPool&) = delete;
  ScopedAllocPool& operator=(const ScopedAllocPool&) = delete;

 private:
  AllocPool::Impl* previous_;
};

// A CUDA graph made by stream capture (relaxed mode) of the work `body` enqueues on `stream`; nothing runs during
// the capture. launch() replays it on a stream. Empty (false) by default.
class Graph {
 public:
  static Graph capture(void* stream, const std::function<void()>& body);
  void launch(void* stream) const;
  explicit operator bool() const { return static_cast<bool>(exec_); }

 private:
  std::shared_ptr<void> exec_;
};

}  // namespace chimera::device
