// NVFP4 dense layers on CUDA (docs/nvfp4_cuda.md): y[T, N] = x[T, K] @ W^T (+ bias) with W stored as ModelOpt
// exports it (ops::LinearWeight, WeightFormat::kNvfp4) and dequantized inside the kernels; the activations are not
// quantized (weight-only, the `wo` semantics of docs/quantization.md).
//   x, out: [T, K] / [T, N] on the device, one dtype: F32, BF16 or F16, 16-byte aligned; bias: [N] in that dtype or
//   undefined; w.weight U8 [N, K / 2], w.weight_scale F8_E4M3 [N, K / 16] on the device, w.scale = weight_scale_2.
// fp32 accumulation, one rounding to the activation dtype at the store.
#pragma once

#include "core/tensor.h"
#include "ops/ops.h"
#include "ops/quant_weights.h"

namespace chimera::cuda {

// At or below this many tokens a GEMV runs (a weight-streaming kernel); above it the mma.sync GEMM where its domain
// holds (BF16 / F16 activations, K % 64 == 0), else the GEMV over token groups of 8.
inline constexpr int64_t kNvfp4GemvMaxTokens = 8;
// Which GEMV the automatic choice takes where both apply (BF16 / F16, K % 32 == 0): the tensor-core one (true) or the
// SIMT one (false). F32 activations and K % 32 != 0 always take the SIMT GEMV.
inline constexpr bool kNvfp4GemvTensorCores = true;

void nvfp4_linear(const ops::Context& ctx, const Tensor& out, const Tensor& x, const ops::LinearWeight& w,
                  const Tensor& bias);

// Tests and benchmarks: the same op on a forced kernel. kGemv: the SIMT GEMV (any T, token groups of <= 8);
// kGemvTc: the tensor-core GEMV (the same, BF16 / F16 and K % 32 == 0; nvfp4_kernels.cuh says why it exists);
// kGemm: the prefill GEMM. A kernel outside its domain throws.
enum class Nvfp4Path { kAuto, kGemv, kGemvTc, kGemm };
void nvfp4_linear_on_path(const ops::Context& ctx, const Tensor& out, const Tensor& x, const ops::LinearWeight& w,
                          const Tensor& bias, Nvfp4Path path);
// Whether the GEMM / the tensor-core GEMV take x (dtype, K).
bool nvfp4_gemm_supported(DType x_dtype, int64_t K);
bool nvfp4_gemv_tc_supported(DType x_dtype, int64_t K);

}  // namespace chimera::cuda
