// Profiler timing services of a build without CUDA: no NVTX, no events (a CPU profile uses steady_clock).
#include "backends/profiler_events.h"
#include "core/error.h"

namespace chimera::device {

EventPool::~EventPool() = default;
int EventPool::record(void* /*stream*/) {
  runtime_error("this build of chimera has no CUDA backend");
}
void EventPool::synchronize() const {}
float EventPool::elapsed_ms(int /*from*/, int /*to*/) const {
  runtime_error("this build of chimera has no CUDA backend");
}

void nvtx_push(const char* /*name*/) {}
void nvtx_pop() {}
bool stream_capturing(void* /*stream*/) {
  return false;
}

}  // namespace chimera::device
