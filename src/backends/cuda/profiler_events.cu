// Profiler timing services on CUDA: a pool of timing events and NVTX ranges (runtime/profiler).
// NVTX v3 is header-only (nvtx3/nvToolsExt.h in the toolkit), so there is no library to link; the ranges cost
// next to nothing unless a tool (Nsight Systems) is attached.
#include "backends/cuda/cuda_common.cuh"
#include "backends/profiler_events.h"

#if __has_include(<nvtx3/nvToolsExt.h>)
#include <nvtx3/nvToolsExt.h>
#define CHIMERA_HAVE_NVTX 1
#endif

namespace chimera::device {

EventPool::~EventPool() {
  for (void* e : events_) cudaEventDestroy(static_cast<cudaEvent_t>(e));  // no throw from a destructor
}

int EventPool::record(void* stream) {
  if (used_ == events_.size()) {
    cudaEvent_t e = nullptr;
    CHIMERA_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDefault), "profiler");
    events_.push_back(e);
  }
  const auto e = static_cast<cudaEvent_t>(events_[used_]);
  CHIMERA_CUDA_CHECK(cudaEventRecord(e, cuda::as_stream(stream)), "profiler");
  return static_cast<int>(used_++);
}

void EventPool::synchronize() const {
  if (used_ == 0) return;
  CHIMERA_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(events_[used_ - 1])), "profiler");
}

float EventPool::elapsed_ms(int from, int to) const {
  float ms = 0.0f;
  CHIMERA_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(events_[static_cast<size_t>(from)]),
                                          static_cast<cudaEvent_t>(events_[static_cast<size_t>(to)])),
                     "profiler");
  return ms;
}

void nvtx_push(const char* name) {
#ifdef CHIMERA_HAVE_NVTX
  nvtxRangePushA(name);
#else
  (void)name;
#endif
}

void nvtx_pop() {
#ifdef CHIMERA_HAVE_NVTX
  nvtxRangePop();
#endif
}

bool stream_capturing(void* stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  CHIMERA_CUDA_CHECK(cudaStreamIsCapturing(cuda::as_stream(stream), &status), "profiler");
  return status != cudaStreamCaptureStatusNone;
}

}  // namespace chimera::device
