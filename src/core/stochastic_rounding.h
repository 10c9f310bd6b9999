// Stochastic rounding of fp32 to fp16 for the Mamba SSM state cache (--mamba-ssm-cache-dtype float16), with random
// bits from a counter-based hash, so that the CPU reference and the CUDA kernels round every element identically
// and a rerun reproduces every bit (docs/caches.md "The SSM state dtype").
//
//   key       = ssm_rounding_key(seed, position): the layer's seed (derived from the layer index) and the position in
//               its sequence of the token after which the state is written (the decode token, or a prefill's last)
//   bits(e)   = 16 random bits for state element e of the slot (e = (h * P + p) * N + n): half of
//               counter_bits32(key, e / 2), the low half for even e (one hash per pair of neighbouring elements)
//   f16 value = f32_to_f16_stochastic(v, bits(e)): one of the two fp16 values bracketing v, the upper one with
//               probability (v - lo) / (hi - lo), so E[round(v)] = v (exactly for |v| >= 2^-16, to within
//               2^-40 below); finite values beyond the fp16 range saturate to +-65504; inf and NaN stay.
// A sequence's bits depend on its own positions only (not on its slot or the batch), so a request rounds alike
// whatever else runs with it.
#pragma once

#include <cstdint>

#include "core/counter_rng.h"

#if !defined(__CUDA_ARCH__)
#include <cstring>
#endif

namespace chimera {

CHIMERA_HOST_DEVICE inline uint32_t f32_as_bits(float v) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(v);
#else
  uint32_t b;
  std::memcpy(&b, &v, 4);
  return b;
#endif
}

// A 32-bit integer hash with full avalanche (lowbias32).
CHIMERA_HOST_DEVICE inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

CHIMERA_HOST_DEVICE inline uint64_t ssm_rounding_key(uint64_t seed, int64_t position) {
  return splitmix64(seed ^ splitmix64(static_cast<uint64_t>(position)));
}

// 32 random bits for counter `index` under `key`.
CHIMERA_HOST_DEVICE inline uint32_t counter_bits32(uint64_t key, uint32_t index) {
  return mix32(mix32(index ^ static_cast<uint32_t>(key)) ^ static_cast<uint32_t>(key >> 32));
}

// The 16 random bits of state element e (see the file comment).
CHIMERA_HOST_DEVICE inline uint32_t ssm_rounding_bits(uint64_t key, uint32_t e) {
  return (counter_bits32(key, e >> 1) >> (16 * (e & 1u))) & 0xffffu;
}

// fp32 -> fp16 bits, rounded stochastically with the 16 random bits r (uniform in [0, 2^16)).
//   fp16 normal range (|v| >= 2^-14): 13 mantissa bits are dropped; adding r's low 13 bits to the fp32 pattern and
//   truncating carries into the kept bits with probability (dropped bits) / 2^13 (a carry out of the mantissa steps
//   the exponent, as it should).
//   Below 2^-14 (fp16 subnormals, steps of 2^-24): v = m * 2^-shift in those steps; the upper neighbour with
//   probability (m mod 2^shift) / 2^shift, compared against shift random bits (the top 16 past 16 bits).
CHIMERA_HOST_DEVICE inline uint16_t f32_to_f16_stochastic(float v, uint32_t r) {
  const uint32_t b = f32_as_bits(v);
  const uint32_t sign = (b >> 16) & 0x8000u;
  const uint32_t a = b & 0x7fffffffu;
  if (a >= 0x7f800000u) return static_cast<uint16_t>(sign | (a > 0x7f800000u ? 0x7e00u : 0x7c00u));
  const uint32_t exp = a >> 23;
  uint32_t h;
  if (exp >= 113) {
    const uint32_t t = a + (r & 0x1fffu);
    h = t >= 0x47800000u ? 0x7bffu : (t >> 13) - (112u << 10);  // >= 2^16 after rounding: saturate at 65504
  } else {
    const uint32_t m = exp == 0 ? (a & 0x7fffffu) : ((a & 0x7fffffu) | 0x800000u);
    const uint32_t shift = exp == 0 ? 125u : 126u - exp;  // >= 14
    const uint32_t r16 = r & 0xffffu;
    if (shift <= 16) {
      const uint32_t rem = m & ((1u << shift) - 1u);
      h = (m >> shift) + ((r16 >> (16 - shift)) < rem ? 1u : 0u);
    } else {
      // The top 16 bits of the fraction (m < 2^24: nothing is kept from 24 on, and 40 on leaves no fraction bit).
      const uint32_t q = shift < 24 ? m >> shift : 0u;
      const uint32_t rem = shift < 24 ? m & ((1u << shift) - 1u) : m;
      const uint32_t top = shift < 48 ? rem >> (shift - 16) : 0u;
      h = q + (r16 < top ? 1u : 0u);
    }
  }
  return static_cast<uint16_t>(sign | h);
}

}  // namespace chimera
