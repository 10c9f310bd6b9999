#include "models/tensor_parallel_model.h"

#include <algorithm>
#include <array>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <utility>

#include "backends/device_api.h"
#include "core/error.h"
#ifdef CHIMERA_HAVE_NCCL
#include "dist/device_group.h"
#else
namespace chimera::dist {
// A build without NCCL has no device collectives (device_group_ stays null); the type only completes the pointer.
class DeviceGroup {};
}  // namespace chimera::dist
#endif

namespace chimera {

// A rank's thread: runs one job at a time, handed over by post() and waited for by wait(). On CUDA it makes its
// rank's GPU current and its own stream first, so the per-thread CUDA state (cuBLASLt handles, upload scratch)
// lives once per rank rather than once per step, and its device memory comes from a pool of its own: the caching
// allocator hands a freed block out again at once, which is safe on the stream that freed it but not on another
// rank's stream of the same GPU.
class TensorParallelModel::Worker {
 public:
  Worker(Device device, int gpu) {
    thread_ = std::thread([this, device, gpu] { loop(device, gpu); });
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return ready_; });
    if (start_error_) {
      lock.unlock();
      thread_.join();
      std::rethrow_exception(start_error_);
    }
  }
  ~Worker() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  void* stream() const { return stream_.get(); }
  void post(std::function<void()> job) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      job_ = std::move(job);
      busy_ = true;
    }
    cv_.notify_all();
  }
  void wait() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return !busy_; });
  }

 private:
  void loop(Device device, int gpu) {
    try {
      if (device == Device::kCuda) {
        if (gpu >= 0) device::set_current_device(gpu);
        stream_ = device::Stream::create();
        pool_.emplace();
      }
    } catch (...) {
      start_error_ = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      ready_ = true;
    }
    cv_.notify_all();
    if (start_error_) return;
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || busy_; });
      if (stop_) return;
      std::function<void()> job = std::move(job_);
      lock.unlock();
      {
        std::optional<device::ScopedAllocPool> scope;
        if (pool_) scope.emplace(*pool_);
        job();  // catches its own errors
      }
      lock.lock();
      busy_ = false;
      cv_.notify_all();
    }
  }

  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::function<void()> job_;
  bool ready_ = false, busy_ = false, stop_ = false;
  std::exception_ptr start_error_;
  device::Stream stream_;
  std::optional<device::AllocPool> pool_;
};

TensorParallelModel::TensorParallelModel(std::vector<NemotronH> ranks, std::chrono::milliseconds timeout,
                                         std::vector<int> devices, dist::AllReduceStrategy allreduce)
    : devices_(std::move(devices)) {
  if (ranks.empty()) invalid_input("TensorParallelModel: no ranks");
  const int n = static_cast<int>(ranks.size());
  const Device device = ranks[0].device();
  if (!devices_.empty() && (device != Device::kCuda || static_cast<int>(devices_.size()) != n)) {
    invalid_input("TensorParallelModel: {} GPU(s) given for {} rank(s) on the {}", devices_.size(), n,
                  device == Device::kCuda ? "GPU" : "CPU");
  }
  size_ = n;
  group_ = std::make_unique<dist::HostGroup>(n, timeout);
  const bool distinct =
      n > 1 && !devices_.empty() && std::set<int>(devices_.begin(), devices_.end()).size() == devices_.size();
  if (distinct) {
#ifdef CHIMERA_HAVE_NCCL
    dist::AllReduceConfig config;
    config.strategy = allreduce;
    device_group_ = std::make_unique<dist::DeviceGroup>(devices_, config);
#else
    (void)allreduce;
    invalid_input("TensorParallelModel: ranks on {} GPUs need NCCL, and this build has none", n);
#endif
  }
  adopt(ranks, device, n > 1 ? group_.get() : nullptr, device_group_.get());
  start_watchdog(timeout);
}

