// What the runtime needs of a model: its config (which also fixes the caches' geometry: StateCache and
// size_caches read the layer kinds and the Mamba / attention dimensions from it), where it runs, its
// activation dtype, and one forward step over a StepBatch against the caches. The engine, the scheduler and
// the caches see only this interface; NemotronH (src/models) implements it.
#pragma once

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

 protected:
  Model() = default;
  Model(const Model&) = default;
  Model(Model&&) = default;
  Model& operator=(const Model&) = default;
  Model& operator=(Model&&) = default;
};

}  // namespace chimera
