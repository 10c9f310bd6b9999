#include "models/remote_ranks.h"

#include <cstring>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>

#include "backends/device_api.h"
#include "core/error.h"
#include "dist/step_watchdog.h"
#include "models/tensor_parallel_model.h"
#ifdef CHIMERA_HAVE_NCCL
#include "dist/device_group.h"
#endif

namespace chimera {
namespace {

class Writer {
 public:
  template <typename T>
  void put(const T& v) {
    static_assert(std::is_trivially_copyable_v<T>);
    const auto* p = reinterpret_cast<const std::byte*>(&v);
    out_.insert(out_.end(), p, p + sizeof(T));
  }
  template <typename T>
  void put_vector(const std::vector<T>& v) {
    put<uint64_t>(v.size());
    const auto* p = reinterpret_cast<const std::byte*>(v.data());
    out_.insert(out_.end(), p, p + v.size() * sizeof(T));
  }
  // A tensor's dtype and shape, and its bytes when `with_data` (host tensors only).
  void put_tensor(const Tensor& t, bool with_data) {
    put<uint8_t>(t ? 1 : 0);
    if (!t) return;
    put(t.dtype());
    put_vector(t.shape());
    if (!with_data) return;
    CHIMERA_CHECK(t.device() == Device::kCpu, "a remote step's tensor on the host, got {}", t.describe());
    const auto* p = static_cast<const std::byte*>(t.data());
    out_.insert(out_.end(), p, p + t.nbytes());
  }
  std::vector<std::byte> take() { return std::move(out_); }

 private:
  std::vector<std::byte> out_;
};

class Reader {
 public:
  explicit Reader(std::span<const std::byte> in) : in_(in) {}
  template <typename T>
  T get() {
    T v;
    std::memcpy(&v, take(sizeof(T)), sizeof(T));
    return v;
  }
  template <typename T>
  std::vector<T> get_vector() {
    const auto n = get<uint64_t>();
    if (n > in_.size() / sizeof(T)) runtime_error("TensorParallelModel: a remote step message is cut short");
    std::vector<T> v(n);
    if (n > 0) std::memcpy(v.data(), take(n * sizeof(T)), n * sizeof(T));
    return v;
  }
  Tensor get_tensor(bool with_data) {
    if (get<uint8_t>() == 0) return {};
    const auto dtype = get<DType>();
    Tensor t = Tensor::zeros(dtype, get_vector<int64_t>());
    if (with_data && t.nbytes() > 0) std::memcpy(t.data(), take(t.nbytes()), t.nbytes());
    return t;
  }
  bool done() const { return at_ == in_.size(); }

