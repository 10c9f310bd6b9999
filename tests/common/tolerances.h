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
// Its elementwise companion for long reductions whose matrix-product operands are rounded to bf16 / f16
// (the CUDA SSD scan: decay-weighted C.B, dt-weighted x and the carried state go through the tensor cores
// as 16-bit values, as in mamba_ssm): kBF16Elementwise would flag the few outputs near zero among millions
// whose absolute error is a handful of bf16 ulps of the O(1) terms summed into them. The normalised MSE is
// the check; this bound only catches gross single-element errors.
inline constexpr Tolerance kBF16Reduction{5e-2, 2e-2};
// Whole-model parity with transformers in fp32: per position max|logit - ref| <= 1e-4 * max|ref| (issue 2).
inline constexpr double kModelLogitsRelToMax = 1e-4;
// GPU fp32 engine vs the fixtures (issue 4).
inline constexpr double kGpuModelLogitsRelToMax = 1e-3;

}  // namespace chimera::test
