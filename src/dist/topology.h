// Which local GPUs can map each other's memory, and over what link. Custom AllReduce kernels need peer access
// between every pair of ranks; without it only NCCL is eligible.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace chimera::dist {

enum class Link : uint8_t { kSelf, kUnknown, kNvlink, kNoNvlink };

struct Topology {
  std::vector<int> devices;       // CUDA ordinals, rank order
  std::vector<uint8_t> peer;      // [n x n]: cudaDeviceCanAccessPeer(devices[i], devices[j]) (1 on the diagonal)
  std::vector<Link> link;         // [n x n]: from NVML's P2P NVLink status when NVML loads, else kUnknown
  std::string nvml;               // "ok" or why NVML was not used

  int size() const { return static_cast<int>(devices.size()); }
  bool can_access(int i, int j) const { return peer[static_cast<size_t>(i * size() + j)] != 0; }
  bool all_peer_access() const;   // every pair; the condition for ONESHOT / TWOSHOT
  bool all_nvlink() const;        // every pair known to be NVLink
  std::string describe() const;   // a small matrix for logs ("P" peer, "N" NVLink, "?" unknown)
};

// Queries CUDA for peer access and NVML (loaded with dlopen, so a machine without it still works) for NVLink.
Topology detect_topology(const std::vector<int>& devices);

}  // namespace chimera::dist
