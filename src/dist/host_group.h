// The host collectives (dist/host_collectives.h) of tensor-parallel ranks that are threads of one process
// (docs/architecture.md "Tensor parallelism"): a rendezvous under one mutex, each rank reading the others'
// posted buffers. Plain C++: built with and without CUDA / NCCL.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "dist/host_collectives.h"

namespace chimera::dist {

class HostGroup final : public HostCollectives {
 public:
  explicit HostGroup(int size, std::chrono::milliseconds timeout = std::chrono::seconds(60));
  HostGroup(const HostGroup&) = delete;
  HostGroup& operator=(const HostGroup&) = delete;

  int size() const override { return size_; }
  std::chrono::milliseconds timeout() const { return timeout_; }

  void all_reduce_sum(int rank, std::span<float> data) override;
  void all_gather(int rank, std::span<const float> in, std::span<float> out) override;
  void broadcast(int rank, std::span<std::byte> data, int root) override;
  void barrier(int rank) override;
  void abort(int rank, const std::string& why) override;
  std::string health() override;

 private:
  struct Post {
    const char* op = nullptr;
    const void* data = nullptr;
    size_t count = 0;
    int root = 0;
  };
  // Posts this rank's buffer and waits for every rank to post (phase 0) or to finish reading (phase 1).
  void rendezvous(int rank, const char* op);
  void check_rank(int rank, const char* op) const;
  // Phase 0 of a collective: post, wait, check that every rank called the same op with the same count and root.
  void enter(int rank, const Post& post);

  const int size_;
  const std::chrono::milliseconds timeout_;
  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t generation_ = 0;           // completed rendezvous
  int arrived_ = 0;                   // ranks waiting in the current one
  std::vector<uint64_t> arrived_at_;  // per rank: 1 + the generation it last arrived at
  std::vector<Post> posts_;
  std::string broken_;  // non-empty: the group is broken, why
};

}  // namespace chimera::dist
