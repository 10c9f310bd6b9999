// Device services on CUDA: a caching allocator (size-bucketed free lists, so steady-state steps never call
// cudaMalloc), host <-> device copies with dtype conversion on the host, device discovery.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "backends/cuda/cuda_common.cuh"
#include "backends/device_api.h"

namespace chimera::device {
namespace {

// Blocks are rounded up to 512 bytes (small) or 2 MiB (large) and kept in a free list per rounded size.
class CachingAllocator {
 public:
  // keep_blocks: a graph pool (AllocPool) never gives blocks back to the driver before it dies, not even to
  // retry an allocation that failed. It also reuses a free block up to twice the rounded request (best fit),
  // not only one of the same size: the engine captures its decode graphs one after another, largest batch
  // first, into one pool, and replays them one at a time on one stream, so each capture can run in the blocks
  // the larger captures before it freed. The pool then holds about one large step's activations, not the sum
  // over all captured sizes.
  explicit CachingAllocator(bool keep_blocks = false) : keep_blocks_(keep_blocks) {}
  ~CachingAllocator() { release_cached(); }

  void* allocate(size_t bytes) {
    const size_t size = round(bytes);
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = free_.find(size);
      if (keep_blocks_ && (it == free_.end() || it->second.empty())) {
        for (it = free_.lower_bound(size); it != free_.end() && it->first <= 2 * size && it->second.empty(); ++it) {
        }
        if (it != free_.end() && it->first > 2 * size) it = free_.end();
      }
      if (it != free_.end() && !it->second.empty()) {
        void* p = it->second.back();
        it->second.pop_back();
        cached_ -= it->first;
        in_use_ += it->first;
        return p;
      }
    }
    void* p = nullptr;
    cudaError_t err = cudaMalloc(&p, size);
    if (err == cudaErrorMemoryAllocation && !keep_blocks_) {
      (void)cudaGetLastError();
      release_cached();
      err = cudaMalloc(&p, size);
    }
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      size_t free_b = 0, total_b = 0;
      cudaMemGetInfo(&free_b, &total_b);
      throw_runtime(str_cat("out of GPU memory: needed ", size, " bytes, ", free_b, " free of ", total_b, " (",
                            in_use_, " in use by chimera)"));
    }
    std::lock_guard<std::mutex> lock(mu_);
    in_use_ += size;
    block_size_[p] = size;
    return p;
  }

  // A small block waits in a short FIFO (kCooldown further releases) before it can be handed out again, so the
  // blocks an op frees at its return (workspaces its last kernel may still be using when the next op launches) do
  // not come straight back as the next op's buffers: a kernel that writes before pdl_wait() ("two back",
  // launch.cuh) may then write any buffer its op allocated. Large blocks (activations) are reused at once.
  void release(void* p, size_t /*bytes: the request; the block may be larger (best fit)*/) {
    std::lock_guard<std::mutex> lock(mu_);
    const size_t size = block_size_.at(p);
    in_use_ -= size;
    cached_ += size;
    if (size > kSmallBytes) {
      free_[size].push_back(p);
      return;
    }
    cooling_.emplace_back(size, p);
    if (cooling_.size() > kCooldown) {
      free_[cooling_.front().first].push_back(cooling_.front().second);
      cooling_.pop_front();
    }
  }

  void release_cached() {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [size, p] : cooling_) free_[size].push_back(p);
    cooling_.clear();
    for (auto& [size, list] : free_) {
      for (void* p : list) {
        cudaFree(p);
        block_size_.erase(p);
      }
      cached_ -= size * list.size();
      list.clear();
    }
  }

  std::pair<size_t, size_t> stats() {
    std::lock_guard<std::mutex> lock(mu_);
    return {in_use_, cached_};
  }

 private:
  static constexpr size_t kSmallBytes = size_t{1} << 20;
  static constexpr size_t kCooldown = 16;
  static size_t round(size_t b) {
    b = b ? b : 1;
    if (b <= kSmallBytes) return (b + 511) / 512 * 512;
    return (b + (2u << 20) - 1) / (2u << 20) * (2u << 20);
  }
  const bool keep_blocks_;
  std::mutex mu_;
  std::map<size_t, std::vector<void*>> free_;
  std::unordered_map<void*, size_t> block_size_;  // every block this allocator got from cudaMalloc: its size
  std::deque<std::pair<size_t, void*>> cooling_;  // small blocks released last, oldest first
  size_t in_use_ = 0, cached_ = 0;
};

