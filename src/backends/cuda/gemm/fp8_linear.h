// FP8 (F8_E4M3, per-tensor scale) dense layers on CUDA, and the FP8 activation quantizers that feed them
// (docs/fp8_cuda.md has the semantics, the paths and how they are tested).
//
//   y [T, N] = x' @ (e4m3(weight) * w.scale)^T (+ bias)
//     w.act == ActQuant::kStatic: x' = e4m3(x / w.input_scale) * w.input_scale (saturated at +-448): W8A8
//     w.act == ActQuant::kDynamic: the same with s = max |x| / 448 over the whole x [T, K] in place of input_scale
//                                  (1 for zeros), computed on the device each call: W8A8 with a dynamic scale
//     w.act == ActQuant::kNone:   x' = x (weight-only dequantization)
//
// x, out (and bias) share one activation dtype: BF16, F16 or F32; accumulation is fp32 on every path. The paths
// (fp8_linear picks one; fp8_linear_with_path forces one for tests and benchmarks):
//   kGemv     decode sizes (1 <= T <= kFp8GemvMaxTokens, K % 16 == 0): a weight-streaming GEMV (16-byte loads of 16
//             weights), x staged in shared memory (kStatic: its e4m3 values, exact in f16), the scales applied once
//             to the fp32 sum.
//   kGemvMma  decode sizes with an e4m3 x (kStatic, kDynamic or prequantized), T >= kFp8GemvMmaMinTokens: the same
//             weight stream into FP8 tensor cores (mma.sync m16n8k32 e4m3, 16 rows x 8 tokens), no conversions; each 64-k
//             step's mma result is added to fp32 registers.
//   kGemm     prefill sizes, kStatic or kDynamic, 16-bit out: quantize_fp8 of x (kDynamic: a max-|x| pass first, the
//             scale left on the device for cuBLASLt's B scale pointer), then cuBLASLt's FP8 GEMM (E4M3 x E4M3, fp32
//             accumulation with fast accumulation off, alpha = input_scale * scale or scale, bf16 / f16 out). Needs
//             K % 16 == 0, N % 16 == 0 and 16-byte aligned pointers (cuBLASLt's FP8 rules).
//   kDequant  everything else (fp32 activations at prefill sizes, kNone at prefill sizes, K % 16 != 0, odd N):
//             the weight dequantized to F32 (e4m3 * scale, as the CPU reference does) and x' in F32, then the fp32
//             cuBLASLt GEMM (ops::linear's F32 path, never TF32), then the conversion to the output dtype. Correct,
//             not fast (it allocates and writes an F32 copy of the weight per call): for exact tests and odd shapes.
// The weight stays on the device as stored (F8_E4M3 [N, K], contiguous); the scales are the host floats of
// ops::LinearWeight.
#pragma once

#include <cstdint>

#include "ops/ops.h"
#include "ops/quant_weights.h"

