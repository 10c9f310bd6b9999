#include "dist/communicator.h"

#include <cuda_runtime.h>

#include <exception>
#include <mutex>
#include <thread>

#include "core/error.h"

namespace chimera::dist {

void nccl_check(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) runtime_error("dist: {} failed: {} ({})", what, ncclGetErrorString(r), static_cast<int>(r));
}

std::unique_ptr<Communicator> Communicator::create_local(const std::vector<int>& devices) {
  if (devices.empty()) invalid_input("dist::Communicator: no devices");
  std::unique_ptr<Communicator> c(new Communicator());
  c->n_ranks_ = static_cast<int>(devices.size());
  c->devices_ = devices;
  c->comms_.resize(devices.size());
  nccl_check(ncclCommInitAll(c->comms_.data(), c->n_ranks_, devices.data()), "ncclCommInitAll");
  return c;
}

std::unique_ptr<Communicator> Communicator::create_ranks(const ncclUniqueId& id, int n_ranks, int first_rank,
                                                         const std::vector<int>& devices) {
  const int local = static_cast<int>(devices.size());
  if (local < 1 || first_rank < 0 || first_rank + local > n_ranks) {
    invalid_input("dist::Communicator: ranks [{}, {}) of {}", first_rank, first_rank + local, n_ranks);
  }
  std::unique_ptr<Communicator> c(new Communicator());
  c->n_ranks_ = n_ranks;
  c->first_rank_ = first_rank;
  c->devices_ = devices;
  c->comms_.assign(devices.size(), nullptr);
  // Several ranks of one thread join inside one group call (each ncclCommInitRank alone would wait for the others).
  nccl_check(ncclGroupStart(), "ncclGroupStart");
  for (int i = 0; i < local; ++i) {
    const int device = devices[static_cast<size_t>(i)];
    if (cudaSetDevice(device) != cudaSuccess) runtime_error("dist::Communicator: cudaSetDevice({}) failed", device);
    nccl_check(ncclCommInitRank(&c->comms_[static_cast<size_t>(i)], n_ranks, id, first_rank + i), "ncclCommInitRank");
  }
  nccl_check(ncclGroupEnd(), "ncclGroupEnd (ncclCommInitRank)");
  return c;
}

Communicator::~Communicator() {
  if (aborted_) return;  // ncclCommAbort freed them
  for (ncclComm_t comm : comms_)
    if (comm) ncclCommDestroy(comm);
}

void Communicator::abort() {
  if (aborted_.exchange(true)) return;
  for (ncclComm_t comm : comms_)
    if (comm) ncclCommAbort(comm);
}

void Communicator::run_ranks(const std::function<void(int)>& fn) const {
  std::exception_ptr first;
  std::mutex mu;
  std::vector<std::thread> threads;
  threads.reserve(comms_.size());
  for (int r = 0; r < local_ranks(); ++r) {
    threads.emplace_back([&, r] {
      try {
        if (cudaSetDevice(device(r)) != cudaSuccess) runtime_error("dist: cudaSetDevice({}) failed", device(r));
        fn(r);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!first) first = std::current_exception();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

}  // namespace chimera::dist
