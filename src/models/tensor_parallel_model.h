// N tensor-parallel ranks of a Nemotron-H model behind the runtime's Model interface, so one Engine drives them
// (docs/architecture.md "Tensor parallelism"): each step runs every rank's forward in lockstep, rank 0 on the
// caller's thread and rank r > 0 on a thread of its own that lives as long as the model, rank r against its caches
// (the engine's ModelState for rank 0, state.peers[r - 1] for the others: the engine's StateCache is made with
// CacheSizes::tensor_parallel_size), and returns rank 0's logits, which are whole.
//
// Communicators: one dist::HostGroup always (the CPU backend's collectives, and the CUDA ones of ranks that share
// a GPU, staged through host memory); with CUDA ranks on distinct GPUs also a dist::DeviceGroup (NCCL and the fused
// AllReduce + residual + RMSNorm). On CUDA each rank thread has its GPU current and its own stream; a step waits
// for the engine's stream first (its uploads and state copies) and for every rank's stream at the end.
//
// Over a dist::HostGroup of several nodes the model holds node 0's ranks only and the other nodes run theirs
// (models/remote_ranks.h): each step is broadcast to them first, with the state operations the engine made on its
// caches since the last step, and destruction tells them to stop. CUDA ranks of several processes get device
// collectives when every rank has a GPU of its own (join_device_group: one NCCL clique, its unique id sent over the
// HostGroup); ranks sharing a GPU (two processes on one GPU: the tests) stage their collectives through host memory
// over the HostGroup.
//
// With device collectives every step is bounded by a dist::StepWatchdog: a rank that fails, a node whose
// connection closes, or a step that outlives the group's timeout aborts the NCCL clique (ending kernels that wait
// for a dead peer), and that step and every later one fail with the reason: the model must be made again.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <vector>

#include "dist/allreduce_types.h"
#include "dist/host_group.h"
#include "dist/step_watchdog.h"
#include "models/nemotron_h.h"
#include "models/remote_ranks.h"
#include "runtime/model.h"

namespace chimera {

namespace dist {
class DeviceGroup;
}  // namespace dist

class TensorParallelModel : public Model {
 public:
  // ranks[r]: the model made with ModelOptions::tp = {r, ranks.size()}. A rank whose step does not reach a
  // collective within `timeout` ends every rank's step with an error naming it. devices (CUDA): rank r's GPU, its
  // weights already there (create() puts them there); empty: every rank on the current GPU. allreduce: the
  // device collectives' strategy (ranks on distinct GPUs; kAuto: the tuned table).
  explicit TensorParallelModel(std::vector<NemotronH> ranks,
                               std::chrono::milliseconds timeout = std::chrono::seconds(60),
                               std::vector<int> devices = {},
                               dist::AllReduceStrategy allreduce = dist::AllReduceStrategy::kAuto);
  // Node 0 of `group`: ranks[r] is rank r of group->size() for r < group->local_size(); the other nodes run
  // run_remote_ranks. CUDA: rank r on GPU devices[r] (group->local_size() entries), its weights already there.
  TensorParallelModel(std::vector<NemotronH> ranks, std::unique_ptr<dist::HostGroup> group,
                      std::vector<int> devices = {},
                      dist::AllReduceStrategy allreduce = dist::AllReduceStrategy::kAuto);
  ~TensorParallelModel() override;
  // Loads (or makes, synthetic) every rank of `config`: make(options) with options.tp set per rank and, on CUDA,
  // rank r's GPU devices[r] current.
  static std::unique_ptr<TensorParallelModel> create(
      int size, const ModelOptions& options, const std::function<NemotronH(const ModelOptions&)>& make,
      std::vector<int> devices = {}, dist::AllReduceStrategy allreduce = dist::AllReduceStrategy::kAuto);
  // Every node of `group` calls it first thing after joining (node 0 in the constructor above, the others before
  // run_remote_ranks): its ranks' devices (`devices`, this node's GPUs in rank order; empty: the CPU) are compared
  // across the group. CUDA ranks that each have a GPU of their own get one NCCL clique (rank 0 makes the unique id
  // and broadcasts it over `group`; a barrier bounded by the group's timeout makes sure every node is there before
  // the unbounded NCCL join); ranks that share a GPU get null (their collectives go through host memory). Nodes on
  // different device kinds are kInvalidInput naming them; a build without NCCL gives null.
  static std::shared_ptr<dist::DeviceGroup> join_device_group(dist::HostGroup& group, const std::vector<int>& devices,
                                                              dist::AllReduceStrategy allreduce);
  // Ranks [first, first + count) of `size` only (one node's): rank first + i made with GPU devices[i] current
  // (empty: the current device).
  static std::vector<NemotronH> make_ranks(int size, int first, int count, const ModelOptions& options,
                                           const std::function<NemotronH(const ModelOptions&)>& make,
                                           const std::vector<int>& devices = {});

