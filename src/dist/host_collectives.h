// The host-memory collectives a tensor-parallel rank calls (ops::TpGroup): fp32 sums, gathers, byte broadcasts
// and barriers among `size` ranks, on buffers in host memory. The implementation: dist::HostGroup (ranks that are
// threads of one process, or spread over processes joined over TCP); an interface so that ops/ needs no sockets in
// its headers. Plain C++: built with and without CUDA / NCCL.
//
// The contract every implementation keeps: every collective is called by all ranks with the same operation and
// element count, each rank from its own thread, passing its rank; all_reduce_sum adds the ranks' buffers in rank
// order 0..size-1, so every rank holds identical bits; a rank that does not arrive within the timeout ends the
// collective on every waiting rank with a kRuntime error naming the missing rank(s), and the group stays broken
// (every later call fails at once), so nothing hangs; abort() breaks it at once.
#pragma once

#include <cstddef>
#include <span>
#include <string>

namespace chimera::dist {

class HostCollectives {
 public:
  virtual ~HostCollectives() = default;
  virtual int size() const = 0;
  // data (the same length on every rank) = the sum of every rank's data, added in rank order.
  virtual void all_reduce_sum(int rank, std::span<float> data) = 0;
  // out [size * in.size()] = every rank's `in` back to back in rank order.
  virtual void all_gather(int rank, std::span<const float> in, std::span<float> out) = 0;
  // Every rank's `data` = root's bytes.
  virtual void broadcast(int rank, std::span<std::byte> data, int root) = 0;
  virtual void barrier(int rank) = 0;
  // Breaks the group: every rank waiting in (or later entering) a collective throws kRuntime with `why`.
  virtual void abort(int rank, const std::string& why) = 0;
  // "" while the group is whole, else why it broke. Callable from any thread at any time (a watchdog asks while
  // the ranks are inside device collectives); HostGroup also looks for a peer whose connection closed.
  virtual std::string health() = 0;
};

}  // namespace chimera::dist
