// NVFP4 routed experts (moe/nvfp4_experts.h): permutation -> grouped up (relu^2) -> grouped down (x routing weight)
// -> combine, the launches of the bf16 path (experts.cu) with the dequantizing kernels of gemm/nvfp4_kernels.cuh.
#include "backends/cuda/moe/nvfp4_experts.h"

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "backends/cuda/gemm/nvfp4_kernels.cuh"
#include "backends/cuda/gemm/nvfp4_linear.h"
#include "backends/cuda/moe/moe_kernels.h"
#include "backends/device_api.h"

namespace chimera::cuda {
namespace {

constexpr const char* kOp = "ops::moe_experts (nvfp4)";

bool aligned(const void* p, uintptr_t a) {
  return reinterpret_cast<uintptr_t>(p) % a == 0;
}

// One projection's buffers: codes U8 [E, N, K / 2], scales F8_E4M3 [E, N, K / 16], scale F32 [E], on the device.
void check_projection(const char* which, const ops::ExpertWeights& w, int64_t E, int64_t N, int64_t K) {
  const std::string name = w.name.empty() ? std::string(which) : w.name;
  if (w.format != ops::WeightFormat::kNvfp4) {
    throw_runtime(str_cat(kOp, ": ", name, " is ", ops::weight_format_name(w.format), ", not nvfp4"));
  }
  const auto bad = [&](const char* tensor, const Tensor& t, const std::string& want) {
    throw_runtime(str_cat(kOp, ": ", name, ".", tensor, " ", t ? t.describe() : std::string("(undefined)"),
                          " must be a CUDA ", want));
  };
  if (!w.weight || w.weight.dtype() != DType::kU8 || w.weight.shape() != Shape{E, N, K / 2} ||
      w.weight.device() != Device::kCuda) {
    bad("weight", w.weight, str_cat("U8 [", E, ", ", N, ", ", K / 2, "]"));
  }
  if (!w.weight_scale || w.weight_scale.dtype() != DType::kF8E4M3 || w.weight_scale.shape() != Shape{E, N, K / 16} ||
      w.weight_scale.device() != Device::kCuda) {
    bad("weight_scale", w.weight_scale, str_cat("F8_E4M3 [", E, ", ", N, ", ", K / 16, "]"));
  }
  if (!w.scale || w.scale.dtype() != DType::kF32 || w.scale.numel() != E || w.scale.device() != Device::kCuda) {
    bad("weight_scale_2", w.scale, str_cat("F32 [", E, "]"));
  }
  if (!aligned(w.weight.data(), 16) || !aligned(w.weight_scale.data(), 4)) {
    throw_runtime(str_cat(kOp, ": ", name, ".weight (16 bytes) and .weight_scale (4 bytes) must be aligned"));
  }
}

nvfp4::Params projection_params(const ops::ExpertWeights& w, const void* x, void* out, int N, int K,
                                const moe::PermuteParams& pp, const float* topk_weights, int top_k) {
  nvfp4::Params p;
  p.w = static_cast<const uint8_t*>(w.weight.data());
  p.ws = static_cast<const uint8_t*>(w.weight_scale.data());
  p.w_stride = static_cast<int64_t>(N) * (K / 2);
  p.s_stride = static_cast<int64_t>(N) * (K / 16);
  p.expert_scale2 = w.scale.data_as<float>();
  p.x = x;
  p.out = out;
  p.N = N;
  p.K = K;
  p.sorted_pair = pp.sorted_pair;
  p.items = pp.items;
  p.n_items = pp.n_items;
  p.topk_weights = topk_weights;
  p.top_k = top_k;
  return p;
}

template <typename T>
void run(const nvfp4::Params& up, const nvfp4::Params& down, Nvfp4ExpertsPath path, int tile_rows, int groups,
         cudaStream_t stream) {
  if constexpr (!std::is_same_v<T, float>) {
    if (path == Nvfp4ExpertsPath::kGemm) {
      nvfp4::launch_gemm<T, nvfp4::Mode::kUp>(up, groups, stream, kOp);
      nvfp4::launch_gemm<T, nvfp4::Mode::kDown>(down, groups, stream, kOp);
      return;
    }
    if (path == Nvfp4ExpertsPath::kGemvTc) {
      nvfp4::launch_tc_gemv<T, nvfp4::Mode::kUp>(up, groups, stream, kOp);
      nvfp4::launch_tc_gemv<T, nvfp4::Mode::kDown>(down, groups, stream, kOp);
      return;
    }
  }
  nvfp4::launch_gemv<T, nvfp4::Mode::kUp>(up, tile_rows, groups, stream, kOp);
  nvfp4::launch_gemv<T, nvfp4::Mode::kDown>(down, tile_rows, groups, stream, kOp);
}

}  // namespace

void moe_experts_nvfp4(const ops::Context& ctx, const Tensor& out, const Tensor& x, const Tensor& topk_ids,
                       const Tensor& topk_weights, const ops::ExpertWeights& up, const ops::ExpertWeights& down) {
  moe_experts_nvfp4_on_path(ctx, out, x, topk_ids, topk_weights, up, down, Nvfp4ExpertsPath::kAuto);
}

void moe_experts_nvfp4_on_path(const ops::Context& ctx, const Tensor& out, const Tensor& x, const Tensor& topk_ids,
                               const Tensor& topk_weights, const ops::ExpertWeights& up, const ops::ExpertWeights& down,
                               Nvfp4ExpertsPath path) {
  if (!x || x.ndim() != 2 || x.device() != Device::kCuda) {
    throw_runtime(str_cat(kOp, ": x ", x ? x.describe() : std::string("(undefined)"), " must be a 2-D CUDA tensor"));
  }
  if (x.dtype() != DType::kF32 && x.dtype() != DType::kBF16 && x.dtype() != DType::kF16) {
    throw_runtime(str_cat(kOp, ": x ", x.describe(), ": the activations must be F32, BF16 or F16"));
  }
  const int64_t T = x.dim(0), D = x.dim(1);
  if (!up.weight || up.weight.ndim() != 3) {
    throw_runtime(str_cat(kOp, ": up_proj weight ", up.weight ? up.weight.describe() : std::string("(undefined)"),
                          " must be U8 [E, I, D / 2]"));
  }
  const int64_t E = up.weight.dim(0), I = up.weight.dim(1);
  if (D % 16 != 0 || I % 16 != 0) {
    throw_runtime(str_cat(kOp, ": D = ", D, " and I = ", I, " must be multiples of 16 (NVFP4 blocks)"));
  }
  check_projection("up_proj", up, E, I, D);
  check_projection("down_proj", down, E, D, I);
  require_same_dtype(kOp, {{"x", &x}, {"out", &out}});
  if (out.shape() != x.shape() || out.device() != Device::kCuda) {
    throw_runtime(str_cat(kOp, ": out ", out.describe(), " must be a CUDA tensor shaped as x ", x.describe()));
  }
  if (!topk_ids || topk_ids.dtype() != DType::kI32 || topk_ids.ndim() != 2 || topk_ids.dim(0) != T ||
      topk_ids.device() != Device::kCuda) {
    throw_runtime(str_cat(kOp, ": topk_ids ", topk_ids ? topk_ids.describe() : std::string("(undefined)"),
                          " must be a CUDA I32 [", T, ", k]"));
  }
  const int64_t k = topk_ids.dim(1);
  if (!topk_weights || topk_weights.dtype() != DType::kF32 || topk_weights.shape() != topk_ids.shape() ||
      topk_weights.device() != Device::kCuda) {
    throw_runtime(str_cat(kOp, ": topk_weights ", topk_weights ? topk_weights.describe() : std::string("(undefined)"),
                          " must be a CUDA F32 [", T, ", ", k, "]"));
  }
  if (E < 1 || E > moe::kPermuteMaxExperts || k < 1 || k > 32) {
    throw_runtime(str_cat(kOp, ": ", E, " experts / top-", k,
                          " is not supported on CUDA (E <= ", moe::kPermuteMaxExperts, ", k <= 32)"));
  }
  if (!aligned(x.data(), 16) || !aligned(out.data(), 16)) {
    throw_runtime(str_cat(kOp, ": x and out must be 16-byte aligned"));
  }
  if (T == 0) return;
  const int64_t P = T * k;
  if (P > (int64_t{1} << 30) || P * std::max(D, I) > (int64_t{1} << 40) || E * I * D >= (int64_t{1} << 40)) {
    throw_runtime(str_cat(kOp, ": ", T, " tokens x top-", k, " is too large"));
  }
  const bool gemm_ok = nvfp4_gemm_supported(x.dtype(), D) && nvfp4_gemm_supported(x.dtype(), I);
  if (path == Nvfp4ExpertsPath::kGemm && !gemm_ok) {
    throw_runtime(str_cat(kOp, ": the GEMM path does not take x ", x.describe(), " with I = ", I,
                          " (BF16 / F16, D and I multiples of 64)"));
  }
  if (path == Nvfp4ExpertsPath::kGemvTc &&
      !(nvfp4_gemv_tc_supported(x.dtype(), D) && nvfp4_gemv_tc_supported(x.dtype(), I))) {
    throw_runtime(str_cat(kOp, ": the tensor-core GEMV does not take x ", x.describe(), " with I = ", I,
                          " (BF16 / F16, D and I multiples of 32)"));
  }
  if (path == Nvfp4ExpertsPath::kAuto) {
    const bool tc_ok = nvfp4_gemv_tc_supported(x.dtype(), D) && nvfp4_gemv_tc_supported(x.dtype(), I);
    path = gemm_ok && T > kNvfp4GemvMaxTokens ? Nvfp4ExpertsPath::kGemm
           : kNvfp4GemvTensorCores && tc_ok   ? Nvfp4ExpertsPath::kGemvTc
                                              : Nvfp4ExpertsPath::kGemv;
  }
  // Work items of <= tile_rows pairs of one expert: at most P / tile_rows + active experts of them, and <= P.
  const int tile_rows = path == Nvfp4ExpertsPath::kGemm     ? nvfp4::kMmaBT
                        : path == Nvfp4ExpertsPath::kGemvTc ? nvfp4::kTcTokens
                                                            : nvfp4::gemv_tile_tokens(std::min<int64_t>(T, 8));
  const int64_t max_items = std::min<int64_t>(P, (P + tile_rows - 1) / tile_rows + std::min<int64_t>(E, P));
  if (max_items > 65535) throw_runtime(str_cat(kOp, ": ", max_items, " work items exceed one grid dimension"));
  cudaStream_t stream = as_stream(ctx.stream);

  Tensor meta = device::empty(Device::kCuda, DType::kI32, {P + 8 + 4 * max_items});
  Tensor h = device::empty(Device::kCuda, x.dtype(), {P, I});
  Tensor y = device::empty(Device::kCuda, DType::kF32, {P, D});
  moe::PermuteParams pp{};
  pp.topk_ids = topk_ids.data_as<int32_t>();
  pp.P = static_cast<int>(P);
  pp.E = static_cast<int>(E);
  pp.tile_rows = tile_rows;
  pp.sorted_pair = meta.data_as<int32_t>();
  pp.n_items = pp.sorted_pair + P;
  pp.items = reinterpret_cast<int4*>(meta.data_as<int32_t>() + ((P + 4 + 3) / 4) * 4);  // 16-byte aligned
  moe::launch_moe_permute(pp, stream);

  const float* tw = topk_weights.data_as<float>();
  nvfp4::Params pu =
      projection_params(up, x.data(), h.data(), static_cast<int>(I), static_cast<int>(D), pp, tw, static_cast<int>(k));
  nvfp4::Params pd = projection_params(down, h.data(), y.data(), static_cast<int>(D), static_cast<int>(I), pp, tw,
                                       static_cast<int>(k));
  pu.T = pd.T = static_cast<int>(T);
  CHIMERA_DISPATCH_FLOAT(x.dtype(), kOp, U, run<U>(pu, pd, path, tile_rows, static_cast<int>(max_items), stream));

  moe::CombineParams cp{};
  cp.y = y.data_as<float>();
  cp.topk_ids = topk_ids.data_as<int32_t>();
  cp.out = out.data();
  cp.T = static_cast<int>(T);
  cp.k = static_cast<int>(k);
  cp.D = static_cast<int>(D);
  cp.E = static_cast<int>(E);
  cp.out_dtype = out.dtype();
  moe::launch_moe_combine(cp, stream);
}

}  // namespace chimera::cuda