TensorParallelModel::TensorParallelModel(std::vector<NemotronH> ranks, std::unique_ptr<dist::HostGroup> group,
                                         std::vector<int> devices, dist::AllReduceStrategy allreduce)
    : devices_(std::move(devices)) {
  if (!group) invalid_input("TensorParallelModel: no group");
  if (group->node_rank() != 0 || static_cast<int>(ranks.size()) != group->local_size()) {
    invalid_input("TensorParallelModel: {} models on node {} of a group of {} ranks over {} nodes (node 0's {})",
                  ranks.size(), group->node_rank(), group->size(), group->nnodes(), group->local_size());
  }
  size_ = group->size();
  const Device device = ranks.empty() ? Device::kCpu : ranks[0].device();
  if ((device == Device::kCuda) != !devices_.empty() ||
      (!devices_.empty() && static_cast<int>(devices_.size()) != group->local_size())) {
    invalid_input("TensorParallelModel: {} GPU(s) given for node 0's {} rank(s) on the {}", devices_.size(),
                  group->local_size(), device == Device::kCuda ? "GPU" : "CPU");
  }
  device_group_ = join_device_group(*group, devices_, allreduce);
  const std::chrono::milliseconds timeout = group->timeout();
  group_ = std::move(group);
  adopt(ranks, device, group_.get(), device_group_.get());
  start_watchdog(timeout);
}

void TensorParallelModel::start_watchdog(std::chrono::milliseconds timeout) {
#ifdef CHIMERA_HAVE_NCCL
  if (!device_group_) return;
  watchdog_ = std::make_unique<dist::StepWatchdog>(
      timeout, [this] { return group_->health(); }, [this](const std::string&) { device_group_->abort(); });
#else
  (void)timeout;
#endif
}

