#include "runtime/profiler.h"

#include <algorithm>
#include <map>

#include <fmt/core.h>

#include "backends/device_api.h"
#include "core/error.h"

namespace chimera {

Profiler::Profiler(Device device) : device_(device) {
  if (device_ == Device::kCuda) events_ = std::make_unique<device::EventPool>();
}

Profiler::~Profiler() = default;

void Profiler::begin_step(std::string name) {
  CHIMERA_CHECK(!active_, "Profiler::begin_step('{}') while step '{}' is armed", name, step_name_);
  device::synchronize(device_);
  records_.clear();
  open_.clear();
  if (events_) events_->reset();
  step_name_ = std::move(name);
  device::nvtx_push(step_name_.c_str());
  active_ = true;
  step_t0_ = Clock::now();
}

void Profiler::op_begin(const char* op, void* stream) {
  device::nvtx_push(op);
  Record r{op, stream};
  r.depth = static_cast<int>(open_.size());
  if (device_ == Device::kCuda) {
    if (!device::stream_capturing(stream)) r.begin_event = events_->record(stream);
  } else {
    r.t0 = Clock::now();
  }
  records_.push_back(r);
  open_.push_back(records_.size() - 1);
}

void Profiler::op_end() {
  CHIMERA_CHECK(!open_.empty(), "Profiler::op_end without op_begin");
  Record& r = records_[open_.back()];
  open_.pop_back();
  device::nvtx_pop();
  if (device_ == Device::kCuda) {
    if (r.begin_event >= 0) r.end_event = events_->record(r.stream);
  } else {
    r.t1 = Clock::now();
  }
}

StepProfile Profiler::end_step() {
  CHIMERA_CHECK(active_, "Profiler::end_step without begin_step");
  CHIMERA_CHECK(open_.empty(), "Profiler::end_step with {} ops still open", open_.size());
  active_ = false;
  device::synchronize(device_);  // the step's one sync: every event below has completed
  const double wall_ms = std::chrono::duration<double, std::milli>(Clock::now() - step_t0_).count();
  device::nvtx_pop();

  StepProfile p;
  p.name = step_name_;
  p.wall_ms = wall_ms;
  std::map<std::string, OpStat> by_op;
  int first = -1, last = -1;              // CUDA: events bounding the span
  Clock::time_point t_first{}, t_last{};  // CPU
  bool any_timed = false;
  for (const Record& r : records_) {
    OpStat& s = by_op[r.op];
    s.op = r.op;
    ++s.calls;
    ++p.calls;
    double ms = 0;
    if (device_ == Device::kCuda) {
      if (r.begin_event < 0 || r.end_event < 0) {
        ++p.untimed_calls;
        continue;
      }
      ms = events_->elapsed_ms(r.begin_event, r.end_event);
      if (first < 0) first = r.begin_event;
      last = std::max(last, r.end_event);
    } else {
      ms = std::chrono::duration<double, std::milli>(r.t1 - r.t0).count();
      if (!any_timed) t_first = r.t0;
      t_last = std::max(t_last, r.t1);
    }
    any_timed = true;
    s.total_ms += ms;
    if (r.depth == 0) p.ops_ms += ms;
  }
  if (any_timed) {
    p.span_ms = device_ == Device::kCuda ? events_->elapsed_ms(first, last)
                                         : std::chrono::duration<double, std::milli>(t_last - t_first).count();
  }
  for (auto& [name, s] : by_op) p.ops.push_back(std::move(s));
  std::stable_sort(p.ops.begin(), p.ops.end(),
                   [](const OpStat& a, const OpStat& b) { return a.total_ms > b.total_ms; });
  records_.clear();
  return p;
}

std::string format_profile(const StepProfile& p, const std::string& indent) {
  auto pct = [&](double ms) { return p.wall_ms > 0 ? 100.0 * ms / p.wall_ms : 0.0; };
  std::string s =
      fmt::format("{}{:<24} {:>7} {:>11} {:>9} {:>11}\n", indent, "op", "calls", "total ms", "% step", "us / call");
  for (const OpStat& o : p.ops) {
    s += fmt::format("{}{:<24} {:>7} {:>11.3f} {:>8.1f}% {:>11.1f}\n", indent, o.op, o.calls, o.total_ms,
                     pct(o.total_ms), o.calls > 0 ? 1e3 * o.total_ms / static_cast<double>(o.calls) : 0.0);
  }
  s += fmt::format("{}{:<24} {:>7} {:>11.3f} {:>8.1f}%\n", indent, "sum of ops", p.calls, p.ops_ms, pct(p.ops_ms));
  s += fmt::format("{}{:<24} {:>7} {:>11.3f} {:>8.1f}%   (first op start .. last op end)\n", indent, "span", "",
                   p.span_ms, pct(p.span_ms));
  s += fmt::format("{}{:<24} {:>7} {:>11.3f} {:>8.1f}%   (span - sum: launch gaps between ops)\n", indent,
                   "gaps inside the span", "", p.span_ms - p.ops_ms, pct(p.span_ms - p.ops_ms));
  s += fmt::format("{}{:<24} {:>7} {:>11.3f} {:>8.1f}%   (wall - span: host work before / after the ops)\n", indent,
                   "outside the span", "", p.wall_ms - p.span_ms, pct(p.wall_ms - p.span_ms));
  s += fmt::format("{}{:<24} {:>7} {:>11.3f} {:>8.1f}%   (wall - sum = {:.3f} ms host / launch overhead)\n", indent,
                   "step wall time", "", p.wall_ms, 100.0, p.wall_ms - p.ops_ms);
  if (p.untimed_calls > 0) {
    s +=
        fmt::format("{}note: {} op calls were captured into a CUDA graph and are not timed\n", indent, p.untimed_calls);
  }
  if (p.calls == 0) {
    s += fmt::format(
        "{}note: no op was dispatched in this step (a CUDA graph replay runs no ops:: code; "
        "profile with eager steps)\n",
        indent);
  }
  return s;
}

}  // namespace chimera
