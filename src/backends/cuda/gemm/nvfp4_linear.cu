// NVFP4 dense layers (gemm/nvfp4_linear.h): checks, then the GEMV (decode) or the dequantizing mma.sync GEMM
// (prefill) of gemm/nvfp4_kernels.cuh.
#include "backends/cuda/gemm/nvfp4_linear.h"

#include <cmath>
#include <type_traits>

#include "backends/cuda/gemm/nvfp4_kernels.cuh"

namespace chimera::cuda {
namespace {

constexpr const char* kOp = "ops::nvfp4_linear";

bool aligned(const void* p, uintptr_t a) {
  return reinterpret_cast<uintptr_t>(p) % a == 0;
}

void check(const Tensor& out, const Tensor& x, const ops::LinearWeight& w, const Tensor& bias) {
  const std::string& name = w.name.empty() ? std::string("(unnamed)") : w.name;
  if (w.format != ops::WeightFormat::kNvfp4) {
    throw_runtime(str_cat(kOp, ": ", name, " is ", ops::weight_format_name(w.format), ", not nvfp4"));
  }
  if (!x || x.ndim() != 2 || x.device() != Device::kCuda) {
    throw_runtime(str_cat(kOp, ": x ", x ? x.describe() : std::string("(undefined)"), " must be a 2-D CUDA tensor"));
  }
  const int64_t K = x.dim(1);
  if (!w.weight || w.weight.dtype() != DType::kU8 || w.weight.ndim() != 2 || w.weight.dim(1) * 2 != K ||
      w.weight.device() != Device::kCuda) {
    throw_runtime(str_cat(kOp, ": ", name, ".weight ", w.weight ? w.weight.describe() : std::string("(undefined)"),
                          " must be a CUDA U8 [N, ", K / 2, "] for x ", x.describe()));
  }
  const int64_t N = w.weight.dim(0);
  if (K % 16 != 0) throw_runtime(str_cat(kOp, ": ", name, ": K = ", K, " is not a multiple of 16"));
  if (!w.weight_scale || w.weight_scale.dtype() != DType::kF8E4M3 || w.weight_scale.shape() != Shape{N, K / 16} ||
      w.weight_scale.device() != Device::kCuda) {
    throw_runtime(str_cat(kOp, ": ", name, ".weight_scale ",
                          w.weight_scale ? w.weight_scale.describe() : std::string("(undefined)"),
                          " must be a CUDA F8_E4M3 [", N, ", ", K / 16, "]"));
  }
  if (!std::isfinite(w.scale) || w.scale <= 0.0f) {
    throw_runtime(str_cat(kOp, ": ", name, ".weight_scale_2 ", w.scale, " is not a positive finite scale"));
  }
  if (x.dtype() != DType::kF32 && x.dtype() != DType::kBF16 && x.dtype() != DType::kF16) {
    throw_runtime(str_cat(kOp, ": x ", x.describe(), ": the activations must be F32, BF16 or F16"));
  }
  require_same_dtype(kOp, {{"x", &x}, {"out", &out}});
  if (out.shape() != Shape{x.dim(0), N} || out.device() != Device::kCuda) {
    throw_runtime(
        str_cat(kOp, ": out ", out.describe(), " must be a CUDA [", x.dim(0), ", ", N, "] for x ", x.describe()));
  }
  if (bias && (bias.shape() != Shape{N} || bias.dtype() != x.dtype() || bias.device() != Device::kCuda)) {
    throw_runtime(str_cat(kOp, ": bias ", bias.describe(), " must be a CUDA [", N, "] in the dtype of x"));
  }
  if (!aligned(x.data(), 16) || !aligned(w.weight.data(), 16) || !aligned(w.weight_scale.data(), 4)) {
    throw_runtime(str_cat(kOp, ": x, ", name, ".weight (16 bytes) and .weight_scale (4 bytes) must be aligned"));
  }
  if (N >= (int64_t{1} << 31) || K >= (int64_t{1} << 30) || x.dim(0) >= (int64_t{1} << 31)) {
    throw_runtime(str_cat(kOp, ": x ", x.describe(), " @ ", name, " is too large"));
  }
}

template <typename T>
void run(const nvfp4::Params& p, Nvfp4Path path, cudaStream_t stream) {
  if constexpr (!std::is_same_v<T, float>) {
    if (path == Nvfp4Path::kGemm) {
      return nvfp4::launch_gemm<T, nvfp4::Mode::kDense>(p, ceil_div(p.T, nvfp4::kMmaBT), stream, kOp);
    }
    if (path == Nvfp4Path::kGemvTc) {
      return nvfp4::launch_tc_gemv<T, nvfp4::Mode::kDense>(p, ceil_div(p.T, nvfp4::kTcTokens), stream, kOp);
    }
  }
  {
    const int mt = nvfp4::gemv_tile_tokens(p.T);
    nvfp4::launch_gemv<T, nvfp4::Mode::kDense>(p, mt, ceil_div(p.T, mt), stream, kOp);
  }
}

}  // namespace

bool nvfp4_gemv_tc_supported(DType x_dtype, int64_t K) {
  return (x_dtype == DType::kBF16 || x_dtype == DType::kF16) && K > 0 && K % 32 == 0;
}

bool nvfp4_gemm_supported(DType x_dtype, int64_t K) {
  return (x_dtype == DType::kBF16 || x_dtype == DType::kF16) && K > 0 && K % nvfp4::kMmaBK == 0;
}

void nvfp4_linear(const ops::Context& ctx, const Tensor& out, const Tensor& x, const ops::LinearWeight& w,
                  const Tensor& bias) {
  nvfp4_linear_on_path(ctx, out, x, w, bias, Nvfp4Path::kAuto);
}

void nvfp4_linear_on_path(const ops::Context& ctx, const Tensor& out, const Tensor& x, const ops::LinearWeight& w,
                          const Tensor& bias, Nvfp4Path path) {
  check(out, x, w, bias);
  const int64_t T = x.dim(0), K = x.dim(1), N = w.weight.dim(0);
  if (T == 0 || N == 0) return;
  const bool gemm_ok = nvfp4_gemm_supported(x.dtype(), K);
  if (path == Nvfp4Path::kGemm && !gemm_ok) {
    throw_runtime(str_cat(kOp, ": the GEMM path does not take x ", x.describe(), " (BF16 / F16, K % 64 == 0)"));
  }
  if (path == Nvfp4Path::kGemvTc && !nvfp4_gemv_tc_supported(x.dtype(), K)) {
    throw_runtime(str_cat(kOp, ": the tensor-core GEMV does not take x ", x.describe(), " (BF16 / F16, K % 32 == 0)"));
  }
  if (path == Nvfp4Path::kAuto) {
    path = gemm_ok && T > kNvfp4GemvMaxTokens                               ? Nvfp4Path::kGemm
           : kNvfp4GemvTensorCores && nvfp4_gemv_tc_supported(x.dtype(), K) ? Nvfp4Path::kGemvTc
                                                                            : Nvfp4Path::kGemv;
  }
  if (path != Nvfp4Path::kGemm && ceil_div(T, nvfp4::gemv_tile_tokens(T)) > 65535) {
    throw_runtime(str_cat(kOp, ": ", T, " tokens exceed the GEMV's token groups"));
  }
  nvfp4::Params p;
  p.w = static_cast<const uint8_t*>(w.weight.data());
  p.ws = static_cast<const uint8_t*>(w.weight_scale.data());
  p.scale2 = w.scale;
  p.x = x.data();
  p.out = out.data();
  p.bias = bias ? bias.data() : nullptr;
  p.T = static_cast<int>(T);
  p.N = static_cast<int>(N);
  p.K = static_cast<int>(K);
  CHIMERA_DISPATCH_FLOAT(x.dtype(), kOp, U, run<U>(p, path, as_stream(ctx.stream)));
}

}  // namespace chimera::cuda
