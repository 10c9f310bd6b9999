#include "dist/topology.h"

#include <cuda_runtime.h>
#include <dlfcn.h>

#include "core/error.h"

namespace chimera::dist {

namespace {

// The few NVML entry points used, declared here so the build needs no nvml.h (not on every machine).
// Values from nvml.h: NVML_SUCCESS = 0, NVML_P2P_CAPS_INDEX_NVLINK = 2, NVML_P2P_STATUS_OK = 0.
using NvmlDevice = void*;
using NvmlInitFn = int (*)();
using NvmlShutdownFn = int (*)();
using NvmlByBusIdFn = int (*)(const char*, NvmlDevice*);
using NvmlP2PStatusFn = int (*)(NvmlDevice, NvmlDevice, int, int*);
constexpr int kNvmlP2PCapsNvlink = 2;

class Nvml {
 public:
  Nvml() {
    lib_ = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib_) {
      status_ = "libnvidia-ml.so.1 not found";
      return;
    }
    init_ = reinterpret_cast<NvmlInitFn>(dlsym(lib_, "nvmlInit_v2"));
    shutdown_ = reinterpret_cast<NvmlShutdownFn>(dlsym(lib_, "nvmlShutdown"));
    by_bus_id_ = reinterpret_cast<NvmlByBusIdFn>(dlsym(lib_, "nvmlDeviceGetHandleByPciBusId_v2"));
    p2p_ = reinterpret_cast<NvmlP2PStatusFn>(dlsym(lib_, "nvmlDeviceGetP2PStatus"));
    if (!init_ || !shutdown_ || !by_bus_id_ || !p2p_) {
      status_ = "NVML lacks nvmlDeviceGetP2PStatus";
    } else if (init_() != 0) {
      status_ = "nvmlInit failed";
    } else {
      ok_ = true;
      status_ = "ok";
    }
  }
  ~Nvml() {
    if (ok_) shutdown_();
    if (lib_) dlclose(lib_);
  }
  Nvml(const Nvml&) = delete;
  Nvml& operator=(const Nvml&) = delete;

  bool ok() const { return ok_; }
  const std::string& status() const { return status_; }
  NvmlDevice device(int cuda_ordinal) const {
    char bus_id[32] = {};
    if (cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), cuda_ordinal) != cudaSuccess) return nullptr;
    NvmlDevice d = nullptr;
    return by_bus_id_(bus_id, &d) == 0 ? d : nullptr;
  }
  Link link(NvmlDevice a, NvmlDevice b) const {
    if (!a || !b) return Link::kUnknown;
    int status = -1;
    if (p2p_(a, b, kNvmlP2PCapsNvlink, &status) != 0) return Link::kUnknown;
    return status == 0 ? Link::kNvlink : Link::kNoNvlink;
  }

 private:
  void* lib_ = nullptr;
  bool ok_ = false;
  std::string status_;
  NvmlInitFn init_ = nullptr;
  NvmlShutdownFn shutdown_ = nullptr;
  NvmlByBusIdFn by_bus_id_ = nullptr;
  NvmlP2PStatusFn p2p_ = nullptr;
};

}  // namespace

bool Topology::all_peer_access() const {
  for (uint8_t p : peer)
    if (!p) return false;
  return true;
}

bool Topology::all_nvlink() const {
  for (Link l : link)
    if (l != Link::kSelf && l != Link::kNvlink) return false;
  return true;
}

std::string Topology::describe() const {
  std::string s = fmt::format("{} GPUs, NVML: {}\n", size(), nvml);
  for (int i = 0; i < size(); ++i) {
    s += fmt::format("  cuda:{} ", devices[static_cast<size_t>(i)]);
    for (int j = 0; j < size(); ++j) {
      const Link l = link[static_cast<size_t>(i * size() + j)];
      s += i == j ? " X " : fmt::format(" {}{} ", can_access(i, j) ? 'P' : '-',
                                        l == Link::kNvlink ? 'N' : l == Link::kNoNvlink ? '-' : '?');
    }
    s += "\n";
  }
  return s;
}

Topology detect_topology(const std::vector<int>& devices) {
  Topology t;
  t.devices = devices;
  const int n = t.size();
  t.peer.assign(static_cast<size_t>(n * n), 1);
  t.link.assign(static_cast<size_t>(n * n), Link::kSelf);
  Nvml nvml;
  t.nvml = nvml.status();
  std::vector<NvmlDevice> handles(static_cast<size_t>(n), nullptr);
  if (nvml.ok())
    for (int i = 0; i < n; ++i) handles[static_cast<size_t>(i)] = nvml.device(devices[static_cast<size_t>(i)]);
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      if (i == j) continue;
      int can = 0;
      const cudaError_t err =
          cudaDeviceCanAccessPeer(&can, devices[static_cast<size_t>(i)], devices[static_cast<size_t>(j)]);
      if (err != cudaSuccess) {
        runtime_error("dist::detect_topology: cudaDeviceCanAccessPeer({}, {}) failed: {}", devices[static_cast<size_t>(i)],
                      devices[static_cast<size_t>(j)], cudaGetErrorString(err));
      }
      t.peer[static_cast<size_t>(i * n + j)] = can ? 1 : 0;
      t.link[static_cast<size_t>(i * n + j)] =
          nvml.ok() ? nvml.link(handles[static_cast<size_t>(i)], handles[static_cast<size_t>(j)]) : Link::kUnknown;
    }
  }
  return t;
}

}  // namespace chimera::dist
