// The one tolerance table (docs/style.md 5). Every numeric comparison in the tests takes its bound from here.
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
// Elementwise backstop for bf16 / f16 long reductions whose operands are rounded to 16 bits on the way, paired
// with the normalised-MSE bound kBF16ReductionNmse (the real check); this one only catches wrong or missing rows.
// Two cases set it:
//  * MoE experts: h = relu(up)^2 is stored in bf16 as HF does, then reduced over I by the down projection; the
//    per-output error is ~2^-9 * ||w * down * h||, so among 1e5+ outputs the 4-5 sigma tails reach 0.02-0.05 (a
//    CPU simulation of the same rounding shows the same tail), while the nmse stays far below its bound.
//  * SSD scan: decay-weighted C.B, dt-weighted x and the carried state go through the tensor cores as 16-bit
//    values (as in mamba_ssm); outputs near zero among millions carry a few bf16 ulps of the O(1) terms.
inline constexpr Tolerance kBF16Reduction{1e-1, 2e-2};
// FP8 e4m3 outputs (fused RMSNorm + quant), compared in the quantised domain (value / scale) against the fp32
// reference: one e4m3 step (2^-3 relative) covers the rounding plus a flip caused by the bf16-rounded sum of the
// TWOSHOT path; abs = the smallest subnormal (2^-9).
inline constexpr Tolerance kF8E4M3Quant{1.0 / 512, 0.125};
// Whole-model parity with transformers in fp32: per position max|logit - ref| <= 1e-4 * max|ref|.
inline constexpr double kModelLogitsRelToMax = 1e-4;
// Tensor parallelism against one rank, CPU fp32 (tests/models/nemotron_h_tp_test.cpp): the same math with the
// row-parallel sums, the split norms' sums of squares and the GEMMs' K added in another order. max|TP - TP1| /
// max|TP1| per logits row.
inline constexpr double kTensorParallelLogitsRelToMax = 1e-5;
// GPU fp32 engine vs the fixtures: other reduction orders (cuBLASLt, the chunked scan, attention), same tokens.
inline constexpr double kGpuModelLogitsRelToMax = 1e-3;
// bf16 engine, CUDA-graph decode vs eager decode: the captured attention plans its KV splits for the longest
// context, eager for this step's, so partial sums meet in another order and bf16 roundings of the attention
// output can differ by an ulp, which the following layers carry (tokens must be equal).
inline constexpr double kGpuBf16GraphVsEagerRelToMax = 2e-2;
// GPU bf16 engine vs transformers run in bf16 on the GPU (logits_bf16_<p>.npy, teacher-forced positions):
// top-1 agreement >= kGpuBf16Top1Agreement over the decidable positions (the reference's top-2 margin above
// kGpuBf16TieMargin x its largest |logit|, about two bf16 steps at that magnitude: below it rounding noise on
// either side decides the order, and the bf16 reference even ties exactly), and the 90th percentile over
// positions of max|logit - ref| / max|ref| <= kGpuBf16LogitsRelToMax. Not the maximum: both sides round
// activations to bf16 in different places (Chimera keeps A_log, D, dt_bias and the router in fp32, fuses add +
// RMSNorm, sums in other orders), and where a router's top-k choice is a near-tie the two runs pick different
// experts and that position's logits move by O(1) (the test prints the maximum).
inline constexpr double kGpuBf16TieMargin = 1.0 / 64;
inline constexpr double kGpuBf16LogitsRelToMax = 0.05;
inline constexpr double kGpuBf16Top1Agreement = 0.99;
// super_like (LatentMoE, 16 experts top-3, groups, scale 2.5, correction bias std 0.5) does NOT meet the bar above
// over all decidable positions, and the cause is its routers, not Chimera's bf16 arithmetic
// (scripts/bf16_layer_error.py shows Chimera's bf16 blocks as close to fp32 math on the same input as transformers'
// bf16 blocks, and its residual stream closer to the fp32 one). About a quarter of its positions have a top-3
// selection margin (3rd vs 4th biased score, scores ~1) below 0.01 in some MoE layer, where either run's bf16 noise
// (~1 % of the router input after six layers) picks another expert set and that row's logits move by up to half of
// max|logit|; both runs flip a few such choices, at different positions. Every decidable miss sits at a position
// whose router margin is below 0.01, and on the robust positions both the GPU and the CPU on bf16 weights agree at
// every one. So both bf16 tests also measure the robust positions (decidable, and every router margin at that
// position >= kBf16RouterTieMargin, from router_margin_<p>.npy) and hold them to the 99 % bar on every fixture; the
// plain decidable rate of super_like keeps the looser bounds below, just under what it reaches, so a regression
// still fails.
inline constexpr double kBf16RouterTieMargin = 0.01;
inline constexpr double kGpuBf16Top1AgreementSuperLike = 0.97;
inline constexpr double kGpuBf16LogitsRelToMaxSuperLike = 0.08;
// The CPU backend on bf16 weights (fp32 math; models/nemotron_h_bf16_test.cpp) vs the same transformers bf16 logits,
// same measure and the same bar for every fixture, super_like included (its fp32 math flips fewer router near-ties
// than a bf16 run; the super_like note above applies to the margin it has).
inline constexpr double kCpuBf16WeightsTop1Agreement = 0.99;
inline constexpr double kCpuBf16WeightsLogitsRelToMax = 0.05;

// FP8 activation codes (quantize_fp8, add_rms_norm_fp8, gated_rms_norm_fp8) against a double-precision reference:
// the codes must be equal except where the reference value is ambiguous, i.e. moving it by a relative
// kFp8BoundaryRel changes its code (then the code must be one of the two). 2^-16 is above the fp32 kernels'
// relative error of the normalised value (a sum of squares over <= 65536 terms in fp32, a tree of per-thread runs:
// < 2^-18; the inverse square root, the weight product and expf in silu add a few 2^-24) and far below the e4m3
// step (2^-3), so a flip is only accepted within 1/8192 of a step from a rounding boundary.
inline constexpr double kFp8BoundaryRel = 1.0 / 65536;
// cuBLASLt's FP8 GEMM (fast accumulation off) against the exact sum: |error| <= kFp8GemmAccumRel * sum_k |x' w|.
// Hopper's FP8 tensor cores keep ~14 mantissa bits within an mma chain and cuBLASLt promotes the partial sums to
// fp32 every few k-blocks, so each promoted chunk carries <= 2^-13 of its absolute sum; 2^-11 leaves a factor 4.
// A wrong layout, transpose or scale misses this by orders of magnitude.
inline constexpr double kFp8GemmAccumRel = 1.0 / 2048;

}  // namespace chimera::test
