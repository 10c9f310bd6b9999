// Kernel launches with programmatic dependent launch (PDL, sm_90+).
//
// Why: a decode step is ~400 small kernels back to back in a CUDA graph; without PDL each one starts only after
// its predecessor has fully drained, so the launch latency and the ramp-up sit on the critical path once per
// kernel. With the ProgrammaticStreamSerialization attribute the next kernel's blocks may be scheduled while the
// previous kernel is still finishing; they run their prologue (index math, loads of constant weights) and then
// block in pdl_wait() until the predecessor grid has completed and its memory is visible.
//
// The contract for a kernel launched through launch() (enforced by review, not by the compiler):
//   * it calls pdl_wait() before its first read of anything an earlier kernel wrote AND before its first global
//     write (the predecessor may still be reading what we are about to overwrite);
//   * only data nobody writes during the step (weights, norm gammas, biases; the step's ops::Indices metadata,
//     which the host writes before the step: the conv update's slot ids, Conv1dParams::slots; host
//     arrays an op copies to the device before its launch: the conv prefill's tile list,
//     Conv1dParams::tiles) may be read before pdl_wait(), with
//     one exception ("two back"): when this kernel starts, the kernel two launches back has completed and its
//     memory is visible (the kernel in between triggers only after its own wait, or is a plain launch that
//     started after that kernel completed). So a kernel may, before its wait, read what kernels two or more
//     launches back wrote, and write a buffer that the kernel right before it does not touch (not even as a
//     workspace it freed: the caching allocator may hand that block straight to the next op, so such a
//     predecessor keeps its workspace allocated past the next op; router_gate_topk does). Used by the MoE up
//     GEMV's shared-expert units (GemvShared::before_wait), which overlap the router;
//   * pdl_trigger() may be called anywhere (usually right after pdl_wait()); it only lets the NEXT kernel start
//     its own prologue early: the next kernel's pdl_wait() still waits for this whole grid to finish.
//   * every grid must reach pdl_wait() in at least one thread of every block (in practice: call it before any
//     early return that a whole block can take). The wait is what chains the step: kernel N+1's wait covers
//     kernel N's completion, and N completes only after its own wait covered N-1. A block that exits without
//     waiting breaks that chain (its grid could complete before its predecessor), so a later kernel could
//     overwrite a buffer an earlier one is still reading. Threads that touch nothing may exit before the wait.
// A kernel launched without the attribute (PDL disabled, pre-sm_90, or a plain <<<>>> launch) sees both calls as
// no-ops, so the same kernel serves both.
//
// Neighbours that are not launched here (cuBLASLt's GEMMs in gemm/linear.cu, which take no launch attribute;
// the grouped expert GEMV/GEMM launches; memcpy / memset nodes; NCCL) stay correct on both sides:
//   * before a PDL kernel: the PDL kernel may be scheduled early only if that predecessor kernel triggers
//     (a library kernel may; a plain kernel triggers implicitly when it exits), and its pdl_wait() still waits
//     for the predecessor's full completion and memory flush, so reading a cuBLASLt output after the wait is
//     safe; a memcpy / memset node is a full dependency anyway;
//   * after a PDL kernel: an operation launched without the attribute waits for the full completion of the
//     previous kernel, as without PDL.
// tests/backends/cuda/launch_test.cpp checks chains of dependent launches (with plain launches and memcpy nodes
// mixed in), eager and captured in a CUDA graph, and PDL kernels around cuBLASLt GEMMs (same bits as without).
#pragma once

#include <cuda_runtime.h>

#include <utility>

namespace chimera::device {
bool pdl_enabled();  // device_api.h
}  // namespace chimera::device

namespace chimera::cuda {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

// A hint that pulls the 128-byte line at p into L2: for a PDL prologue to start fetching constant weights
// before pdl_wait() without holding registers across the wait.
inline constexpr int kL2LineFloats = 32;  // floats per 128-byte line
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// The split cluster barrier (sm_90): every thread of every CTA of the cluster arrives, then waits. The release /
// acquire pair orders each CTA's earlier (distributed) shared-memory writes before the others' later reads; the
// relaxed arrive orders nothing (a barrier that only proves every CTA has started).
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_arrive_release() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait_acquire() {
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// As launch(), for a kernel run in thread-block clusters of `cluster_x` CTAs along x (grid.x a multiple of it;
// 0: no cluster, what launch() passes). Clusters above 8 CTAs need cudaFuncAttributeNonPortableClusterSizeAllowed
// set on the kernel first.
template <typename... KArgs, typename... Args>
cudaError_t launch_cluster(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                           unsigned cluster_x, Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  unsigned n = 0;
  if (cluster_x > 0) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = cluster_x;
    attr[n].val.clusterDim.y = 1;
    attr[n].val.clusterDim.z = 1;
    ++n;
  }
  if (device::pdl_enabled()) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  cfg.attrs = n > 0 ? attr : nullptr;
  cfg.numAttrs = n;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

// Whether one cluster of `cluster_x` CTAs of `kernel` (block threads, smem dynamic bytes each) can be resident at
// once (cudaOccupancyMaxActiveClusters > 0). A refused query is an answer: its error is cleared. Clusters above 8
// CTAs need the non-portable attribute set on the kernel first (as for launch_cluster).
template <typename... KArgs>
bool cluster_fits_once(void (*kernel)(KArgs...), unsigned cluster_x, unsigned block, size_t smem) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(cluster_x);
  cfg.blockDim = dim3(block);
  cfg.dynamicSmemBytes = smem;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = cluster_x;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  int n = 0;
  const bool ok = cudaOccupancyMaxActiveClusters(&n, kernel, &cfg) == cudaSuccess && n > 0;
  (void)cudaGetLastError();
  return ok;
}

// kernel<<<grid, block, smem, stream>>>(args...) with the PDL attribute when pdl_enabled(). Returns the launch's
// error; callers follow it with CHIMERA_LAUNCH_CHECK / CHIMERA_CUDA_CHECK as for <<<>>>.
template <typename... KArgs, typename... Args>
cudaError_t launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                   Args&&... args) {
  return launch_cluster(kernel, grid, block, smem, stream, 0u, std::forward<Args>(args)...);
}

}  // namespace chimera::cuda
