// dist::StepWatchdog (src/dist/step_watchdog.h): it aborts an armed step when the group reports a failure or the
// step outlives its timeout, once, and never while disarmed or healthy. The abort here releases a waiting thread,
// as ncclCommAbort releases a rank blocked behind an NCCL kernel.
#include "dist/step_watchdog.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>

namespace chimera::dist {
namespace {

using std::chrono::milliseconds;

// A "stream" that only the abort ends: wait() blocks until release().
struct Blocked {
  std::mutex mu;
  std::condition_variable cv;
  bool released = false;
  std::atomic<int> aborts{0};
  std::string why;
  void release(const std::string& w) {
    std::lock_guard<std::mutex> lock(mu);
    why = w;
    released = true;
    ++aborts;
    cv.notify_all();
  }
  bool wait(milliseconds limit) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, limit, [&] { return released; });
  }
};

TEST(StepWatchdog, AStepThatOutlivesTheTimeoutIsAborted) {
  Blocked b;
  StepWatchdog w(milliseconds(200), [] { return std::string(); }, [&](const std::string& why) { b.release(why); },
                 milliseconds(10));
  const auto t0 = std::chrono::steady_clock::now();
  w.arm();
  ASSERT_TRUE(b.wait(milliseconds(5000)));
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_GE(s, 0.19);
  EXPECT_LT(s, 3.0);
  EXPECT_EQ(b.why, "the step did not finish within 200 ms");
  EXPECT_EQ(w.fired(), b.why);
  // Fired stays fired; the abort ran once.
  w.disarm();
  w.arm();
  std::this_thread::sleep_for(milliseconds(300));
  EXPECT_EQ(b.aborts.load(), 1);
}

TEST(StepWatchdog, ABrokenGroupAbortsAtOnceWithItsReason) {
  Blocked b;
  std::atomic<bool> broken{false};
  StepWatchdog w(
      milliseconds(60000), [&] { return broken ? std::string("node 1 (rank 1) closed its connection") : ""; },
      [&](const std::string& why) { b.release(why); }, milliseconds(10));
  w.arm();
  std::this_thread::sleep_for(milliseconds(100));
  EXPECT_EQ(w.fired(), "");
  broken = true;
  ASSERT_TRUE(b.wait(milliseconds(3000)));
  EXPECT_EQ(b.why, "node 1 (rank 1) closed its connection");
}

TEST(StepWatchdog, NeverFiresWhileDisarmedOrWithinTheTimeout) {
  std::atomic<int> aborts{0};
  std::atomic<bool> broken{false};
  StepWatchdog w(
      milliseconds(1500), [&] { return broken ? std::string("broken") : ""; }, [&](const std::string&) { ++aborts; },
      milliseconds(10));
  // Steps well inside the timeout (50x: a loaded CI machine's late wake-ups stay far from it).
  for (int i = 0; i < 10; ++i) {
    w.arm();
    std::this_thread::sleep_for(milliseconds(30));
    w.disarm();
  }
  broken = true;  // a failure between steps is the next step's, not a fire now
  std::this_thread::sleep_for(milliseconds(300));
  EXPECT_EQ(aborts.load(), 0);
  EXPECT_EQ(w.fired(), "");
}

}  // namespace
}  // namespace chimera::dist
