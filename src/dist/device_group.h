// The device collectives of tensor-parallel ranks on distinct GPUs (ops::TpGroup::device): one NCCL clique over
// the ranks' devices and the fused AllReduce (dist/allreduce.h, strategy AUTO: ONESHOT / TWOSHOT over peer-mapped
// memory where this process drives every rank and every pair has peer access, NCCL + the fused norm kernel
// otherwise). The ranks are threads of one process, or spread over processes (each process makes the group of its
// own ranks from one unique id). Built with CUDA and NCCL only (CHIMERA_HAVE_NCCL).
//
// Every call is made by every rank, from that rank's thread with its device current, on its own stream, in the
// same order (dist/allreduce.h's contract). Tensors are contiguous CUDA tensors of the rank's device in F32, BF16
// or F16; the calls return once the work is enqueued.
#pragma once

#include <memory>
#include <vector>

#include "core/tensor.h"
#include "dist/allreduce.h"
#include "dist/communicator.h"

namespace chimera::dist {

class DeviceGroup {
 public:
  // devices: one distinct CUDA ordinal per rank, in rank order; every rank in this process.
  explicit DeviceGroup(const std::vector<int>& devices, AllReduceConfig config = {});
  // This process's ranks [first_rank, first_rank + devices.size()) of n_ranks (rank first_rank + i on
  // devices[i]), joining the clique `id` names (Communicator::create_ranks).
  DeviceGroup(const ncclUniqueId& id, int n_ranks, int first_rank, const std::vector<int>& devices,
              AllReduceConfig config = {});
  ~DeviceGroup();
  DeviceGroup(const DeviceGroup&) = delete;
  DeviceGroup& operator=(const DeviceGroup&) = delete;

  int size() const { return comm_->size(); }
  // Rank `rank`'s GPU (a rank of this process).
  int device(int rank) const { return comm_->device(local(rank)); }
  const Communicator& communicator() const { return *comm_; }

  // `rank` in every call: the rank's index in the whole group (one of this process's).
  // x [rows, cols] = the sum of every rank's x (in place, through a temporary the sum lands in).
  void all_reduce(int rank, const Tensor& x, void* stream);
  // The row-parallel layer's epilogue in one fused call: residual += sum of every rank's x, then
  // out = rms_norm(residual) * weight. residual, out, x: [T, D] in one dtype; weight [D] in it too.
  void all_reduce_add_rms_norm(int rank, const Tensor& residual, const Tensor& out, const Tensor& x,
                               const Tensor& weight, float eps, void* stream);
  // out [size, ...in's shape] = every rank's `in` in rank order (ncclAllGather).
  void all_gather(int rank, const Tensor& in, const Tensor& out, void* stream);
  // From any thread (dist::StepWatchdog): aborts the NCCL clique, ending the local ranks' waiting NCCL kernels;
  // every later call is a kRuntime error. The peer-mapped ONESHOT / TWOSHOT kernels (every rank in this process)
  // have no abort: a rank thread that fails before its collective leaves its peers' kernels waiting.
  void abort();

 private:
  int local(int rank) const;  // the rank's index among this process's ranks (checked)
  std::unique_ptr<Communicator> comm_;
  std::unique_ptr<AllReduceFusion> fusion_;
};

}  // namespace chimera::dist
