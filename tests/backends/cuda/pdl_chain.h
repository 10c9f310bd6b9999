// Test support for tests/backends/cuda/launch_test.cpp: a chain of tiny dependent kernels launched through
// cuda::launch (src/backends/cuda/launch.cuh). Built only with CUDA (tests/*.cu join chimera_tests then).
#pragma once

#include <cstdint>
#include <vector>

namespace chimera::test {

// One chain: `steps` operations on two ping-pong buffers of n uint32. Step i reads buffer i % 2 and writes
// buffer (i + 1) % 2 (so it overwrites what step i - 1 read):
//   a kernel step:  next[j] = prev[(j + 7 * i + 1) % n] * 3 + i + j   (mod 2^32; reads other blocks' writes)
//   a copy step:    next = prev (cudaMemcpyAsync device to device), every step with i % copy_every == copy_every / 2
// Kernel steps go through cuda::launch (PDL when device::pdl_enabled()), except every step with
// i % plain_every == plain_every / 2, which is a plain <<<>>> launch of the same kernel (0: none). Blocks with
// (block + i) % 4 == 0 sleep delay_ns between their read and their write, so a successor that ran ahead of its
// wait would read stale values.
struct PdlChain {
  int n = 0;
  int steps = 0;
  int copy_every = 0;   // 0: no copy steps
  int plain_every = 0;  // 0: every kernel step through cuda::launch
  unsigned delay_ns = 0;
  bool graph = false;  // capture the chain once (device::Graph) and replay it for every input
};

struct PdlChainResult {
  std::vector<std::vector<uint32_t>> outputs;  // the final buffer of each run
  // Of the last run: pairs of consecutive kernel steps whose second one went through cuda::launch, and how many
  // of them overlapped (the second grid's first block started, by %globaltimer, before the first grid's last
  // write): > 0 shows that PDL really let kernels start early; 0 is guaranteed without PDL.
  int pdl_pairs = 0;
  int overlapped_pairs = 0;
};

// Runs the chain once per input (eager: enqueued anew each time; graph: one capture, one replay per input, the
// input copied into the first buffer before each replay).
PdlChainResult run_pdl_chain(const PdlChain& c, const std::vector<std::vector<uint32_t>>& inputs);

// The same chain on the host.
std::vector<uint32_t> pdl_chain_reference(const PdlChain& c, std::vector<uint32_t> x);

// The device's compute capability major version (0 without a device).
int device_cc_major();

}  // namespace chimera::test