std::shared_ptr<dist::DeviceGroup> TensorParallelModel::join_device_group(dist::HostGroup& group,
                                                                          const std::vector<int>& devices,
                                                                          dist::AllReduceStrategy allreduce) {
  const int local = group.local_size(), size = group.size(), first = group.first_rank();
  if (!devices.empty() && static_cast<int>(devices.size()) != local) {
    invalid_input("TensorParallelModel: {} GPU(s) for the {} ranks of node {}", devices.size(), local,
                  group.node_rank());
  }
  // Every rank's device, by name ("cpu" or the GPU's UUID), in a fixed-size field, broadcast by each rank in turn;
  // then, when every rank has a GPU of its own, rank 0's NCCL unique id; then a barrier. Each local rank makes the
  // calls from its own thread (the group's contract); they all see the same bytes, so local rank 0's decide.
  constexpr size_t kName = 64, kId = 128;  // kId: NCCL_UNIQUE_ID_BYTES
  std::vector<std::string> names(static_cast<size_t>(size));
  std::array<std::byte, kId> id{};
  bool nccl = false;
  std::vector<std::exception_ptr> errors(static_cast<size_t>(local));
  const auto join = [&](int i) {
    const int rank = first + i;
    try {
      const std::string mine = devices.empty() ? "cpu" : device::device_uuid(devices[static_cast<size_t>(i)]);
      std::vector<std::string> seen(static_cast<size_t>(size));
      for (int root = 0; root < size; ++root) {
        std::array<std::byte, kName> field{};
        if (root == rank) std::memcpy(field.data(), mine.data(), std::min(mine.size(), kName - 1));
        group.broadcast(rank, field, root);
        seen[static_cast<size_t>(root)] = std::string(reinterpret_cast<const char*>(field.data()));
      }
      const std::set<std::string> distinct(seen.begin(), seen.end());
      const bool all_gpus = std::none_of(seen.begin(), seen.end(), [](const std::string& n) { return n == "cpu"; });
      const bool use_nccl = all_gpus && static_cast<int>(distinct.size()) == size;
      std::array<std::byte, kId> rank_id{};
#ifdef CHIMERA_HAVE_NCCL
      if (use_nccl) {
        static_assert(sizeof(ncclUniqueId) == kId);
        if (rank == 0) {
          ncclUniqueId u;
          dist::nccl_check(ncclGetUniqueId(&u), "ncclGetUniqueId");
          std::memcpy(rank_id.data(), &u, sizeof(u));
        }
        group.broadcast(rank, rank_id, 0);
      }
#endif
      group.barrier(rank);
      if (i == 0) {
        names = std::move(seen);
        id = rank_id;
        nccl = use_nccl;
      }
    } catch (const std::exception& e) {
      errors[static_cast<size_t>(i)] = std::current_exception();
      group.abort(rank, e.what());
    }
  };
  std::vector<std::thread> threads;
  for (int i = 1; i < local; ++i) threads.emplace_back(join, i);
  join(0);
  for (std::thread& t : threads) t.join();
  for (const std::exception_ptr& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  for (int r = 0; r < size; ++r) {
    if ((names[static_cast<size_t>(r)] == "cpu") != devices.empty()) {
      invalid_input(
          "tensor parallelism over nodes: rank {} is on {} but rank {} (node {}) on {}: every node needs "
          "the same --device",
          r, names[static_cast<size_t>(r)] == "cpu" ? "the CPU" : "a GPU", first, group.node_rank(),
          devices.empty() ? "the CPU" : "a GPU");
    }
  }
  if (!nccl) return nullptr;
#ifdef CHIMERA_HAVE_NCCL
  ncclUniqueId u;
  std::memcpy(&u, id.data(), sizeof(u));
  dist::AllReduceConfig config;
  config.strategy = allreduce;
  return std::make_unique<dist::DeviceGroup>(u, size, first, devices, config);
#else
  (void)allreduce;
  return nullptr;
#endif
}

void TensorParallelModel::adopt(std::vector<NemotronH>& ranks, Device device, dist::HostCollectives* group,
                                dist::DeviceGroup* device_group) {
  for (size_t i = 0; i < ranks.size(); ++i) {
    NemotronH& m = ranks[i];
    const int r = static_cast<int>(i);
    if (m.tensor_parallel().rank != r || m.tensor_parallel().size != size_) {
      invalid_input("TensorParallelModel: model {} was made as rank {} of {}, expected rank {} of {}", r,
                    m.tensor_parallel().rank, m.tensor_parallel().size, r, size_);
    }
    if (m.device() != device) invalid_input("TensorParallelModel: rank {} is on another device kind than rank 0", r);
    ranks_.push_back(std::make_unique<NemotronH>(std::move(m)));
    if (group) ranks_.back()->set_tensor_parallel_group(group, device_group);
  }
  for (size_t r = 1; r < ranks_.size(); ++r) {
    workers_.push_back(std::make_unique<Worker>(device, devices_.empty() ? -1 : devices_[r]));
  }
  config_ = ranks_[0]->local_config();
  config_.vocab_size = ranks_[0]->config().vocab_size;
}

TensorParallelModel::~TensorParallelModel() {
  if (has_remote_ranks()) {
    // The remote ranks' stop, from every local rank; a broken group has nothing to tell.
    const std::vector<std::byte> stop = encode_remote_step(RemoteStep{}, nullptr);
    const auto send = [&](size_t r) {
      try {
        broadcast_remote_step(*group_, static_cast<int>(r), stop);
      } catch (const Error&) {
      }
    };
    for (size_t r = 1; r < ranks_.size(); ++r) workers_[r - 1]->post([&, r] { send(r); });
    send(0);
    for (const auto& w : workers_) w->wait();
  }
  workers_.clear();  // the threads first: they use the models and the communicators
  watchdog_.reset();
  device_group_.reset();
}

std::vector<NemotronH> TensorParallelModel::make_ranks(int size, int first, int count, const ModelOptions& options,
                                                       const std::function<NemotronH(const ModelOptions&)>& make,
                                                       const std::vector<int>& devices) {
  if (!devices.empty() && static_cast<int>(devices.size()) != count) {
    invalid_input("TensorParallelModel: {} GPU(s) for {} rank(s)", devices.size(), count);
  }
  std::vector<NemotronH> ranks;
  for (int r = first; r < first + count; ++r) {
    ModelOptions o = options;
    o.tp = TensorParallel{r, size, options.tp.expert_parallel};
    const device::DeviceGuard on(devices.empty() ? -1 : devices[static_cast<size_t>(r - first)]);
    ranks.push_back(make(o));
  }
  return ranks;
}

std::vector<std::byte> TensorParallelModel::message_for(RemoteStep step, ModelState& state) const {
  if (!has_remote_ranks()) return {};
  // The other processes read the step's metadata and the MTP input rows from the host.
  step.batch.device_meta = nullptr;
  if (step.hidden && step.hidden.device() != Device::kCpu) step.hidden = device::to_host(step.hidden);
  step.ops = std::move(state.remote_ops);
  state.remote_ops.clear();
  // The caches' layout with the first step on them.
  const bool send_layout = state.layout_id != layout_sent_;
  std::vector<std::byte> message = encode_remote_step(step, send_layout ? &state : nullptr);
  layout_sent_ = state.layout_id;
  return message;
}

std::unique_ptr<TensorParallelModel> TensorParallelModel::create(
    int size, const ModelOptions& options, const std::function<NemotronH(const ModelOptions&)>& make,
    std::vector<int> devices, dist::AllReduceStrategy allreduce) {
  if (size < 1) invalid_input("--tensor-parallel-size {}: must be at least 1", size);
  if (!devices.empty() && static_cast<int>(devices.size()) != size) {
    invalid_input("TensorParallelModel: {} GPU(s) for {} rank(s)", devices.size(), size);
  }
  std::vector<NemotronH> ranks = make_ranks(size, 0, size, options, make, devices);
  return std::make_unique<TensorParallelModel>(std::move(ranks), std::chrono::seconds(60), std::move(devices),
                                               allreduce);
}

std::string TensorParallelModel::failure() const {
  if (size_ == 1 || !group_) return "";
  if (watchdog_) {
    if (std::string why = watchdog_->fired(); !why.empty()) return why;
  }
  return group_->health();
}

bool TensorParallelModel::other_gpu(int r) const {
  return !devices_.empty() && devices_[static_cast<size_t>(r)] != devices_[0];
}

Tensor TensorParallelModel::run(const ops::Context& ctx, const StepBatch& b, ModelState& state, const RankFn& fn,
                                const std::vector<std::byte>& step) const {
  const size_t n = ranks_.size();
  if (state.peers.size() + 1 != n) {
    runtime_error(
        "TensorParallelModel: the state has caches for {} rank(s), the model {} (a StateCache made with "
        "CacheSizes::tensor_parallel_size = {})",
        state.peers.size() + 1, n, n);
  }
  if (size_ == 1) return fn(0, ctx, b, *ranks_[0], state);
  const bool cuda = ctx.device == Device::kCuda;
  if (watchdog_) {
    if (const std::string why = watchdog_->fired(); !why.empty()) {
      runtime_error("TensorParallelModel: the ranks' device collectives were aborted ({}); load the model again", why);
    }
    watchdog_->arm();
  }
  // The ranks' streams start after what the engine queued on its own (metadata uploads, state copies).
  if (cuda) device::synchronize_stream(ctx.stream);
  // Ranks on another GPU read the step's metadata from the host (the device copy is on rank 0's GPU).
  std::optional<StepBatch> host_batch;
  for (size_t r = 1; r < n && !host_batch; ++r) {
    if (other_gpu(static_cast<int>(r)) && b.device_meta) {
      host_batch = b;
      host_batch->device_meta = nullptr;
    }
  }
  std::vector<Tensor> out(n);
  std::vector<std::exception_ptr> errors(n);
  const auto run_rank = [&](size_t r, const ops::Context& rc) {
    try {
      if (has_remote_ranks()) broadcast_remote_step(*group_, static_cast<int>(r), step);
      const StepBatch& rb = host_batch && other_gpu(static_cast<int>(r)) ? *host_batch : b;
      out[r] = fn(static_cast<int>(r), rc, rb, *ranks_[r], r == 0 ? state : state.peers[r - 1]);
      // Its caches are written before the next step; with device collectives rank 0 too, under the watchdog (a
      // kernel waiting for a dead peer is found here, not in the engine's next copy).
      if (cuda && (r > 0 || watchdog_)) device::synchronize_stream(rc.stream);
    } catch (const std::exception& e) {
      errors[r] = std::current_exception();
      group_->abort(static_cast<int>(r), e.what());
    }
  };
  for (size_t r = 1; r < n; ++r) {
    Worker& w = *workers_[r - 1];
    w.post([&, r, stream = w.stream()] {
      ops::Context rc = ctx;
      rc.stream = stream;
      rc.profiler = nullptr;  // the profiler times rank 0's stream
      run_rank(r, rc);
    });
  }
  {
    const device::DeviceGuard on(devices_.empty() ? -1 : devices_[0]);
    run_rank(0, ctx);
  }
  for (const auto& w : workers_) w->wait();
  if (watchdog_) {
    watchdog_->disarm();
    if (const std::string why = watchdog_->fired(); !why.empty()) {
      runtime_error("TensorParallelModel: {}; the ranks' device collectives were aborted", why);
    }
  }
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
  return run(
      ctx, b, state,
      [](int, const ops::Context& c, const StepBatch& rb, const NemotronH& m, ModelState& s) {
        return m.forward(c, rb, s);
      },
      message_for({RemoteCall::kForward, {}, false, {}, b}, state));
}

Tensor TensorParallelModel::forward_device(const ops::Context& ctx, const StepBatch& b, ModelState& state) const {
  return run(
      ctx, b, state,
      [](int, const ops::Context& c, const StepBatch& rb, const NemotronH& m, ModelState& s) {
        return m.forward_device(c, rb, s);
      },
      message_for({RemoteCall::kForwardDevice, {}, false, {}, b}, state));
}

Tensor TensorParallelModel::forward_device(const ops::Context& ctx, const StepBatch& b, ModelState& state,
                                           Tensor& hidden) const {
  std::vector<Tensor> hiddens(ranks_.size());
  Tensor logits = run(
      ctx, b, state,
      [&](int r, const ops::Context& c, const StepBatch& rb, const NemotronH& m, ModelState& s) {
        return m.forward_device(c, rb, s, hiddens[static_cast<size_t>(r)]);
      },
      message_for({RemoteCall::kForwardDeviceHidden, {}, false, {}, b}, state));
  hidden = hiddens[0];  // replicated: every rank's is the same
  return logits;
}

Tensor TensorParallelModel::mtp_forward_device(const ops::Context& ctx, const StepBatch& b, const Tensor& hidden,
                                               ModelState& state, int block, Tensor* mtp_hidden) const {
  std::vector<Tensor> outs(ranks_.size());
  Tensor logits = run(
      ctx, b, state,
      [&](int r, const ops::Context& c, const StepBatch& rb, const NemotronH& m, ModelState& s) {
        // The hidden rows are rank 0's (replicated values); a rank on another GPU takes a copy on its own.
        Tensor h = hidden;
        if (other_gpu(r)) {
          h = device::empty(Device::kCuda, hidden.dtype(), hidden.shape());
          device::copy(h, hidden);
        }
        return m.mtp_forward_device(c, rb, h, s, block, mtp_hidden ? &outs[static_cast<size_t>(r)] : nullptr);
      },
      message_for({RemoteCall::kMtpForward, {}, false, {}, b, hidden, block, mtp_hidden != nullptr}, state));
  if (mtp_hidden) *mtp_hidden = outs[0];
  return logits;
}

}  // namespace chimera
