// Device-side comparison of AllReduce outputs with an fp32 reference (and of two ranks' outputs with each other),
// for the 2-GPU tests (tests/dist/allreduce_test.cpp). The full test grid writes ~10^11 output elements; copying
// them to the host to compare would take minutes, so the comparison runs where the data is and only a 16-byte
// report comes back. The bound is the tolerance table's elementwise one (tests/common/tolerances.h):
// |got - want| <= abs + rel * |want|; NaN on one side only fails, NaN on both sides passes (all_close's rule).
// No CUDA types here (included by host C++).
#pragma once

#include <cstdint>

#include "core/dtype.h"

namespace chimera::cuda::dist {

// Written by the kernels (device memory, zeroed by launch_check_close before it starts).
struct CloseReport {
  unsigned long long bad;    // elements outside the bound
  unsigned long long worst;  // max over elements of (float bits of |got - want| / bound) << 32 | index
};
// Decoded on the host from CloseReport::worst.
inline float worst_ratio(const CloseReport& r) {
  const uint32_t bits = static_cast<uint32_t>(r.worst >> 32);
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}
inline int64_t worst_index(const CloseReport& r) { return static_cast<int64_t>(r.worst & 0xffffffffu); }

// got: [n] in got_dtype (F32, BF16, F16 or F8E4M3); want: [n] fp32 on the same device, compared as
// want[i] * want_scale (the FP8 output is compared in its quantised domain: want_scale = 1 / fp8 scale).
// n < 2^32. report: device pointer. Asynchronous on `stream`.
void launch_check_close(DType got_dtype, const void* got, const float* want, float want_scale, int64_t n,
                        double abs, double rel, CloseReport* report, void* stream);
// Counts the 4-byte words that differ between a and b ([bytes], bytes a multiple of 4, both on this device) into
// *count (device pointer, zeroed first).
void launch_count_diff_words(const void* a, const void* b, int64_t bytes, unsigned long long* count, void* stream);

}  // namespace chimera::cuda::dist