// One allocator per device (tensor-parallel ranks on several GPUs): a block is handed out again only on the device
// it was allocated on. Never destroyed: tensors may outlive static destruction order.
constexpr int kMaxDevices = 64;

CachingAllocator& allocator() {
  static std::atomic<CachingAllocator*> allocators[kMaxDevices] = {};
  static std::mutex mu;
  int dev = 0;
  CHIMERA_CUDA_CHECK(cudaGetDevice(&dev), "device::empty");
  if (dev < 0 || dev >= kMaxDevices) throw_runtime(str_cat("device::empty: device ", dev, " beyond ", kMaxDevices));
  CachingAllocator* a = allocators[dev].load(std::memory_order_acquire);
  if (a) return *a;
  std::lock_guard<std::mutex> lock(mu);
  a = allocators[dev].load(std::memory_order_relaxed);
  if (!a) {
    a = new CachingAllocator();
    allocators[dev].store(a, std::memory_order_release);
  }
  return *a;
}

}  // namespace

struct AllocPool::Impl {
  CachingAllocator blocks{/*keep_blocks=*/true};
  std::weak_ptr<Impl> self;
};

namespace {
thread_local AllocPool::Impl* t_pool = nullptr;  // set by ScopedAllocPool
}  // namespace

int device_count() {
  if (!cuda_available()) return 0;
  int n = 0;
  CHIMERA_CUDA_CHECK(cudaGetDeviceCount(&n), "device::device_count");
  return n;
}

int current_device() {
  int dev = 0;
  CHIMERA_CUDA_CHECK(cudaGetDevice(&dev), "device::current_device");
  return dev;
}

void set_current_device(int ordinal) {
  const int n = device_count();
  if (ordinal < 0 || ordinal >= n) throw_runtime(str_cat("device::set_current_device: GPU ", ordinal, " of ", n));
  CHIMERA_CUDA_CHECK(cudaSetDevice(ordinal), "device::set_current_device");
}

std::string device_uuid(int ordinal) {
  cudaDeviceProp prop{};
  CHIMERA_CUDA_CHECK(cudaGetDeviceProperties(&prop, ordinal), "device::device_uuid");
  static const char* hex = "0123456789abcdef";
  std::string out = "GPU-";
  for (int i = 0; i < 16; ++i) {
    const auto b = static_cast<unsigned char>(prop.uuid.bytes[i]);
    if (i == 4 || i == 6 || i == 8 || i == 10) out += '-';
    out += hex[b >> 4];
    out += hex[b & 15];
  }
  return out;
}

bool cuda_available() {
  static const bool available = [] {
    int n = 0;
    const cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    return n > 0;
  }();
  return available;
}

namespace {
// Whether the current device can launch with PDL (compute capability 9.0+): a property of the hardware, read once.
bool pdl_supported() {
  static const bool supported = [] {
    int dev = 0, major = 0;
    return cuda_available() && cudaGetDevice(&dev) == cudaSuccess &&
           cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess && major >= 9;
  }();
  return supported;
}
// The innermost LaunchScope's setting on this thread (true without one: the KernelConfig default). Set only by
// LaunchScope, from the configuration of the op (or caller) that launches.
thread_local bool t_scope_pdl = true;
}  // namespace

bool pdl_enabled() { return t_scope_pdl && pdl_supported(); }

LaunchScope::LaunchScope(bool pdl) : previous_(t_scope_pdl) { t_scope_pdl = pdl; }
LaunchScope::~LaunchScope() { t_scope_pdl = previous_; }

std::string describe_cuda() {
  if (!cuda_available()) return "no CUDA device is available (cudaGetDeviceCount found none)";
  int dev = 0;
  cudaGetDevice(&dev);
  cudaDeviceProp p{};
  cudaGetDeviceProperties(&p, dev);
  return str_cat(p.name, ", sm_", p.major, p.minor, ", ", p.multiProcessorCount, " SMs, ",
                 static_cast<double>(p.totalGlobalMem) / (1u << 30), " GiB");
}

