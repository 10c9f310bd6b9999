// Per-op time breakdown of one engine step (`chimera bench --profile`).
//
// The ops dispatcher (ops.cpp, Check::dispatch) opens a ProfileScope around every backend call when
// ops::Context::profiler is set. The profiler is passive until armed: begin_step() .. end_step() brackets one
// step, and only the ops dispatched in between are recorded. Each op gets
//   * an NVTX range named after the op (Nsight Systems shows them; the step is a range around them), and
//   * a timing pair: CUDA events recorded on the op's stream (from a pool, read once after the step's single
//     sync), or steady_clock on the CPU.
// So an engine built with a profiling context runs at full speed until a step is armed. A CUDA op's time is
// the stream time between its two events: its kernels plus any gaps between them (host uploads, launches).
//
// What a StepProfile says:
//   wall_ms  host time from begin_step to end_step, after a device sync (scheduling, batch building, the
//            logits copy and sampling included)
//   span_ms  first op's start to last op's end (device clock on CUDA)
//   ops_ms   the sum of the ops' times; span - ops = gaps between ops (launch / host overhead inside the
//            forward), wall - span = host work before the first op and after the last
// Profiling costs two event records per op (host time on CUDA), so a profiled step is slower
// than an unprofiled one when the host is the bottleneck; compare op times, not the wall time, with the bench.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backends/profiler_events.h"
#include "core/tensor.h"

namespace chimera {

struct OpStat {
  std::string op;  // the ops:: entry point ("linear", "moe_experts", ...)
  int64_t calls = 0;
  double total_ms = 0;
};

struct StepProfile {
  std::string name;
  double wall_ms = 0;
  double span_ms = 0;
  double ops_ms = 0;
  int64_t calls = 0;
  // Ops dispatched while the stream was being captured into a CUDA graph: counted, not timed.
  int64_t untimed_calls = 0;
  std::vector<OpStat> ops;  // every op kind that ran, largest total first
};

class Profiler {
 public:
  explicit Profiler(Device device);
  ~Profiler();
  Profiler(const Profiler&) = delete;
  Profiler& operator=(const Profiler&) = delete;

  // Arms the profiler for one step: waits for the device (earlier work stays out of the step), starts the
  // wall clock and an NVTX range named `name`. Ops on any stream are recorded until end_step().
  void begin_step(std::string name);
  // Disarms, waits for the step's work (one device sync), reads the timings and aggregates them per op.
  StepProfile end_step();
  bool active() const { return active_; }

  // Called by ProfileScope (the ops dispatcher) around each op while active. Ops may nest; each is timed.
  void op_begin(const char* op, void* stream);
  void op_end();

 private:
  using Clock = std::chrono::steady_clock;
  struct Record {
    const char* op;  // string literal from the dispatcher
    void* stream;
    int begin_event = -1;  // CUDA: EventPool indices (-1: untimed, recorded during graph capture)
    int end_event = -1;
    Clock::time_point t0, t1;  // CPU
    int depth = 0;             // nesting depth: only depth 0 counts towards ops_ms
  };

  Device device_;
  bool active_ = false;
  std::string step_name_;
  Clock::time_point step_t0_;
  std::vector<Record> records_;
  std::vector<size_t> open_;  // indices of records whose op has not ended
  std::unique_ptr<device::EventPool> events_;
};

// The bracket the ops dispatcher puts around each backend call: nothing when `p` is null or not armed.
class ProfileScope {
 public:
  ProfileScope(Profiler* p, const char* op, void* stream) : p_(p != nullptr && p->active() ? p : nullptr) {
    if (p_ != nullptr) p_->op_begin(op, stream);
  }
  ~ProfileScope() {
    if (p_ == nullptr) return;
    try {
      p_->op_end();
    } catch (...) {  // a failed event record leaves the op untimed; never throw from a destructor
    }
  }
  ProfileScope(const ProfileScope&) = delete;
  ProfileScope& operator=(const ProfileScope&) = delete;

 private:
  Profiler* p_;
};

// The step as a table: one row per op kind (calls, total ms, % of the step's wall time), then the ops' sum,
// the span and the wall time with the gaps between them. Every line starts with `indent`.
std::string format_profile(const StepProfile& p, const std::string& indent = "  ");

}  // namespace chimera
