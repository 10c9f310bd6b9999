// A communicator for tensor-parallel ranks that are threads of one process (the CPU reference backend's
// tensor parallelism, docs/architecture.md "Tensor parallelism"). Plain C++: built with and without CUDA / NCCL.
//
// Every collective is called by all `size` ranks with the same operation and element count, each from its own
// thread, passing its rank. Results are deterministic: all_reduce_sum adds the ranks' buffers in rank order
// 0..size-1 on every rank, so every rank holds identical bits. A rank that does not arrive within the timeout
// ends the collective on every waiting rank with a kRuntime error naming the missing rank(s), and the group stays
// broken (every later call fails at once): nothing hangs. abort() breaks it at once (a rank whose step threw).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <span>
#include <string>
#include <vector>

namespace chimera::dist {

class HostGroup {
 public:
  explicit HostGroup(int size, std::chrono::milliseconds timeout = std::chrono::seconds(60));
  HostGroup(const HostGroup&) = delete;
  HostGroup& operator=(const HostGroup&) = delete;

  int size() const { return size_; }
  std::chrono::milliseconds timeout() const { return timeout_; }

  // data (the same length on every rank) = the sum of every rank's data, added in rank order.
  void all_reduce_sum(int rank, std::span<float> data);
  // out [size * in.size()] = every rank's `in` back to back in rank order.
  void all_gather(int rank, std::span<const float> in, std::span<float> out);
  // Every rank's `data` = root's bytes.
  void broadcast(int rank, std::span<std::byte> data, int root);
  void barrier(int rank);
  // Breaks the group: every rank waiting in (or later entering) a collective throws kRuntime with `why`.
  void abort(int rank, const std::string& why);

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
