// Tensor-parallel ranks in other processes (docs/architecture.md "Tensor parallelism"): the message node 0's
// TensorParallelModel broadcasts to the other nodes of its dist::HostGroup before each step, and the loop those
// nodes run. A message is one broadcast from rank 0 (its length, then its bytes): the call (a forward kind, or
// stop), the state operations the engine made on its caches since the last step (ModelState::remote_ops), at the
// first step the caches' layout (every cache tensor's dtype and shape, so every remote rank's caches start equal to
// node 0's), the StepBatch and, for an MTP step, its input rows. Every node runs the same binary: values are sent
// as their bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "dist/allreduce_types.h"
#include "dist/host_group.h"
#include "models/nemotron_h.h"
#include "runtime/batch.h"
#include "runtime/state_cache.h"

namespace chimera {

enum class RemoteCall : int32_t { kStop = 0, kForward, kForwardDevice, kForwardDeviceHidden, kMtpForward };

struct RemoteStep {
  RemoteCall call = RemoteCall::kStop;
  std::vector<StateOp> ops;
  // The first step's: zeros shaped like node 0's caches (rank 0's; every rank's have the same shapes).
  bool has_layout = false;
  ModelState layout;
  StepBatch batch;
  Tensor hidden;  // kMtpForward: the input rows (host)
  int32_t block = 0;
  bool want_mtp_hidden = false;
};

// `layout`: node 0's caches, sent as dtypes and shapes (null after the first step).
std::vector<std::byte> encode_remote_step(const RemoteStep& step, const ModelState* layout);
RemoteStep decode_remote_step(std::span<const std::byte> bytes);

// One message from rank 0 to every rank of `group`: each rank calls it from its own thread; rank 0 passes the
// message, the others get it back.
std::vector<std::byte> broadcast_remote_step(dist::HostCollectives& group, int rank, std::vector<std::byte> message);

// The loop of a node other than 0: its ranks (ranks[i] is rank group.first_rank() + i) first join the group's
// device collectives (TensorParallelModel::join_device_group, as node 0's constructor does; `allreduce` as node
// 0's), then each on its own thread with its own caches runs every step node 0 sends until it says stop. CUDA
// (ctx.device): rank first + i on GPU devices[i], with a stream and a device-memory pool of its own, its caches made
// there from node 0's layout. A rank's error aborts the group (so node 0 fails too) and is rethrown.
void run_remote_ranks(dist::HostGroup& group, std::vector<NemotronH>& ranks, const ops::Context& ctx,
                      const std::vector<int>& devices = {},
                      dist::AllReduceStrategy allreduce = dist::AllReduceStrategy::kAuto);

}  // namespace chimera
