// A bound on a tensor-parallel step whose ranks wait inside device collectives (docs/architecture.md "Tensor
// parallelism"). An NCCL kernel waiting for a peer that died waits forever, and so does every rank thread
// synchronising its stream behind it: nothing in the step can notice. The watchdog's own thread does, while a step
// is armed: every `poll` it asks check() (the host group's health: a rank that failed, a node whose connection
// closed) and watches the clock; when check() reports or the step outlives `timeout` it calls abort(why) once
// (TensorParallelModel: ncclCommAbort on its ranks, which ends their waiting kernels) and stays fired, so the step
// and every later one fail with that reason instead of hanging. Plain C++: built with and without CUDA / NCCL.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace chimera::dist {

class StepWatchdog {
 public:
  StepWatchdog(std::chrono::milliseconds timeout, std::function<std::string()> check,
               std::function<void(const std::string&)> abort,
               std::chrono::milliseconds poll = std::chrono::milliseconds(50));
  ~StepWatchdog();
  StepWatchdog(const StepWatchdog&) = delete;
  StepWatchdog& operator=(const StepWatchdog&) = delete;

  void arm();     // a step starts: its deadline is now + timeout
  void disarm();  // it ended
  // Why the watchdog fired, "" while it has not.
  std::string fired() const;

 private:
  void loop();

  const std::chrono::milliseconds timeout_, poll_;
  const std::function<std::string()> check_;
  const std::function<void(const std::string&)> abort_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool armed_ = false, stop_ = false;
  std::chrono::steady_clock::time_point deadline_{};
  std::string fired_;
  std::thread thread_;
};

}  // namespace chimera::dist
