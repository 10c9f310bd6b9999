// Ranks and NCCL communicators. One process driving the GPUs of one host, one thread per GPU, each rank its own
// stream (create_local: ncclCommInitAll); or several processes, possibly on several hosts, each driving some of
// the ranks, joined with a unique id shared out of band (create_ranks: the tensor-parallel launch sends it over
// its dist::HostGroup). The custom AllReduce kernels need every rank in one process (peer-mapped memory); NCCL
// spans processes and hosts.
#pragma once

#include <nccl.h>

#include <atomic>
#include <functional>
#include <memory>
#include <vector>

namespace chimera::dist {

class Communicator {
 public:
  // All local `devices` (CUDA ordinals, rank order) in one communicator, built by ncclCommInitAll.
  static std::unique_ptr<Communicator> create_local(const std::vector<int>& devices);
  // This process's ranks [first_rank, first_rank + devices.size()) of n_ranks, rank first_rank + i on devices[i],
  // joining the clique named by `id` (ncclGetUniqueId on rank 0, sent to the others out of band). Blocks until
  // every rank has joined: ncclCommInitRank has no timeout, so the caller first meets the other processes in a
  // barrier bounded by its own timeout (every rank is there and about to join).
  static std::unique_ptr<Communicator> create_ranks(const ncclUniqueId& id, int n_ranks, int first_rank,
                                                    const std::vector<int>& devices);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int size() const { return n_ranks_; }                       // ranks in the clique
  int local_ranks() const { return static_cast<int>(comms_.size()); }  // ranks driven by this process
  int first_rank() const { return first_rank_; }
  int device(int local) const { return devices_[static_cast<size_t>(local)]; }
  const std::vector<int>& devices() const { return devices_; }
  ncclComm_t nccl(int local) const { return comms_[static_cast<size_t>(local)]; }

  // ncclCommAbort on every local communicator (from any thread: it ends their uncompleted operations, kernels
  // waiting for a dead peer included); the communicator is unusable after it.
  void abort();
  bool aborted() const { return aborted_; }

  // Runs fn(local rank) on one thread per local rank, each with its device current; rethrows the first error
  // after every thread has returned.
  void run_ranks(const std::function<void(int)>& fn) const;

 private:
  Communicator() = default;
  int n_ranks_ = 0;
  int first_rank_ = 0;
  std::vector<int> devices_;
  std::vector<ncclComm_t> comms_;
  std::atomic<bool> aborted_{false};
};

// "NCCL_CHECK" for host code: throws kRuntime naming the call and NCCL's message.
void nccl_check(ncclResult_t r, const char* what);

}  // namespace chimera::dist