Tensor empty(Device device, DType dtype, Shape shape) {
  if (device == Device::kCpu) return Tensor::empty(dtype, std::move(shape));
  const size_t bytes = static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype);
  if (t_pool != nullptr) {
    // The block returns to its pool, which the deleter keeps alive (tensors may outlive the ScopedAllocPool).
    std::shared_ptr<AllocPool::Impl> pool(t_pool->self.lock());
    void* p = pool->blocks.allocate(bytes);
    std::shared_ptr<void> owner(p, [bytes, pool](void* q) { pool->blocks.release(q, bytes); });
    return Tensor::wrap(p, dtype, std::move(shape), std::move(owner), Device::kCuda);
  }
  CachingAllocator& a = allocator();
  void* p = a.allocate(bytes);
  std::shared_ptr<void> owner(p, [bytes, &a](void* q) { a.release(q, bytes); });
  return Tensor::wrap(p, dtype, std::move(shape), std::move(owner), Device::kCuda);
}

void copy(const Tensor& dst, const Tensor& src) {
  if (dst.nbytes() != src.nbytes() || dst.dtype() != src.dtype()) {
    throw_runtime(str_cat("device::copy ", dst.describe(), " <- ", src.describe()));
  }
  if (src.nbytes() == 0) return;
  // Host to host needs no CUDA (and must work in a CUDA build on a machine without a GPU: the Cpu test instances).
  if (dst.device() == Device::kCpu && src.device() == Device::kCpu) {
    std::memcpy(dst.data(), src.data(), src.nbytes());
    return;
  }
  CHIMERA_CUDA_CHECK(cudaMemcpy(dst.data(), src.data(), src.nbytes(), cudaMemcpyDefault), "device::copy");
}

Tensor to_device(const Tensor& t, Device device, DType dtype) {
  Tensor src = t;
  if (dtype != t.dtype()) {
    Tensor host_f32 = to_host_f32(t);
    src = Tensor::empty(dtype, t.shape());
    convert_from_f32(host_f32.f32(), dtype, src.data(), static_cast<size_t>(t.numel()));
  }
  Tensor out = empty(device, dtype, t.shape());
  copy(out, src);
  return out;
}

Tensor to_host(const Tensor& t) {
  Tensor out = Tensor::empty(t.dtype(), t.shape());
  copy(out, t);
  return out;
}

Tensor to_host_f32(const Tensor& t) {
  Tensor h = t.device() == Device::kCpu ? t : to_host(t);
  return h.dtype() == DType::kF32 ? (t.device() == Device::kCpu ? h.clone() : h) : h.to_f32();
}

void zero(const Tensor& t) {
  if (t.nbytes() == 0) return;
  if (t.device() == Device::kCpu) {
    std::memset(t.data(), 0, t.nbytes());
    return;
  }
  CHIMERA_CUDA_CHECK(cudaMemset(t.data(), 0, t.nbytes()), "device::zero");
}

void synchronize(Device device) {
  if (device == Device::kCuda) CHIMERA_CUDA_CHECK(cudaDeviceSynchronize(), "device::synchronize");
}

std::pair<size_t, size_t> cuda_memory_stats() { return allocator().stats(); }

// ---- streams, pinned staging, graphs ----------------------------------------------------------------

Stream Stream::create() {
  if (!cuda_available()) throw_runtime(str_cat("Stream: ", describe_cuda()));
  cudaStream_t st = nullptr;
  CHIMERA_CUDA_CHECK(cudaStreamCreate(&st), "device::Stream");
  Stream s;
  s.handle_ = std::shared_ptr<void>(st, [](void* h) { cudaStreamDestroy(static_cast<cudaStream_t>(h)); });
  return s;
}

void synchronize_stream(void* stream) {
  CHIMERA_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), "device::synchronize_stream");
}

void Stream::synchronize() const {
  CHIMERA_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(get())), "device::Stream::synchronize");
}

Tensor empty_pinned(DType dtype, Shape shape) {
  const size_t bytes = std::max<size_t>(1, static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype));
  void* p = nullptr;
  CHIMERA_CUDA_CHECK(cudaMallocHost(&p, bytes), "device::empty_pinned");
  std::shared_ptr<void> owner(p, [](void* q) { cudaFreeHost(q); });
  return Tensor::wrap(p, dtype, std::move(shape), std::move(owner), Device::kCpu);
}

void copy_async(const Tensor& dst, const Tensor& src, void* stream) {
  if (dst.nbytes() != src.nbytes() || dst.dtype() != src.dtype()) {
    throw_runtime(str_cat("device::copy_async ", dst.describe(), " <- ", src.describe()));
  }
  if (src.nbytes() == 0) return;
  CHIMERA_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), src.nbytes(), cudaMemcpyDefault,
                                     static_cast<cudaStream_t>(stream)),
                     "device::copy_async");
}

