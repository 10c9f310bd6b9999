// The 2-GPU tests' device-side comparisons (check.h): one pass over the output, a warp reduction of the worst
// element, one atomic per warp.
#include <cuda_fp8.h>

#include <algorithm>

#include "backends/cuda/cuda_common.cuh"
#include "backends/cuda/dist/check.h"

namespace chimera::cuda::dist {

namespace {

template <typename T>
__device__ __forceinline__ float load_got(const T* p, int64_t i) {
  if constexpr (sizeof(T) == 1) {
    const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(p[i]), __NV_E4M3);
    return __half2float(__half(h));
  } else {
    return to_float<T>(p[i]);
  }
}

// got, want: [n]. Packs (ratio bits, index) so that one unsigned max finds the worst element; the ratio is
// non-negative (its bits order like the value), +inf for a one-sided NaN.
template <typename T>
__global__ void check_close_kernel(const T* got, const float* want, float want_scale, int64_t n, double abs,
                                   double rel, CloseReport* report) {
  unsigned long long worst = 0, bad = 0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float g = load_got(got, i);
    const float w = want[i] * want_scale;
    float ratio;
    if (isnan(g) || isnan(w)) {
      ratio = isnan(g) && isnan(w) ? 0.0f : __int_as_float(0x7f800000);
    } else {
      const double bound = abs + rel * fabs(static_cast<double>(w));
      ratio = static_cast<float>(fabs(static_cast<double>(g) - static_cast<double>(w)) / bound);
      if (isnan(ratio)) ratio = __int_as_float(0x7f800000);  // inf - inf
    }
    if (ratio > 1.0f) ++bad;
    const unsigned long long key =
        (static_cast<unsigned long long>(__float_as_uint(ratio)) << 32) | static_cast<unsigned long long>(i);
    worst = key > worst ? key : worst;
  }
  for (int off = 16; off > 0; off >>= 1) {
    worst = max(worst, __shfl_xor_sync(0xffffffffu, worst, off));
    bad += __shfl_xor_sync(0xffffffffu, bad, off);
  }
  if ((threadIdx.x & 31) == 0) {
    if (worst) atomicMax(&report->worst, worst);
    if (bad) atomicAdd(&report->bad, bad);
  }
}

__global__ void count_diff_words_kernel(const uint32_t* a, const uint32_t* b, int64_t words,
                                        unsigned long long* count) {
  unsigned long long diff = 0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < words;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    diff += a[i] != b[i] ? 1 : 0;
  }
  for (int off = 16; off > 0; off >>= 1) diff += __shfl_xor_sync(0xffffffffu, diff, off);
  if ((threadIdx.x & 31) == 0 && diff) atomicAdd(count, diff);
}

int grid_for(int64_t n) { return static_cast<int>(std::min<int64_t>((n + 255) / 256, 132 * 8)); }

}  // namespace

void launch_check_close(DType got_dtype, const void* got, const float* want, float want_scale, int64_t n,
                        double abs, double rel, CloseReport* report, void* stream) {
  if (n <= 0 || n >= (int64_t{1} << 32)) throw_runtime(str_cat("dist::check_close: n = ", n, " outside [1, 2^32)"));
  cudaStream_t st = as_stream(stream);
  CHIMERA_CUDA_CHECK(cudaMemsetAsync(report, 0, sizeof(CloseReport), st), "dist::check_close");
  const int grid = grid_for(n);
  switch (got_dtype) {
    case DType::kF32:
      check_close_kernel<<<grid, 256, 0, st>>>(static_cast<const float*>(got), want, want_scale, n, abs, rel, report);
      break;
    case DType::kBF16:
      check_close_kernel<<<grid, 256, 0, st>>>(static_cast<const __nv_bfloat16*>(got), want, want_scale, n, abs, rel,
                                               report);
      break;
    case DType::kF16:
      check_close_kernel<<<grid, 256, 0, st>>>(static_cast<const __half*>(got), want, want_scale, n, abs, rel, report);
      break;
    case DType::kF8E4M3:
      check_close_kernel<<<grid, 256, 0, st>>>(static_cast<const uint8_t*>(got), want, want_scale, n, abs, rel,
                                               report);
      break;
    default:
      throw_runtime(str_cat("dist::check_close: dtype ", dtype_name(got_dtype),
                            " is not supported (supported: F32, BF16, F16, F8_E4M3)"));
  }
  CHIMERA_LAUNCH_CHECK("dist::check_close");
}

void launch_count_diff_words(const void* a, const void* b, int64_t bytes, unsigned long long* count, void* stream) {
  if (bytes % 4 != 0) throw_runtime(str_cat("dist::count_diff_words: ", bytes, " bytes is not a multiple of 4"));
  cudaStream_t st = as_stream(stream);
  CHIMERA_CUDA_CHECK(cudaMemsetAsync(count, 0, sizeof(unsigned long long), st), "dist::count_diff_words");
  const int64_t words = bytes / 4;
  if (words == 0) return;
  count_diff_words_kernel<<<grid_for(words), 256, 0, st>>>(static_cast<const uint32_t*>(a),
                                                           static_cast<const uint32_t*>(b), words, count);
  CHIMERA_LAUNCH_CHECK("dist::count_diff_words");
}

}  // namespace chimera::cuda::dist
