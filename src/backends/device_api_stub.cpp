// Device services of a build without CUDA: everything stays on the host.
#include <cstring>

#include "backends/device_api.h"
#include "core/error.h"

namespace chimera::device {

bool cuda_available() { return false; }
int device_count() {
  return 0;
}
int current_device() {
  return 0;
}
void set_current_device(int ordinal) {
  if (ordinal != 0) throw_runtime("device::set_current_device: this build of chimera has no CUDA backend");
}
std::string device_uuid(int /*ordinal*/) {
  throw_runtime("device::device_uuid: this build of chimera has no CUDA backend");
}
bool pdl_enabled() { return false; }
LaunchScope::LaunchScope(bool /*pdl*/) : previous_(true) {}
LaunchScope::~LaunchScope() { previous_ = true; }  // restores nothing: no kernel launches without CUDA
std::string describe_cuda() { return "this build of chimera has no CUDA backend (nvcc was not found)"; }

static void no_cuda(Device d) {
  if (d == Device::kCuda) runtime_error("this build of chimera has no CUDA backend");
}

Tensor empty(Device device, DType dtype, Shape shape) {
  no_cuda(device);
  return Tensor::empty(dtype, std::move(shape));
}

Tensor to_device(const Tensor& t, Device device, DType dtype) {
  no_cuda(device);
  no_cuda(t.device());
  if (dtype == t.dtype()) return t.clone();
  Tensor f = t.to_f32();
  Tensor out = Tensor::empty(dtype, t.shape());
  convert_from_f32(f.f32(), dtype, out.data(), static_cast<size_t>(t.numel()));
  return out;
}

Tensor to_host(const Tensor& t) {
  no_cuda(t.device());
  return t.clone();
}

Tensor to_host_f32(const Tensor& t) {
  no_cuda(t.device());
  return t.to_f32();
}

void copy(const Tensor& dst, const Tensor& src) {
  no_cuda(dst.device());
  no_cuda(src.device());
  CHIMERA_CHECK(dst.nbytes() == src.nbytes() && dst.dtype() == src.dtype(), "copy {} <- {}", dst.describe(),
                src.describe());
  std::memcpy(dst.data(), src.data(), src.nbytes());
}

void zero(const Tensor& t) {
  no_cuda(t.device());
  if (t.nbytes() > 0) std::memset(t.data(), 0, t.nbytes());
}

void synchronize(Device device) { no_cuda(device); }
void synchronize_stream(void* /*stream*/) {
  throw_runtime("device::synchronize_stream: this build of chimera has no CUDA backend");
}
std::pair<size_t, size_t> cuda_memory_stats() { return {0, 0}; }

MemoryInfo memory_info(Device device) {
  no_cuda(device);
  return host_memory_info();
}

Stream Stream::create() { runtime_error("Stream: this build of chimera has no CUDA backend"); }
void Stream::synchronize() const {}
Tensor empty_pinned(DType, Shape) { runtime_error("empty_pinned: this build of chimera has no CUDA backend"); }
void copy_async(const Tensor& dst, const Tensor& src, void*) { copy(dst, src); }

struct AllocPool::Impl {};
AllocPool::AllocPool() { runtime_error("AllocPool: this build of chimera has no CUDA backend"); }
size_t AllocPool::bytes() const { return 0; }
ScopedAllocPool::ScopedAllocPool(const AllocPool&) : previous_(nullptr) {}
ScopedAllocPool::~ScopedAllocPool() { previous_ = nullptr; }  // restores nothing: there is no pool without CUDA

Graph Graph::capture(void*, const std::function<void()>&) {
  runtime_error("Graph: this build of chimera has no CUDA backend");
}
void Graph::launch(void*) const { runtime_error("Graph: this build of chimera has no CUDA backend"); }

}  // namespace chimera::device
