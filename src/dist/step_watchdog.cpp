#include "dist/step_watchdog.h"

#include <fmt/core.h>

namespace chimera::dist {

StepWatchdog::StepWatchdog(std::chrono::milliseconds timeout, std::function<std::string()> check,
                           std::function<void(const std::string&)> abort, std::chrono::milliseconds poll)
    : timeout_(timeout), poll_(poll), check_(std::move(check)), abort_(std::move(abort)) {
  thread_ = std::thread([this] { loop(); });
}

StepWatchdog::~StepWatchdog() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void StepWatchdog::arm() {
  std::lock_guard<std::mutex> lock(mu_);
  armed_ = true;
  deadline_ = std::chrono::steady_clock::now() + timeout_;
  cv_.notify_all();
}

void StepWatchdog::disarm() {
  std::lock_guard<std::mutex> lock(mu_);
  armed_ = false;
}

std::string StepWatchdog::fired() const {
  std::lock_guard<std::mutex> lock(mu_);
  return fired_;
}

void StepWatchdog::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_ && fired_.empty()) {
    cv_.wait(lock, [&] { return stop_ || armed_; });
    while (!stop_ && armed_) {
      cv_.wait_for(lock, poll_, [&] { return stop_ || !armed_; });
      if (stop_ || !armed_) break;
      const auto deadline = deadline_;
      // check() may block briefly (a poll of sockets) or take a group's lock: not under ours.
      lock.unlock();
      std::string why = check_();
      if (why.empty() && std::chrono::steady_clock::now() > deadline) {
        why = fmt::format("the step did not finish within {} ms", timeout_.count());
      }
      lock.lock();
      if (why.empty() || !armed_) continue;
      fired_ = why;
      lock.unlock();
      abort_(why);
      return;
    }
  }
}

}  // namespace chimera::dist
