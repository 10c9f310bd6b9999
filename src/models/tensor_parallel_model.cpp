#include "models/tensor_parallel_model.h"

#include <exception>
#include <thread>
#include <utility>

#include "core/error.h"

namespace chimera {

TensorParallelModel::TensorParallelModel(std::vector<NemotronH> ranks, std::chrono::milliseconds timeout) {
  if (ranks.empty()) invalid_input("TensorParallelModel: no ranks");
  const int n = static_cast<int>(ranks.size());
  group_ = std::make_unique<dist::HostGroup>(n, timeout);
  for (int r = 0; r < n; ++r) {
    NemotronH& m = ranks[static_cast<size_t>(r)];
    if (m.tensor_parallel().rank != r || m.tensor_parallel().size != n) {
      invalid_input("TensorParallelModel: model {} was made as rank {} of {}, expected rank {} of {}", r,
                    m.tensor_parallel().rank, m.tensor_parallel().size, r, n);
    }
    ranks_.push_back(std::make_unique<NemotronH>(std::move(m)));
    if (n > 1) ranks_.back()->set_tensor_parallel_group(group_.get());
  }
  config_ = ranks_[0]->local_config();
  config_.vocab_size = ranks_[0]->config().vocab_size;
}

std::unique_ptr<TensorParallelModel> TensorParallelModel::create(
    int size, const ModelOptions& options, const std::function<NemotronH(const ModelOptions&)>& make) {
  if (size < 1) invalid_input("--tensor-parallel-size {}: must be at least 1", size);
  std::vector<NemotronH> ranks;
  for (int r = 0; r < size; ++r) {
    ModelOptions o = options;
    o.tp = {r, size};
    ranks.push_back(make(o));
  }
  return std::make_unique<TensorParallelModel>(std::move(ranks));
}

Tensor TensorParallelModel::run(ModelState& state, const RankFn& fn) const {
  const size_t n = ranks_.size();
  if (state.peers.size() + 1 != n) {
    runtime_error(
        "TensorParallelModel: the state has caches for {} rank(s), the model {} (a StateCache made with "
        "CacheSizes::tensor_parallel_size = {})",
        state.peers.size() + 1, n, n);
  }
  if (n == 1) return fn(0, *ranks_[0], state);
  std::vector<Tensor> out(n);
  std::vector<std::exception_ptr> errors(n);
  std::vector<std::thread> threads;
  for (size_t r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        out[r] = fn(static_cast<int>(r), *ranks_[r], r == 0 ? state : state.peers[r - 1]);
      } catch (const std::exception& e) {
        errors[r] = std::current_exception();
        group_->abort(static_cast<int>(r), e.what());
      }
    });
  }
  for (std::thread& t : threads) t.join();
  // The error of the rank that failed first is the one without "aborted" in it; any error otherwise.
  for (size_t r = 0; r < n; ++r) {
    if (!errors[r]) continue;
    try {
      std::rethrow_exception(errors[r]);
    } catch (const std::exception& e) {
      if (std::string(e.what()).find(" aborted: ") == std::string::npos) throw;
    }
  }
  for (size_t r = 0; r < n; ++r) {
    if (errors[r]) std::rethrow_exception(errors[r]);
  }
  return out[0];
}

Tensor TensorParallelModel::forward(const ops::Context& ctx, const StepBatch& b, ModelState& state) const {
  return run(state, [&](int, const NemotronH& m, ModelState& s) { return m.forward(ctx, b, s); });
}

Tensor TensorParallelModel::forward_device(const ops::Context& ctx, const StepBatch& b, ModelState& state) const {
  return run(state, [&](int, const NemotronH& m, ModelState& s) { return m.forward_device(ctx, b, s); });
}

Tensor TensorParallelModel::forward_device(const ops::Context& ctx, const StepBatch& b, ModelState& state,
                                           Tensor& hidden) const {
  std::vector<Tensor> hiddens(ranks_.size());
  Tensor logits = run(state, [&](int r, const NemotronH& m, ModelState& s) {
    return m.forward_device(ctx, b, s, hiddens[static_cast<size_t>(r)]);
  });
  hidden = hiddens[0];  // replicated: every rank's is the same
  return logits;
}

Tensor TensorParallelModel::mtp_forward_device(const ops::Context& ctx, const StepBatch& b, const Tensor& hidden,
                                               ModelState& state, int block, Tensor* mtp_hidden) const {
  std::vector<Tensor> outs(ranks_.size());
  Tensor logits = run(state, [&](int r, const NemotronH& m, ModelState& s) {
    return m.mtp_forward_device(ctx, b, hidden, s, block, mtp_hidden ? &outs[static_cast<size_t>(r)] : nullptr);
  });
  if (mtp_hidden) *mtp_hidden = outs[0];
  return logits;
}

}  // namespace chimera