namespace chimera::cuda {

constexpr int64_t kFp8GemvMaxTokens = 8;
// From this many tokens a W8A8 decode layer takes the tensor-core GEMV. At one token the CUDA-core GEMV (plain fp32
// FMAs) is as fast or faster on the widest of the models' shapes; from two tokens its e4m3 -> f32 conversions and
// per-token FMAs cost more than the tensor cores' truncating accumulation is worth (docs/perf.md, "Quantized
// layers").
constexpr int64_t kFp8GemvMmaMinTokens = 2;

enum class Fp8LinearPath : int8_t { kAuto, kGemv, kGemvMma, kGemm, kDequant };
const char* fp8_linear_path_name(Fp8LinearPath p);

// The path fp8_linear takes for these arguments (never kAuto).
Fp8LinearPath fp8_linear_path(const Tensor& out, const Tensor& x, const ops::LinearWeight& w, const Tensor& bias);

// out [T, N] = x' @ W^T (+ bias [N]); x [T, K]. w.format must be kFp8 (w.weight F8_E4M3 [N, K] on the device).
void fp8_linear(const ops::Context& ctx, const Tensor& out, const Tensor& x, const ops::LinearWeight& w,
                const Tensor& bias);
// As fp8_linear with xq F8_E4M3 [T, K] = e4m3(x / w.input_scale) already computed (a fused norm + quant kernel
// wrote it): out = (xq * w.input_scale) @ W^T (+ bias). w.act must be kStatic; out BF16 / F16 / F32. The GEMV at
// decode sizes, the FP8 GEMM otherwise (where its rules hold; else the dequantized fallback).
void fp8_linear_prequant(const ops::Context& ctx, const Tensor& out, const Tensor& xq, const ops::LinearWeight& w,
                         const Tensor& bias);

// The same with the path given (kAuto: the choice above). A path outside its domain throws naming the rule.
// fast_accum: the FP8 GEMM with cuBLASLt's fast accumulation (CUBLASLT_MATMUL_DESC_FAST_ACCUM) instead of the
// promoted fp32 accumulation (benchmarks only: the engine never sets it).
void fp8_linear_with_path(const ops::Context& ctx, const Tensor& out, const Tensor& x, const ops::LinearWeight& w,
                          const Tensor& bias, Fp8LinearPath path, bool fast_accum = false);
void fp8_linear_prequant_with_path(const ops::Context& ctx, const Tensor& out, const Tensor& xq,
                                   const ops::LinearWeight& w, const Tensor& bias, Fp8LinearPath path,
                                   bool fast_accum = false);

// out_q F8_E4M3 (same shape as x, both contiguous) = e4m3(x / input_scale), saturated at +-448, rounded to nearest
// even; x BF16 / F16 / F32. The division is IEEE (correctly rounded), so the codes equal core/fp8.h's
// f32_to_e4m3(x / input_scale) bit for bit on finite values and infinities (a NaN gives a NaN code).
void quantize_fp8(const ops::Context& ctx, const Tensor& out_q, const Tensor& x, float input_scale);

// ActQuant::kDynamic's quantizer: s = max |x| / 448 over all of x (1 for zeros; NaNs skipped), every element of
// scale_out (F32 [n] on the device, n >= 1: one copy per expert for the grouped kernels) = s, and, when out_q is
// defined, out_q (F8_E4M3 or U8, x's element count) = e4m3(x / s) as quantize_fp8 rounds. x BF16 / F16 / F32.
// Deterministic (no atomics): the same bits on every run.
void quantize_fp8_dynamic(const ops::Context& ctx, const Tensor& out_q, const Tensor& x, const Tensor& scale_out);

// residual += x (stored in the activation dtype, as ops::add_rms_norm), then
// out_q = e4m3(round_T(rms_norm(residual) * weight) / input_scale): the bits of add_rms_norm followed by
// quantize_fp8 of its output (the normalised row is rounded to the activation dtype T before the quantization,
// the value the unfused quantizer would read). residual, x [T, D]; out_q F8_E4M3 [T, D]; weight [D].
void add_rms_norm_fp8(const ops::Context& ctx, const Tensor& residual, const Tensor& out_q, const Tensor& x,
                      const Tensor& weight, float eps, float input_scale);
// Mamba's gated grouped RMSNorm (norm_before_gate = false, as ops::gated_rms_norm: u = y * silu(z) in fp32, not
// rounded; each group of D / n_groups channels normalised) then out_q = e4m3(round_T(normed * weight) / input_scale):
// the bits of gated_rms_norm followed by quantize_fp8. y, z [T, D]; out_q F8_E4M3 [T, D]; weight [D].
void gated_rms_norm_fp8(const ops::Context& ctx, const Tensor& out_q, const Tensor& y, const Tensor& z,
                        const Tensor& weight, int64_t n_groups, float eps, float input_scale);

}  // namespace chimera::cuda
