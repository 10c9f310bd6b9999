// Kernel timeline of any Chimera binary, CUDA-graph replays included: a shared library for LD_PRELOAD that
// records every kernel's start and end through the CUPTI activity API (CONCURRENT_KERNEL: does not serialise
// kernels, so PDL overlap stays as it is) and writes one CSV line per kernel at exit.
//
// Why: the engine's --profile mode times ops with CUDA events in an eager step, and ncu times kernels one at a
// time with flushed caches; neither shows where a graph-replayed decode step (~200 PDL-chained kernels) spends
// its time. bench/trace/kernel_trace.py turns the CSV into per-kernel critical-path time (end-to-end deltas).
//
// Build: the CMake target chimera_kernel_trace (CUDA builds with CUPTI) -> libchimera_kernel_trace.so.
// Use: CHIMERA_KERNEL_TRACE=trace.csv LD_PRELOAD=build/libchimera_kernel_trace.so ./build/chimera bench ...
// CSV columns: start_ns,end_ns,graph_id,graph_node_id,stream_id,grid_x,grid_y,grid_z,block_x,name (demangled).
#include <cupti.h>
#include <cxxabi.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>

namespace {

FILE* g_out = nullptr;
std::mutex g_mutex;

// CUPTI calls here run inside constructors / destructors: report and carry on (tracing is best effort).
void check(CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return;
  const char* msg = nullptr;
  cuptiGetResultString(r, &msg);
  std::fprintf(stderr, "kernel_trace: %s failed: %s\n", what, msg ? msg : "?");
}

std::string demangle(const char* name) {
  if (name == nullptr) return "?";
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> d(abi::__cxa_demangle(name, nullptr, nullptr, &status), std::free);
  std::string s = status == 0 && d ? d.get() : name;
  for (char& c : s) c = c == ',' ? ';' : c;  // one CSV field
  return s;
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  constexpr size_t kBytes = size_t{16} << 20;
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBytes));
  *size = *buffer ? kBytes : 0;
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  std::lock_guard<std::mutex> lock(g_mutex);
  CUpti_Activity* rec = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
    if (rec->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || g_out == nullptr) continue;
    const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
    std::fprintf(g_out, "%llu,%llu,%u,%llu,%u,%d,%d,%d,%d,%s\n", static_cast<unsigned long long>(k->start),
                 static_cast<unsigned long long>(k->end), k->graphId, static_cast<unsigned long long>(k->graphNodeId),
                 k->streamId, k->gridX, k->gridY, k->gridZ, k->blockX, demangle(k->name).c_str());
  }
  size_t dropped = 0;
  cuptiActivityGetNumDroppedRecords(nullptr, 0, &dropped);
  if (dropped) std::fprintf(stderr, "kernel_trace: %zu records dropped\n", dropped);
  std::free(buffer);
}

__attribute__((constructor)) void trace_begin() {
  const char* path = std::getenv("CHIMERA_KERNEL_TRACE");
  if (path == nullptr || *path == '\0') return;
  g_out = std::fopen(path, "w");
  if (g_out == nullptr) {
    std::fprintf(stderr, "kernel_trace: cannot write %s\n", path);
    return;
  }
  std::fprintf(g_out, "start_ns,end_ns,graph_id,graph_node_id,stream_id,grid_x,grid_y,grid_z,block_x,name\n");
  check(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed), "cuptiActivityRegisterCallbacks");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "cuptiActivityEnable");
  // Deliver buffers every 50 ms as well: the CUDA context may be gone by the time this library's destructor runs.
  check(cuptiActivityFlushPeriod(50), "cuptiActivityFlushPeriod");
}

__attribute__((destructor)) void trace_end() {
  if (g_out == nullptr) return;
  check(cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED), "cuptiActivityFlushAll");
  std::lock_guard<std::mutex> lock(g_mutex);
  std::fclose(g_out);
  g_out = nullptr;
}

}  // namespace
