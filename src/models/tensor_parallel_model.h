// N tensor-parallel ranks of a Nemotron-H model behind the runtime's Model interface, so one Engine drives them
// (docs/architecture.md "Tensor parallelism"): each step runs every rank's forward on its own thread, in lockstep
// over one dist::HostGroup, rank r against its caches (the engine's ModelState for rank 0, state.peers[r - 1]
// for the others: the engine's StateCache is made with CacheSizes::tensor_parallel_size), and returns rank 0's
// logits, which are whole. CPU only in phase 1 (the ranks' models refuse CUDA).
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <vector>

#include "dist/host_group.h"
#include "models/nemotron_h.h"
#include "runtime/model.h"

namespace chimera {

class TensorParallelModel : public Model {
 public:
  // ranks[r]: the model made with ModelOptions::tp = {r, ranks.size()}. A rank whose step does not reach a
  // collective within `timeout` ends every rank's step with an error naming it.
  explicit TensorParallelModel(std::vector<NemotronH> ranks,
                               std::chrono::milliseconds timeout = std::chrono::seconds(60));
  // Loads (or makes, synthetic) every rank of `config`: make(options) with options.tp set per rank.
  static std::unique_ptr<TensorParallelModel> create(int size, const ModelOptions& options,
                                                     const std::function<NemotronH(const ModelOptions&)>& make);

  // Rank 0's local config (the caches' geometry) with the whole vocabulary (the logits' width).
  const ModelConfig& config() const override { return config_; }
  // The whole model's config.
  const ModelConfig& model_config() const { return ranks_[0]->config(); }
  Device device() const override { return ranks_[0]->device(); }
  DType activation_dtype() const override { return ranks_[0]->activation_dtype(); }
  int mtp_blocks() const override { return ranks_[0]->mtp_blocks(); }
  int tensor_parallel_size() const override { return static_cast<int>(ranks_.size()); }
  const NemotronH& rank(int r) const { return *ranks_[static_cast<size_t>(r)]; }

  Tensor forward(const ops::Context& ctx, const StepBatch& batch, ModelState& state) const override;
  Tensor forward_device(const ops::Context& ctx, const StepBatch& batch, ModelState& state) const override;
  Tensor forward_device(const ops::Context& ctx, const StepBatch& batch, ModelState& state,
                        Tensor& hidden) const override;
  Tensor mtp_forward_device(const ops::Context& ctx, const StepBatch& batch, const Tensor& hidden, ModelState& state,
                            int block, Tensor* mtp_hidden = nullptr) const override;

 private:
  // fn(rank, its model, its state, its output) on one thread per rank; rank 0's output. The first error (a rank
  // that threw aborts the group, so the others stop waiting) is rethrown after every thread has returned.
  using RankFn = std::function<Tensor(int, const NemotronH&, ModelState&)>;
  Tensor run(ModelState& state, const RankFn& fn) const;

  std::vector<std::unique_ptr<NemotronH>> ranks_;
  std::unique_ptr<dist::HostGroup> group_;
  ModelConfig config_;
};

}  // namespace chimera