  // Rank 0's local config (the caches' geometry) with the whole vocabulary (the logits' width).
  const ModelConfig& config() const override { return config_; }
  // The whole model's config.
  const ModelConfig& model_config() const { return ranks_[0]->config(); }
  Device device() const override { return ranks_[0]->device(); }
  DType activation_dtype() const override { return ranks_[0]->activation_dtype(); }
  int mtp_blocks() const override { return ranks_[0]->mtp_blocks(); }
  int tensor_parallel_size() const override { return size_; }
  // The watchdog's reason, else the host group's health; "" at size 1.
  std::string failure() const override;
  int local_tensor_parallel_size() const override { return static_cast<int>(ranks_.size()); }
  std::vector<int> tensor_parallel_devices() const override { return devices_; }
  const NemotronH& rank(int r) const { return *ranks_[static_cast<size_t>(r)]; }
  // Whether the ranks' CUDA collectives run on NCCL and the fused AllReduce (ranks on distinct GPUs).
  bool has_device_collectives() const { return device_group_ != nullptr; }

  Tensor forward(const ops::Context& ctx, const StepBatch& batch, ModelState& state) const override;
  Tensor forward_device(const ops::Context& ctx, const StepBatch& batch, ModelState& state) const override;
  Tensor forward_device(const ops::Context& ctx, const StepBatch& batch, ModelState& state,
                        Tensor& hidden) const override;
  Tensor mtp_forward_device(const ops::Context& ctx, const StepBatch& batch, const Tensor& hidden, ModelState& state,
                            int block, Tensor* mtp_hidden = nullptr) const override;

 private:
  class Worker;
  // fn(rank, its context, its batch, its model, its state) on every rank's thread; rank 0's output. The first error
  // (a rank that threw aborts the group, so the others stop waiting) is rethrown after every rank has returned.
  // With remote ranks every local rank first broadcasts `step` (its message; message_for's) to them.
  using RankFn = std::function<Tensor(int, const ops::Context&, const StepBatch&, const NemotronH&, ModelState&)>;
  Tensor run(const ops::Context& ctx, const StepBatch& batch, ModelState& state, const RankFn& fn,
             const std::vector<std::byte>& step = {}) const;
  // The remote ranks' message for one step (empty without remote ranks); takes state.remote_ops.
  std::vector<std::byte> message_for(RemoteStep step, ModelState& state) const;
  bool has_remote_ranks() const { return static_cast<int>(ranks_.size()) < size_; }
  // Whether rank r is on another GPU than rank 0 (it cannot read rank 0's device memory).
  bool other_gpu(int r) const;
  // Takes ranks[r] as rank r of size_ (checked), on `device`, joined to `group` / `device_group`; then config_,
  // and a worker thread for every rank but 0 (devices_[r] current on CUDA).
  void adopt(std::vector<NemotronH>& ranks, Device device, dist::HostCollectives* group,
             dist::DeviceGroup* device_group);
  // With device collectives: the watchdog that aborts them when the host group breaks or a step outlives `timeout`.
  void start_watchdog(std::chrono::milliseconds timeout);

  std::vector<std::unique_ptr<NemotronH>> ranks_;
  int size_ = 1;  // every rank, local or not
  std::vector<int> devices_;
  std::unique_ptr<dist::HostCollectives> group_;
  std::shared_ptr<dist::DeviceGroup> device_group_;  // shared: a complete type only where it is made
  std::vector<std::unique_ptr<Worker>> workers_;  // ranks 1..
  std::unique_ptr<dist::StepWatchdog> watchdog_;   // with device_group_ only
  ModelConfig config_;
  // The ModelState::layout_id of the caches the remote ranks hold (none yet: an id no state has).
  mutable uint64_t layout_sent_ = ~uint64_t{0};
};

}  // namespace chimera
