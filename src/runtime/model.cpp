#include "runtime/model.h"

#include "core/error.h"

namespace chimera {

Tensor Model::forward_device(const ops::Context&, const StepBatch&, ModelState&, Tensor&) const {
  runtime_error("this model has no multi-token-prediction head: it cannot return its hidden states");
}

Tensor Model::mtp_forward_device(const ops::Context&, const StepBatch&, const Tensor&, ModelState&, int,
                                 Tensor*) const {
  runtime_error("this model has no multi-token-prediction head");
}

}  // namespace chimera
