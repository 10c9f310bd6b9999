// AllReduce strategies and fusion patterns: plain enums and compile-time traits shared by the host code
// (src/dist) and the kernels (src/backends/cuda/dist). No fmt, no CUDA: nvcc and the CPU-only build include it.
#pragma once

#include <cstdint>

namespace chimera::dist {

// The strategies: NCCL (ncclAllReduce + our fused norm kernel), ONESHOT (Lamport push, one kernel),
// TWOSHOT (reduce-scatter + all-gather with flag barriers, one kernel). AUTO asks the lookup table.
enum class AllReduceStrategy : uint8_t { kAuto, kNccl, kOneShot, kTwoShot };

// What follows the sum, chosen at compile time. With s = sum over ranks of input:
//   kAllReduce:             output = s
//   kResidualRmsNorm:       residual_out = s + residual_in; norm_out = rms_norm(residual_out) * w
//   kResidualRmsNormFp8:    residual_out = s + residual_in; fp8_out = e4m3(rms_norm(residual_out) * w / scale)
//   kResidualRmsNormOutFp8: residual_out, norm_out and fp8_out (both norm outputs: MoE routing + experts)
//   kRmsNorm:               norm_out = rms_norm(s) * w (no residual)
enum class FusionPattern : uint8_t {
  kAllReduce,
  kResidualRmsNorm,
  kResidualRmsNormFp8,
  kResidualRmsNormOutFp8,
  kRmsNorm,
};
inline constexpr int kNumFusionPatterns = 5;

constexpr bool has_residual(FusionPattern p) {
  return p == FusionPattern::kResidualRmsNorm || p == FusionPattern::kResidualRmsNormFp8 ||
         p == FusionPattern::kResidualRmsNormOutFp8;
}
constexpr bool has_norm(FusionPattern p) { return p != FusionPattern::kAllReduce; }
constexpr bool has_norm_out(FusionPattern p) {
  return p == FusionPattern::kResidualRmsNorm || p == FusionPattern::kResidualRmsNormOutFp8 ||
         p == FusionPattern::kRmsNorm;
}
constexpr bool has_fp8_out(FusionPattern p) {
  return p == FusionPattern::kResidualRmsNormFp8 || p == FusionPattern::kResidualRmsNormOutFp8;
}

}  // namespace chimera::dist
