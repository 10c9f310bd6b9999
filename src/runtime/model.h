// What the runtime needs of a model: its config (which also fixes the caches' geometry: StateCache and
// size_caches read the layer kinds and the Mamba / attention dimensions from it), where it runs, its
// activation dtype, and one forward step over a StepBatch against the caches. The engine, the scheduler and
// the caches see only this interface; NemotronH (src/models) implements it.
#pragma once

#include <vector>

#include "core/tensor.h"
#include "io/model_config.h"
#include "ops/ops.h"
#include "runtime/batch.h"
#include "runtime/state_cache.h"

namespace chimera {

class Model {
 public:
  virtual ~Model() = default;

  virtual const ModelConfig& config() const = 0;
  virtual Device device() const = 0;
  // The dtype of the activations, the conv state and the KV cache.
  virtual DType activation_dtype() const = 0;
  // One forward step on ctx.device (the model's device): host fp32 logits [batch.logit_rows.size(), vocab_size].
  virtual Tensor forward(const ops::Context& ctx, const StepBatch& batch, ModelState& state) const = 0;
  // The same step leaving the logits on ctx.device in the activation dtype, enqueued on ctx.stream without
  // waiting for it (capturable in a CUDA graph when batch.device_meta is set).
  virtual Tensor forward_device(const ops::Context& ctx, const StepBatch& batch, ModelState& state) const = 0;

  // Speculative decoding with the model's own multi-token-prediction head (runtime/engine.h). Blocks of the head
  // (0: none, and the two calls below are not made).
  virtual int mtp_blocks() const { return 0; }
  // Ranks that run each step (models/tensor_parallel_model.h): the engine's StateCache holds one copy of every
  // tensor per rank (CacheSizes::tensor_parallel_size), in ModelState::peers for ranks 1.., and config() is the
  // rank-local one (the cache's geometry) with the whole vocabulary.
  virtual int tensor_parallel_size() const { return 1; }
  // Why the model can run no more steps ("" while it can): a tensor-parallel group that broke (a rank failed, a
  // node went away, its device collectives were aborted). A step failing for another reason leaves it "".
  virtual std::string failure() const { return ""; }
  // CUDA ranks on several GPUs: rank r's GPU (CacheSizes::rank_devices); empty: every rank on the current one.
  virtual std::vector<int> tensor_parallel_devices() const { return {}; }
  // The ranks among them whose caches this process holds (the StateCache's copies); fewer when the others run in
  // other processes (TensorParallelModel over a dist::HostGroup of several nodes), and the cache then logs its state
  // operations for them (CacheSizes::log_state_ops).
  virtual int local_tensor_parallel_size() const { return tensor_parallel_size(); }
  // forward_device also leaving the backbone's output of every row (the final norm's, before lm_head) in `hidden`:
  // [num_tokens, hidden_size] on ctx.device in the activation dtype.
  virtual Tensor forward_device(const ops::Context& ctx, const StepBatch& batch, ModelState& state,
                                Tensor& hidden) const;
  // One step of MTP block `block` over the rows of `batch` (token_ids: each row's next token), `hidden` the
  // backbone's (or the previous block step's) output of those rows: the logits of batch.logit_rows on ctx.device
  // in the activation dtype, and the head's own output of every row in *mtp_hidden when set.
  virtual Tensor mtp_forward_device(const ops::Context& ctx, const StepBatch& batch, const Tensor& hidden,
                                    ModelState& state, int block, Tensor* mtp_hidden = nullptr) const;

 protected:
  Model() = default;
  Model(const Model&) = default;
  Model(Model&&) = default;
  Model& operator=(const Model&) = default;
  Model& operator=(Model&&) = default;
};

}  // namespace chimera