 private:
  const std::byte* take(size_t n) {
    if (in_.size() - at_ < n) runtime_error("TensorParallelModel: a remote step message is cut short");
    const std::byte* p = in_.data() + at_;
    at_ += n;
    return p;
  }
  std::span<const std::byte> in_;
  size_t at_ = 0;
};

}  // namespace

std::vector<std::byte> encode_remote_step(const RemoteStep& step, const ModelState* layout) {
  Writer w;
  w.put(step.call);
  w.put_vector(step.ops);
  w.put<uint8_t>(layout != nullptr);
  if (layout != nullptr) {
    w.put<uint64_t>(layout->conv.size());
    for (size_t i = 0; i < layout->conv.size(); ++i) {
      w.put_tensor(layout->conv[i], false);
      w.put_tensor(layout->ssm[i], false);
      w.put_tensor(layout->kv[i].k, false);
      w.put(layout->kv[i].k_scale);
      w.put(layout->kv[i].v_scale);
    }
  }
  const StepBatch& b = step.batch;
  CHIMERA_CHECK(b.device_meta == nullptr, "a remote step with device metadata");
  w.put_vector(b.token_ids);
  w.put_vector(b.cu_seqlens);
  w.put_vector(b.context_lens);
  w.put_vector(b.state_slots);
  w.put_tensor(b.block_tables, true);
  w.put(b.num_prefill_seqs);
  w.put(b.num_spec_seqs);
  w.put_vector(b.spec_slots);
  w.put_vector(b.mamba_checkpoints);
  w.put_vector(b.logit_rows);
  w.put_tensor(step.hidden, true);
  w.put(step.block);
  w.put<uint8_t>(step.want_mtp_hidden);
  return w.take();
}

RemoteStep decode_remote_step(std::span<const std::byte> bytes) {
  Reader r(bytes);
  RemoteStep step;
  step.call = r.get<RemoteCall>();
  step.ops = r.get_vector<StateOp>();
  step.has_layout = r.get<uint8_t>() != 0;
  if (step.has_layout) {
    const auto n = r.get<uint64_t>();
    if (n > bytes.size()) runtime_error("TensorParallelModel: a remote step message is cut short");
    step.layout.conv.resize(n);
    step.layout.ssm.resize(n);
    step.layout.kv.resize(n);
    for (size_t i = 0; i < n; ++i) {
      step.layout.conv[i] = r.get_tensor(false);
      step.layout.ssm[i] = r.get_tensor(false);
      const Tensor k = r.get_tensor(false);
      if (k) step.layout.kv[i] = ops::KvCacheView{k, Tensor::zeros(k.dtype(), k.shape())};
      step.layout.kv[i].k_scale = r.get<float>();
      step.layout.kv[i].v_scale = r.get<float>();
    }
  }
  StepBatch& b = step.batch;
  b.token_ids = r.get_vector<int32_t>();
  b.cu_seqlens = r.get_vector<int32_t>();
  b.context_lens = r.get_vector<int32_t>();
  b.state_slots = r.get_vector<int32_t>();
  b.block_tables = r.get_tensor(true);
  b.num_prefill_seqs = r.get<int32_t>();
  b.num_spec_seqs = r.get<int32_t>();
  b.spec_slots = r.get_vector<int32_t>();
  b.mamba_checkpoints = r.get_vector<StepBatch::MambaCheckpoint>();
  b.logit_rows = r.get_vector<int32_t>();
  step.hidden = r.get_tensor(true);
  step.block = r.get<int32_t>();
  step.want_mtp_hidden = r.get<uint8_t>() != 0;
  if (!r.done()) runtime_error("TensorParallelModel: a remote step message has {} bytes too many", bytes.size());
  return step;
}

std::vector<std::byte> broadcast_remote_step(dist::HostCollectives& group, int rank, std::vector<std::byte> message) {
  uint64_t n = message.size();
  group.broadcast(rank, std::as_writable_bytes(std::span<uint64_t>(&n, 1)), 0);
  message.resize(n);
  group.broadcast(rank, message, 0);
  return message;
}

namespace {

// broadcast_remote_step's other side, off node 0: the next step's length is awaited without a deadline (a server
// may idle for hours between requests; HostGroup::wait_broadcast still notices node 0 going away), its bytes then
// as any collective.
std::vector<std::byte> receive_remote_step(dist::HostGroup& group, int rank) {
  uint64_t n = 0;
  group.wait_broadcast(rank, std::as_writable_bytes(std::span<uint64_t>(&n, 1)));
  std::vector<std::byte> message(n);
  group.broadcast(rank, message, 0);
  return message;
}

// Node 0's layout (host zeros) as this rank's caches on `device`.
ModelState caches_like(const ModelState& layout, Device device) {
  if (device == Device::kCpu) return layout;
  const auto zeros = [&](const Tensor& t) {
    if (!t) return Tensor();
    Tensor z = device::empty(device, t.dtype(), t.shape());
    device::zero(z);
    return z;
  };
  ModelState s;
  for (size_t i = 0; i < layout.conv.size(); ++i) {
    s.conv.push_back(zeros(layout.conv[i]));
    s.ssm.push_back(zeros(layout.ssm[i]));
    ops::KvCacheView kv{zeros(layout.kv[i].k), zeros(layout.kv[i].v)};
    kv.k_scale = layout.kv[i].k_scale;
    kv.v_scale = layout.kv[i].v_scale;
    s.kv.push_back(kv);
  }
  return s;
}

}  // namespace

void run_remote_ranks(dist::HostGroup& group, std::vector<NemotronH>& ranks, const ops::Context& ctx,
                      const std::vector<int>& devices, dist::AllReduceStrategy allreduce) {
  if (static_cast<int>(ranks.size()) != group.local_size()) {
    invalid_input("run_remote_ranks: {} models for the {} ranks of node {}", ranks.size(), group.local_size(),
                  group.node_rank());
  }
  const bool cuda = ctx.device == Device::kCuda;
  if (cuda && devices.size() != ranks.size()) {
    invalid_input("run_remote_ranks: {} GPU(s) for the {} ranks of node {}", devices.size(), ranks.size(),
                  group.node_rank());
  }
  const std::shared_ptr<dist::DeviceGroup> device_group =
      TensorParallelModel::join_device_group(group, cuda ? devices : std::vector<int>{}, allreduce);
  for (NemotronH& m : ranks) m.set_tensor_parallel_group(&group, device_group.get());
  std::vector<std::exception_ptr> errors(ranks.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < ranks.size(); ++i) {
    threads.emplace_back([&, i] {
      const int rank = group.first_rank() + static_cast<int>(i);
      const NemotronH& m = ranks[i];
      try {
        // CUDA: the rank's GPU, and its own stream and memory pool (as TensorParallelModel's rank threads).
        ops::Context rc = ctx;
        device::Stream stream;
        std::optional<device::AllocPool> pool;
        std::optional<device::ScopedAllocPool> scope;
        if (cuda) {
          device::set_current_device(devices[i]);
          stream = device::Stream::create();
          rc.stream = stream.get();
          pool.emplace();
          scope.emplace(*pool);
        }
        // With device collectives each step runs under a watchdog, as node 0's (models/tensor_parallel_model.h).
        std::unique_ptr<dist::StepWatchdog> watchdog;
#ifdef CHIMERA_HAVE_NCCL
        if (device_group) {
          watchdog = std::make_unique<dist::StepWatchdog>(
              group.timeout(), [&] { return group.health(); }, [&](const std::string&) { device_group->abort(); });
        }
#endif
        ModelState state;
        bool have_state = false;
        for (;;) {
          const std::vector<std::byte> bytes = receive_remote_step(group, rank);
          if (watchdog) watchdog->arm();
          RemoteStep step = decode_remote_step(bytes);
          if (step.call == RemoteCall::kStop) return;
          if (step.has_layout) {
            state = caches_like(step.layout, ctx.device);
            have_state = true;
          }
          if (!have_state) runtime_error("TensorParallelModel: rank {} got a step before the caches' layout", rank);
          for (const StateOp& op : step.ops) apply_state_op(op, state);
          const StepBatch& b = step.batch;
          if (cuda && step.hidden) step.hidden = device::to_device(step.hidden, Device::kCuda);
          Tensor out;
          switch (step.call) {
            case RemoteCall::kForward: m.forward(rc, b, state); break;
            case RemoteCall::kForwardDevice: m.forward_device(rc, b, state); break;
            case RemoteCall::kForwardDeviceHidden: m.forward_device(rc, b, state, out); break;
            case RemoteCall::kMtpForward:
              m.mtp_forward_device(rc, b, step.hidden, state, step.block, step.want_mtp_hidden ? &out : nullptr);
              break;
            case RemoteCall::kStop: break;
          }
          // The step's caches are written (and its temporaries free) before the next one.
          if (cuda) device::synchronize_stream(rc.stream);
          if (watchdog) {
            watchdog->disarm();
            if (const std::string why = watchdog->fired(); !why.empty()) {
              runtime_error("rank {}: {}; the device collectives were aborted", rank, why);
            }
          }
        }
      } catch (const std::exception& e) {
        errors[i] = std::current_exception();
        group.abort(rank, e.what());
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (const std::exception_ptr& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

}  // namespace chimera
