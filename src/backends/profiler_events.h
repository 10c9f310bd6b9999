// Device timing services for runtime/profiler: CUDA events recorded on a stream and NVTX ranges.
// Built against CUDA when CHIMERA_HAVE_CUDA (src/backends/cuda/profiler_events.cu), otherwise a stub
// (src/backends/profiler_events_stub.cpp) whose ranges are no-ops and whose event recording throws (a CPU
// profile uses steady_clock and never records an event).
#pragma once

#include <cstddef>
#include <vector>

namespace chimera::device {

// A growing pool of timing events (cudaEventDefault), reused from the start after reset(), so a profiled
// step creates events only the first time it needs that many.
class EventPool {
 public:
  EventPool() = default;
  ~EventPool();
  EventPool(const EventPool&) = delete;
  EventPool& operator=(const EventPool&) = delete;

  // Records the next free event of the pool on `stream` (a cudaStream_t; null = the default stream) and
  // returns its index.
  int record(void* stream);
  // Blocks until the last recorded event has completed (every event recorded before it on its stream, too).
  void synchronize() const;
  // Milliseconds between two recorded, completed events.
  float elapsed_ms(int from, int to) const;
  // The next record() reuses the first event.
  void reset() { used_ = 0; }

 private:
  std::vector<void*> events_;  // cudaEvent_t
  size_t used_ = 0;
};

// A named NVTX range on the calling thread (nvtxRangePushA / nvtxRangePop); no-ops without CUDA.
void nvtx_push(const char* name);
void nvtx_pop();

// True while `stream` is being captured into a CUDA graph (events recorded then would become graph nodes
// whose times cannot be read after the step, so the profiler counts such ops as untimed).
bool stream_capturing(void* stream);

}  // namespace chimera::device