AllocPool::AllocPool() {
  if (!cuda_available()) throw_runtime(str_cat("AllocPool: ", describe_cuda()));
  impl_ = std::make_shared<Impl>();
  impl_->self = impl_;
}

size_t AllocPool::bytes() const {
  const auto [in_use, cached] = impl_->blocks.stats();
  return in_use + cached;
}

ScopedAllocPool::ScopedAllocPool(const AllocPool& pool) : previous_(t_pool) { t_pool = pool.impl(); }
ScopedAllocPool::~ScopedAllocPool() { t_pool = previous_; }

Graph Graph::capture(void* stream, const std::function<void()>& body) {
  const auto st = static_cast<cudaStream_t>(stream);
  if (st == nullptr) throw_runtime("device::Graph::capture: the legacy default stream cannot be captured");
  // Relaxed: the pool may call cudaMalloc while the stream captures (the first capture of a size).
  CHIMERA_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeRelaxed), "device::Graph::capture");
  cudaGraph_t graph = nullptr;
  try {
    body();
  } catch (...) {
    (void)cudaStreamEndCapture(st, &graph);
    if (graph) cudaGraphDestroy(graph);
    (void)cudaGetLastError();
    throw;
  }
  CHIMERA_CUDA_CHECK(cudaStreamEndCapture(st, &graph), "device::Graph::capture (end)");
  cudaGraphExec_t exec = nullptr;
  const cudaError_t err = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  CHIMERA_CUDA_CHECK(err, "device::Graph::capture (instantiate)");
  Graph g;
  g.exec_ = std::shared_ptr<void>(exec, [](void* e) { cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(e)); });
  return g;
}

void Graph::launch(void* stream) const {
  if (!exec_) throw_runtime("device::Graph::launch: empty graph");
  CHIMERA_CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec_.get()), static_cast<cudaStream_t>(stream)),
                     "device::Graph::launch");
}

MemoryInfo memory_info(Device device) {
  if (device == Device::kCpu) return host_memory_info();
  if (!cuda_available()) throw_runtime(str_cat("device::memory_info: ", describe_cuda()));
  size_t free_b = 0, total_b = 0;
  CHIMERA_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b), "device::memory_info");
  // Blocks cached by the allocator are free for this process even though the driver counts them as used.
  return MemoryInfo{free_b + allocator().stats().second, total_b};
}

}  // namespace chimera::device

namespace chimera::cuda {

void* upload_scratch(const void* host, size_t bytes, cudaStream_t stream, int slot) {
  // A few independent buffers per thread so one op can upload several arrays.
  constexpr int kSlots = 8;
  struct Scratch {
    void* ptr[kSlots] = {};
    size_t cap[kSlots] = {};
  };
  thread_local Scratch s;
  if (slot < 0 || slot >= kSlots) throw_runtime(str_cat("upload_scratch: slot ", slot, " out of range"));
  if (bytes == 0) return nullptr;
  if (s.cap[slot] < bytes) {
    // The old buffer may still be read by queued work: wait for the stream before freeing it.
    if (s.ptr[slot]) {
      CHIMERA_CUDA_CHECK(cudaStreamSynchronize(stream), "upload_scratch");
      CHIMERA_CUDA_CHECK(cudaFree(s.ptr[slot]), "upload_scratch");
    }
    const size_t cap = std::max<size_t>(bytes, 4096) * 2;
    CHIMERA_CUDA_CHECK(cudaMalloc(&s.ptr[slot], cap), "upload_scratch");
    s.cap[slot] = cap;
  }
  // Pageable source: cudaMemcpyAsync returns once the source is staged, so the host array may go away.
  CHIMERA_CUDA_CHECK(cudaMemcpyAsync(s.ptr[slot], host, bytes, cudaMemcpyHostToDevice, stream), "upload_scratch");
  return s.ptr[slot];
}

int sm_count() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> counts[kMaxDevices] = {};  // 0: not queried yet
  int dev = 0;
  CHIMERA_CUDA_CHECK(cudaGetDevice(&dev), "cuda::sm_count");
  if (dev >= 0 && dev < kMaxDevices) {
    const int cached = counts[dev].load(std::memory_order_relaxed);
    if (cached > 0) return cached;
  }
  int n = 0;
  CHIMERA_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev), "cuda::sm_count");
  if (dev >= 0 && dev < kMaxDevices) counts[dev].store(n, std::memory_order_relaxed);
  return n;
}

}  // namespace chimera::cuda
