// The one tolerance table (style.md 5). Every numeric comparison in the tests takes its bound from here.
#pragma once

namespace chimera::test {

struct Tolerance {
  double abs;  // elementwise: |got - want| <= abs + rel * |want|
  double rel;
};

// Elementwise ops computed in fp32 on both sides (norms, conv, gating, routing weights).
inline constexpr Tolerance kF32Elementwise{1e-5, 1e-5};
// Long fp32 reductions (GEMM, SSD scan, attention, MoE): bounded by normalised MSE and a max-error bound.
inline constexpr double kF32ReductionNmse = 1e-10;
inline constexpr Tolerance kF32Reduction{1e-4, 1e-4};
// bf16 storage of activations (CUDA bf16 path vs the fp32 reference).
inline constexpr Tolerance kBF16Elementwise{1e-2, 1e-2};
inline constexpr double kBF16ReductionNmse = 1e-4;
// Whole-model parity with transformers in fp32: per position max|logit - ref| <= 1e-4 * max|ref| (issue 2).
inline constexpr double kModelLogitsRelToMax = 1e-4;
// GPU fp32 engine vs the fixtures (issue 4).
inline constexpr double kGpuModelLogitsRelToMax = 1e-3;

}  // namespace chimera::test
