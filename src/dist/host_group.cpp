#include "dist/host_group.h"

#include <cstring>

#include "core/error.h"

namespace chimera::dist {

HostGroup::HostGroup(int size, std::chrono::milliseconds timeout)
    : size_(size),
      timeout_(timeout),
      arrived_at_(static_cast<size_t>(size > 0 ? size : 0), 0),
      posts_(static_cast<size_t>(size > 0 ? size : 0)) {
  if (size < 1) invalid_input("dist::HostGroup: size {} (at least 1 rank)", size);
  if (timeout.count() <= 0) invalid_input("dist::HostGroup: timeout {} ms (must be positive)", timeout.count());
}

void HostGroup::check_rank(int rank, const char* op) const {
  if (rank < 0 || rank >= size_) runtime_error("dist::HostGroup::{}: rank {} of a group of {}", op, rank, size_);
}

void HostGroup::rendezvous(int rank, const char* op) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!broken_.empty()) runtime_error("dist::HostGroup::{} on rank {}: {}", op, rank, broken_);
  const uint64_t gen = generation_;
  arrived_at_[static_cast<size_t>(rank)] = gen + 1;
  if (++arrived_ == size_) {
    arrived_ = 0;
    ++generation_;
    cv_.notify_all();
    return;
  }
  const bool done = cv_.wait_for(lock, timeout_, [&] { return generation_ != gen || !broken_.empty(); });
  if (generation_ != gen) return;  // completed (possibly just as another rank broke the group: it arrived)
  if (!done) {
    std::string missing;
    for (int r = 0; r < size_; ++r) {
      if (arrived_at_[static_cast<size_t>(r)] != gen + 1)
        missing += fmt::format("{}{}", missing.empty() ? "" : ", ", r);
    }
    broken_ = fmt::format("rank(s) {} of {} did not arrive within {} ms ({})", missing, size_, timeout_.count(), op);
    cv_.notify_all();
  }
  runtime_error("dist::HostGroup::{} on rank {}: {}", op, rank, broken_);
}

void HostGroup::enter(int rank, const Post& post) {
  check_rank(rank, post.op);
  {
    std::lock_guard<std::mutex> lock(mu_);
    posts_[static_cast<size_t>(rank)] = post;
  }
  rendezvous(rank, post.op);
  // Every rank checks the same posts, so all of them fail together on a mismatch.
  for (int r = 0; r < size_; ++r) {
    const Post& p = posts_[static_cast<size_t>(r)];
    if (std::strcmp(p.op, post.op) != 0 || p.count != posts_[0].count || p.root != posts_[0].root) {
      runtime_error("dist::HostGroup: rank {} called {} (count {}, root {}) while rank 0 called {} (count {}, root {})",
                    r, p.op, p.count, p.root, posts_[0].op, posts_[0].count, posts_[0].root);
    }
  }
}

void HostGroup::all_reduce_sum(int rank, std::span<float> data) {
  enter(rank, {"all_reduce_sum", data.data(), data.size(), 0});
  // The sum in rank order into a private buffer: the others still read this rank's data until the second rendezvous.
  std::vector<float> sum(data.size(), 0.0f);
  for (int r = 0; r < size_; ++r) {
    const float* src = static_cast<const float*>(posts_[static_cast<size_t>(r)].data);
    for (size_t i = 0; i < sum.size(); ++i) sum[i] += src[i];
  }
  rendezvous(rank, "all_reduce_sum");
  std::memcpy(data.data(), sum.data(), sum.size() * sizeof(float));
}

void HostGroup::all_gather(int rank, std::span<const float> in, std::span<float> out) {
  if (out.size() != in.size() * static_cast<size_t>(size_)) {
    runtime_error("dist::HostGroup::all_gather on rank {}: out has {} elements, expected {} x {}", rank, out.size(),
                  size_, in.size());
  }
  enter(rank, {"all_gather", in.data(), in.size(), 0});
  for (int r = 0; r < size_; ++r) {
    const float* src = static_cast<const float*>(posts_[static_cast<size_t>(r)].data);
    if (in.size() > 0) std::memcpy(out.data() + static_cast<size_t>(r) * in.size(), src, in.size() * sizeof(float));
  }
  rendezvous(rank, "all_gather");
}

void HostGroup::broadcast(int rank, std::span<std::byte> data, int root) {
  check_rank(root, "broadcast");
  enter(rank, {"broadcast", data.data(), data.size(), root});
  if (rank != root && !data.empty()) std::memcpy(data.data(), posts_[static_cast<size_t>(root)].data, data.size());
  rendezvous(rank, "broadcast");
}

void HostGroup::barrier(int rank) {
  enter(rank, {"barrier", nullptr, 0, 0});
  // Phase 1 too, as every collective: a rank leaving after phase 0 could post its next call while another still
  // checks this one's posts.
  rendezvous(rank, "barrier");
}

std::string HostGroup::health() {
  std::lock_guard<std::mutex> lock(mu_);
  return broken_;
}

void HostGroup::abort(int rank, const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (broken_.empty()) broken_ = fmt::format("rank {} aborted: {}", rank, why);
  cv_.notify_all();
}

}  // namespace chimera::dist
