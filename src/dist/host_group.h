// The host collectives (dist/host_collectives.h) of tensor-parallel ranks (docs/architecture.md "Tensor
// parallelism"): `size` ranks that are threads of one process, or spread over `nnodes` processes (nodes), possibly on
// several hosts, each hosting `size / nnodes` ranks as threads (node k: ranks [k * size / nnodes, (k + 1) * size /
// nnodes)). Nodes join over TCP in a star around node 0, which listens on master_port; the others connect to
// master_addr:master_port. One node (the one-process constructor) opens no socket.
//
// One collective: the node's local ranks meet in a rendezvous under one mutex; the last to arrive computes the
// node's part for all of them (on one node: the whole result) while the others wait. A node other than 0 sends node 0
// one frame with its local ranks' data; node 0 combines every node's frame with its own ranks' data and sends each
// node the result. all_reduce_sum therefore adds ranks 0..size-1 in order on node 0 alone and every rank gets those
// bits, however the ranks are spread over nodes; all_gather and broadcast move only bytes. Everything passes
// through node 0, which is simple and fine for the sizes a layer's activations have on the CPU backend; a ring or
// tree would be the next step for large messages or many nodes.
//
// Frames are length-prefixed with a fixed header (type, op, count, root, sequence number), so nodes that call
// different collectives, counts or roots get a clear kRuntime error naming the nodes instead of misreading bytes.
// Every wait is bounded: a rank that does not arrive, a node that does not join (construction) or does not arrive (a
// collective) within the timeout, or whose connection closes (its process died), breaks the group on every node
// with a message naming that rank or node; abort() breaks it on every node too. A broken group fails every later
// call at once. A node other than 0 waits up to twice the timeout for node 0's answer, so node 0's own verdict about
// a third node (sent within one timeout) is what it reports; wait_broadcast waits without a deadline but not
// blindly. Plain POSIX sockets (TCP_NODELAY); every node must have the same byte order (frames are not converted).
// Built with and without CUDA / NCCL.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "dist/host_collectives.h"

namespace chimera::dist {

class HostGroup final : public HostCollectives {
 public:
  // Blocks until every node has joined (node 0: accepted and checked each node's hello; the others: connected,
  // retrying until the timeout, and got node 0's confirmation). Bad arguments are kInvalidInput; a node that does
  // not join in time, a bind / connect failure or nodes that disagree on size / nnodes are kRuntime.
  HostGroup(int size, int nnodes, int node_rank, const std::string& master_addr, int master_port,
            std::chrono::milliseconds timeout = std::chrono::seconds(60));
  // Every rank a thread of this process (one node, no sockets).
  explicit HostGroup(int size, std::chrono::milliseconds timeout = std::chrono::seconds(60))
      : HostGroup(size, 1, 0, std::string(), 0, timeout) {}
  ~HostGroup() override;
  HostGroup(const HostGroup&) = delete;
  HostGroup& operator=(const HostGroup&) = delete;

  int size() const override { return size_; }
  int nnodes() const { return nnodes_; }
  int node_rank() const { return node_rank_; }
  // The global ranks this node hosts: [first_rank(), first_rank() + local_size()).
  int first_rank() const { return node_rank_ * local_size_; }
  int local_size() const { return local_size_; }
  std::chrono::milliseconds timeout() const { return timeout_; }

  void all_reduce_sum(int rank, std::span<float> data) override;
  void all_gather(int rank, std::span<const float> in, std::span<float> out) override;
  void broadcast(int rank, std::span<std::byte> data, int root) override;
  void barrier(int rank) override;
  // broadcast(rank, data, 0) for nodes that wait for node 0's next command (a server's other nodes idle between
  // requests): off node 0, node 0's answer is awaited without a deadline, but node 0's process ending (its
  // connection closes), an abort, or its host going away (TCP keepalive: about 10 s without an answer) still ends
  // the wait with an error naming node 0. On node 0 (and for the local rendezvous) the same as broadcast.
  void wait_broadcast(int rank, std::span<std::byte> data);
  void abort(int rank, const std::string& why) override;
  // broken_, or, while whole, a look (without waiting or reading) at every connection: one whose peer closed it
  // (its process died) breaks the group naming that node, as a collective would.
  std::string health() override;

  enum class Op : uint32_t { kAllReduceSum = 1, kAllGather, kBroadcast, kBarrier };

 private:
  struct Post {
    Op op = Op::kBarrier;
    const void* in = nullptr;
    void* out = nullptr;
    size_t count = 0;  // elements (floats; bytes for broadcast)
    int root = 0;
    bool idle = false;  // wait_broadcast off node 0: no deadline for node 0's answer
  };
  struct Peer;  // one connection (node 0: to every other node; the others: to node 0)

  void connect_to_master(const std::string& master_addr, int master_port);
  void accept_nodes(const std::string& master_addr, int master_port);
  // Posts this rank's call; the last local rank to arrive runs exchange(), the others wait for it.
  void collective(int rank, const Post& post);
  // The network part of one collective for every local rank (their posts are complete and consistent).
  void exchange(uint64_t seq);
  void exchange_master(uint64_t seq);
  void exchange_worker(uint64_t seq);
  // Breaks the group with `why` (the first reason wins) and tells the other nodes (best effort).
  void fail(const std::string& why);
  std::string node_name(int node) const;  // "node 1 (ranks 2-3)"
  size_t payload_bytes(const Post& p, int node, bool result) const;

  const int size_;
  const int nnodes_;
  const int node_rank_;
  const int local_size_;
  const std::chrono::milliseconds timeout_;
  std::vector<std::unique_ptr<Peer>> peers_;  // by node; null for this node (and, off node 0, all but node 0)
  int wake_[2] = {-1, -1};                    // a pipe abort() writes to, so an exchange's poll returns at once

  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t generation_ = 0;           // completed collectives
  bool generation_ok_ = true;         // whether the last completed one succeeded
  bool exchanging_ = false;           // every local rank has arrived; the last one is exchanging
  int arrived_ = 0;                   // local ranks waiting in the current one
  std::vector<uint64_t> arrived_at_;  // per local rank: 1 + the generation it last arrived at
  std::vector<Post> posts_;           // per local rank
  std::string broken_;                // non-empty: the group is broken, why
  std::atomic<bool> is_broken_{false};
};

}  // namespace chimera::dist
