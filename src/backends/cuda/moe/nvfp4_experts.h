// NVFP4 routed experts on CUDA (docs/nvfp4_cuda.md): out[t] = sum_j w[t, j] * down_e(relu(up_e(x[t]))^2),
// e = topk_ids[t, j], with the experts' weights as ModelOpt stores them (ops::ExpertWeights, WeightFormat::kNvfp4:
// U8 [E, N, K / 2] codes, F8_E4M3 [E, N, K / 16] block scales, F32 [E] weight_scale_2 in `scale` on the device)
// dequantized inside the grouped kernels; the activations are not quantized (weight-only).
//   x, out: [T, D] on the device, one dtype (F32, BF16, F16), 16-byte aligned; topk_ids I32 [T, k]; topk_weights
//   F32 [T, k]; up: [E, I, D / 2] codes, down: [E, D, I / 2] codes.
// The launches (stream-ordered, no host synchronisation): the permutation of the bf16 path (moe_kernels.h), the
// grouped up projection with relu^2 (the intermediate h [T * k, I] rounded to the activation dtype once, after
// relu(acc)^2 in fp32, as grouped_gemm_mma.cu; fp32 for F32 activations), the grouped down projection times the
// routing weight into fp32 rows, and the deterministic combine (increasing expert order per token).
// Kernels (gemm/nvfp4_linear.h's choice): at T <= kNvfp4GemvMaxTokens the grouped tensor-core GEMV (BF16 / F16, D
// and I multiples of 32; kNvfp4GemvTensorCores) or the grouped SIMT GEMV (one warp per weight row; also F32
// activations at any T), items of <= 8 tokens; above, the dequantizing mma.sync GEMM (items of <= 64 rows) for BF16 /
// F16 with D and I multiples of 64.
#pragma once

#include "core/tensor.h"
#include "ops/ops.h"
#include "ops/quant_weights.h"

namespace chimera::cuda {

void moe_experts_nvfp4(const ops::Context& ctx, const Tensor& out, const Tensor& x, const Tensor& topk_ids,
                       const Tensor& topk_weights, const ops::ExpertWeights& up, const ops::ExpertWeights& down);

// Tests and benchmarks: a forced kernel (as gemm/nvfp4_linear.h's Nvfp4Path; outside its domain it throws).
enum class Nvfp4ExpertsPath { kAuto, kGemv, kGemvTc, kGemm };
void moe_experts_nvfp4_on_path(const ops::Context& ctx, const Tensor& out, const Tensor& x, const Tensor& topk_ids,
                               const Tensor& topk_weights, const ops::ExpertWeights& up, const ops::ExpertWeights& down,
                               Nvfp4ExpertsPath path);

}  // namespace chimera::cuda
