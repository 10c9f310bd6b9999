// CPU reference of the NVFP4 routed experts (cuda::moe_experts_nvfp4's contract, moe/nvfp4_experts.h): every
// expert's weights dequantized exactly (core/nvfp4.h, weight_scale_2 from ExpertWeights::host_scale), then the fp32
// math of cpu::moe_experts (experts in increasing index order, fp32 throughout).
#pragma once

#include "core/tensor.h"
#include "ops/quant_weights.h"

namespace chimera::cpu {

// x, out: F32 [T, D] host; topk_ids I32 [T, k]; topk_weights F32 [T, k]; up / down: kNvfp4 ExpertWeights on the
// host (weight U8 [E, N, K / 2], weight_scale F8_E4M3 [E, N, K / 16], host_scale [E]). Bad shapes -> kInvalidInput
// naming the projection's tensor.
void moe_experts_nvfp4(const Tensor& out, const Tensor& x, const Tensor& topk_ids, const Tensor& topk_weights,
                       const ops::ExpertWeights& up, const ops::ExpertWeights& down);

// Expert e of a kNvfp4 ExpertWeights as an F32 [N, K] host tensor (exact).
Tensor dequantize_expert(const ops::ExpertWeights& w, int64_t e);

}  // namespace chimera::cpu
