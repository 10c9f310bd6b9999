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
// Two measured cases set it (H200 runs, 2026-11-30):
//  * MoE experts: h = relu(up)^2 is stored in bf16 as HF does, then reduced over I by the down projection; the
//    per-output error is ~2^-9 * ||w * down * h||, so 1e5+ outputs show 4-5 sigma tails near 0.02-0.05 (up to
//    145 of 295128 outputs past kBF16Elementwise; a CPU simulation of the same rounding gives 112; nmse ~5e-6).
//  * SSD scan: decay-weighted C.B, dt-weighted x and the carried state go through the tensor cores as 16-bit
//    values (as in mamba_ssm); outputs near zero among millions carry a few bf16 ulps of the O(1) terms.
inline constexpr Tolerance kBF16Reduction{1e-1, 2e-2};
// FP8 e4m3 outputs (fused RMSNorm + quant), compared in the quantised domain (value / scale) against the fp32
// reference: one e4m3 step (2^-3 relative) covers the rounding plus a flip caused by the bf16-rounded sum of the
// TWOSHOT path; abs = the smallest subnormal (2^-9).
inline constexpr Tolerance kF8E4M3Quant{1.0 / 512, 0.125};
// Whole-model parity with transformers in fp32: per position max|logit - ref| <= 1e-4 * max|ref| (issue 2).
inline constexpr double kModelLogitsRelToMax = 1e-4;
// GPU fp32 engine vs the fixtures (issue 4).
inline constexpr double kGpuModelLogitsRelToMax = 1e-3;
// bf16 engine, CUDA-graph decode vs eager decode: the captured attention plans its KV splits for the longest
// context, eager for this step's, so partial sums meet in another order and bf16 roundings of the attention
// output can differ by an ulp, which the following layers carry (a guess until measured; tokens must be equal).
inline constexpr double kGpuBf16GraphVsEagerRelToMax = 2e-2;
// GPU bf16 engine vs transformers run in bf16 on the GPU (logits_bf16_<p>.npy, teacher-forced positions; issue 4's
// bar): top-1 agreement >= kGpuBf16Top1Agreement over the decidable positions (the reference's top-2 margin above
// kGpuBf16TieMargin x its largest |logit|, about two bf16 steps at that magnitude: below it rounding noise on
// either side decides the order, and the bf16 reference even ties exactly), and the 90th percentile over
// positions of max|logit - ref| / max|ref| <= kGpuBf16LogitsRelToMax. Not the maximum: both sides round
// activations to bf16 in different places (Chimera keeps A_log, D, dt_bias and the router in fp32, fuses add +
// RMSNorm, sums in other orders), and where a router's top-k choice is a near-tie the two runs pick different
// experts and that position's logits move by O(1) (measured: see the test's printed max).
inline constexpr double kGpuBf16TieMargin = 1.0 / 64;
inline constexpr double kGpuBf16LogitsRelToMax = 0.05;
inline constexpr double kGpuBf16Top1Agreement = 0.99;
// super_like (LatentMoE, 16 experts top-3, groups, scale 2.5, correction bias std 0.5) does NOT meet the bar above
// over all decidable positions: measured on the H200 166 / 171 = 97.1 % and p90 0.071 (2026-11-30, unchanged
// 2026-12-01). The cause is its routers, not Chimera's bf16 arithmetic (measured 2026-12-01 on the H200 with
// scripts/bf16_layer_error.py): block by block, Chimera's bf16 output is as close to fp32 math on the same input as
// transformers' bf16 block is (local error median 1-5e-3 both, ours no larger in 14 of 18 blocks), and its
// residual stream stays closer to the fp32 one (median 1.2e-2 vs 1.3e-2 at the last MoE layer). But 49 of the 185
// positions have a top-3 selection margin (3rd vs 4th biased score, scores ~1) below 0.01 in some MoE layer, where
// either run's bf16 noise (~1 % of the router input after six layers) picks another expert set: in the three
// prompt prefills transformers bf16 flips 3 such choices against fp32 math and Chimera 5, at different positions
// (margins 0.0007-0.008), and a flipped row's logits move by up to 0.56 of max|logit|. All five of Chimera's
// decidable misses sit at positions whose router margin is below 0.01 (0.0004-0.008); on the 125 robust positions
// it agrees at every one (so does the CPU on bf16 weights, whose one decidable miss is transformers' flip).
// So both bf16 tests also measure the robust positions (decidable, and every router margin at that position >=
// kBf16RouterTieMargin, from router_margin_<p>.npy) and hold them to issue 4's 99 % on every fixture; the plain
// decidable rate of super_like keeps the bounds below, at the measured level, so a regression still fails.
inline constexpr double kBf16RouterTieMargin = 0.01;
inline constexpr double kGpuBf16Top1AgreementSuperLike = 0.97;
inline constexpr double kGpuBf16LogitsRelToMaxSuperLike = 0.08;
// The CPU backend on bf16 weights (fp32 math; models/nemotron_h_bf16_test.cpp) vs the same transformers bf16 logits,
// same measure: issue 4's bar for every fixture, super_like included. Measured 2026-11-30: all_kinds 171 / 171,
// p90 0.019; legacy_dense 163 / 163, p90 0.019; super_like 170 / 171 = 99.4 %, p90 0.026 (its one miss is a router
// near-tie in the last MoE layer; one more flip would fail the bar, see the super_like note above).
inline constexpr double kCpuBf16WeightsTop1Agreement = 0.99;
inline constexpr double kCpuBf16WeightsLogitsRelToMax = 0.05;

}  // namespace chimera::test
