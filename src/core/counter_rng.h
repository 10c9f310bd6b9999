// The counter-based uniform of token sampling: a draw depends only on (seed, step), never on batch
// composition, thread timing or the backend. One definition, compiled for the host and (under nvcc) for the
// device, so the CPU reference and the CUDA sampler use bit-identical uniforms.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define CHIMERA_HOST_DEVICE __host__ __device__
#else
#define CHIMERA_HOST_DEVICE
#endif

namespace chimera {

CHIMERA_HOST_DEVICE inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Uniform double in [0, 1) from (seed, step): splitmix64 of the pair, top 53 bits.
CHIMERA_HOST_DEVICE inline double counter_uniform(uint64_t seed, uint64_t step) {
  const uint64_t r = splitmix64(splitmix64(seed) ^ (step * 0xd1342543de82ef95ull + 1));
  return static_cast<double>(r >> 11) * 0x1.0p-53;
}

}  // namespace chimera
