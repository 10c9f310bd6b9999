// 1-D bulk copies global -> shared (cp.async.bulk: the TMA engine without a tensor map) completing on an mbarrier,
// sm_90 (PTX ISA 8.0). One thread arms the barrier with the byte count (arrive.expect_tx) and issues the copies;
// every thread that reads the data waits on the barrier's phase parity.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace chimera::cuda {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// count: the arrivals that complete a phase (1: the arming thread's arrive.expect_tx).
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// The arming thread's arrival, announcing the bytes the phase's copies will complete (< 2^20).
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("{\n\t.reg .b64 st;\n\tmbarrier.arrive.expect_tx.shared.b64 st, [%0], %1;\n\t}" ::"r"(smem_u32(bar)),
               "r"(bytes)
               : "memory");
}

// Until the phase of parity `parity` has completed. A wait that never ends (a byte count that the copies do not
// complete) traps after kMaxSpins try_waits (each suspends up to a hardware time limit), so a test or a captured step
// fails with a launch error instead of hanging the device.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  constexpr uint32_t kMaxSpins = 1u << 26;
  for (uint32_t spins = 0;; ++spins) {
    uint32_t done = 0;
    asm volatile("{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared.b64 p, [%1], %2;\n\tselp.u32 %0, 1, 0, p;\n\t}"
                 : "=r"(done)
                 : "r"(smem_u32(bar)), "r"(parity)
                 : "memory");
    if (done != 0) return;
    if (spins == kMaxSpins) __trap();
  }
}

// bytes (a multiple of 16) from global src to shared dst (both 16-byte aligned), completing on bar's tx count.
__device__ __forceinline__ void bulk_copy_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(smem_u32(dst)),
      "l"(src), "r"(bytes), "r"(smem_u32(bar))
      : "memory");
}

}  // namespace chimera::cuda
