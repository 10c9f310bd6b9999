// cuda::moe_experts_fp8 (fp8_experts.h): checks, the path choice, the workspace, and the launch sequence
//   permute (launch_moe_permute) -> up -> down -> combine (launch_moe_combine)
// on either kernel family of fp8_moe_kernels.h. Stream-ordered, no host synchronisation: graph-capturable.
#include "backends/cuda/moe/fp8_experts.h"

#include <algorithm>
#include <cstdint>

#include "backends/cpu/fp8_experts.h"
#include "backends/cuda/cuda_common.cuh"
#include "backends/cuda/gemm/fp8_linear.h"
#include "backends/cuda/moe/experts.h"
#include "backends/cuda/moe/fp8_moe_kernels.h"
#include "backends/cuda/moe/moe_kernels.h"
#include "backends/device_api.h"

namespace chimera::cuda {
namespace {

bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

// Tokens per GEMV work item: 1, 2, 4 or 8 (at most T, since a token picks an expert once), halved until the staged
// rows fit.
int fp8_gemv_tile_rows(int64_t T, int64_t max_k, DType act) {
  int nt = T <= 1 ? 1 : T <= 2 ? 2 : T <= 4 ? 4 : moe::kFp8GemvMaxTileRows;
  while (nt > 1 && static_cast<size_t>(nt) * static_cast<size_t>(max_k) * dtype_size(act) > moe::kFp8GemvMaxSmemBytes) {
    nt /= 2;
  }
  return nt;
}

const float* f32_ptr(const Tensor& t) {
  return t ? t.data_as<float>() : nullptr;
}

}  // namespace

void moe_experts_fp8(const ops::Context& ctx, const Tensor& out, const Tensor& x, const Tensor& topk_ids,
                     const Tensor& topk_weights, const ops::ExpertWeights& up, const ops::ExpertWeights& down) {
  moe::moe_experts_fp8_on_path(ctx, out, x, topk_ids, topk_weights, up, down, moe::Fp8ExpertsPath::kAuto);
}

namespace moe {

void moe_experts_fp8_on_path(const ops::Context& ctx, const Tensor& out, const Tensor& x, const Tensor& topk_ids,
                             const Tensor& topk_weights, const ops::ExpertWeights& up, const ops::ExpertWeights& down,
                             Fp8ExpertsPath path) {
  constexpr const char* kOp = "cuda::moe_experts_fp8";
  cpu::check_fp8_experts(kOp, x, topk_ids, topk_weights, up, down);
  const DType act = x.dtype();
  if (act != DType::kF32 && act != DType::kBF16 && act != DType::kF16) {
    throw Error(ErrorKind::kInvalidInput, str_cat(kOp, ": x ", x.describe(), " must be F32, BF16 or F16"));
  }
  if (out.dtype() != act || out.shape() != x.shape()) {
    throw Error(ErrorKind::kInvalidInput, str_cat(kOp, ": out ", out.describe(), " must match x ", x.describe()));
  }
  for (const Tensor* t : {&out, &x, &topk_ids, &topk_weights, &up.weight, &down.weight, &up.scale, &down.scale}) {
    if (t->device() != Device::kCuda) {
      throw Error(ErrorKind::kInvalidInput, str_cat(kOp, ": ", t->describe(), " is not on the CUDA device"));
    }
  }
  for (const ops::ExpertWeights* w : {&up, &down}) {
    if (w->act == ops::ActQuant::kStatic && w->input_scale.device() != Device::kCuda) {
      throw Error(ErrorKind::kInvalidInput, str_cat(kOp, ": ", w->name, ".input_scale is not on the CUDA device"));
    }
  }
  const int64_t T = x.dim(0), D = x.dim(1), k = topk_ids.dim(1);
  const int64_t E = up.num_experts(), I = up.out_features();
  if (E > kPermuteMaxExperts || k > 32) {
    throw_runtime(
        str_cat(kOp, ": ", E, " experts / top-", k, " is not supported (E <= ", kPermuteMaxExperts, ", k <= 32)"));
  }
  const int64_t P = T * k;
  if (P > (int64_t{1} << 30) || P * std::max(D, I) > (int64_t{1} << 40)) {
    throw_runtime(str_cat(kOp, ": ", T, " tokens x top-", k, " is too large"));
  }
  // W8A8 with a static (per-expert input_scale) or a dynamic (one per-tensor scale computed here) activation scale.
  const bool up_q = up.act != ops::ActQuant::kNone, down_q = down.act != ops::ActQuant::kNone;
  const bool up_dyn = up.act == ops::ActQuant::kDynamic, down_dyn = down.act == ops::ActQuant::kDynamic;
  // The CUTLASS FP8 grouped GEMM's domain: W8A8 on both projections, bf16 activations, 16-byte TMA rows.
  const bool cutlass_ok = cutlass_built() && up_q && down_q && act == DType::kBF16 && D % 16 == 0 && I % 16 == 0 &&
                          aligned16(up.weight.data()) && aligned16(down.weight.data()) && aligned16(x.data());
  if (path == Fp8ExpertsPath::kAuto) {
    // KernelConfig::moe_cutlass switches the CUTLASS experts off for both weight formats.
    path = cutlass_ok && ctx.kernels.moe_cutlass && T >= kFp8CutlassMinTokens ? Fp8ExpertsPath::kCutlass
                                                                              : Fp8ExpertsPath::kGemv;
  } else if (path == Fp8ExpertsPath::kCutlass && !cutlass_ok) {
    throw_runtime(str_cat(kOp, ": the cutlass path ",
                          cutlass_built() ? "takes W8A8 experts, BF16 x, D and I multiples of 16 (x "
                                          : "is not built (cmake -DCHIMERA_CUTLASS=ON); x ",
                          x.describe(), ", D ", D, ", I ", I, ", up ", ops::act_quant_name(up.act), ", down ",
                          ops::act_quant_name(down.act), ")"));
  }
  if (T == 0) return;
  cudaStream_t stream = as_stream(ctx.stream);
  const bool use_cutlass = path == Fp8ExpertsPath::kCutlass;
  const int64_t active_bound = std::min<int64_t>(E, P);
  const int tile_rows = use_cutlass ? static_cast<int>(P) : fp8_gemv_tile_rows(T, std::max(D, I), act);
  const int64_t max_items =
      use_cutlass ? active_bound : std::min<int64_t>(P, (P + tile_rows - 1) / tile_rows + active_bound);

  Tensor meta = device::empty(Device::kCuda, DType::kI32, {P + 8 + 4 * max_items});
  int32_t* sorted_pair = meta.data_as<int32_t>();
  int32_t* n_items = sorted_pair + P;
  int4* items = reinterpret_cast<int4*>(meta.data_as<int32_t>() + ((P + 4 + 3) / 4) * 4);
  PermuteParams pp{};
  pp.topk_ids = topk_ids.data_as<int32_t>();
  pp.P = static_cast<int>(P);
  pp.E = static_cast<int>(E);
  pp.tile_rows = tile_rows;
  pp.sorted_pair = sorted_pair;
  pp.items = items;
  pp.n_items = n_items;
  launch_moe_permute(pp, stream);

  Tensor y = device::empty(Device::kCuda, DType::kF32, {P, D});
  Tensor pair_row;
  // Dynamic scales, one copy per expert so that the kernels read them where they read per-expert input scales:
  // x's now; r's (down) once the up projection has written r in the activation dtype.
  // The persistent GEMV (every model's decode shape) computes dynamic scales itself; the other two paths read them
  // from up_in / down_in like static ones.
  const bool persistent =
      !use_cutlass && (act == DType::kBF16 || act == DType::kF16) && D % 16 == 0 && I % 16 == 0 &&
      aligned16(up.weight.data()) && aligned16(down.weight.data()) && aligned16(x.data()) &&
      static_cast<size_t>(tile_rows) * static_cast<size_t>(std::max(D, I)) * 2 <= kFp8GemvMaxSmemBytes;
  const Tensor up_in = up_dyn && !persistent ? device::empty(Device::kCuda, DType::kF32, {E}) : up.input_scale;
  const Tensor down_in = down_dyn && !persistent ? device::empty(Device::kCuda, DType::kF32, {E}) : down.input_scale;
  if (up_dyn && !persistent) quantize_fp8_dynamic(ctx, Tensor(), x, up_in);
  // The work list and routing fields both GEMV params structs share.
  auto set_work_list = [&](auto& g) {
    g.sorted_pair = sorted_pair;
    g.items = items;
    g.n_items = n_items;
    g.topk_weights = topk_weights.data_as<float>();
    g.top_k = static_cast<int>(k);
    g.max_items = static_cast<int>(max_items);
    g.tile_rows = tile_rows;
  };
  auto gemv_act = [](ops::ActQuant a) {
    return a == ops::ActQuant::kStatic    ? Fp8GemvAct::kStatic
           : a == ops::ActQuant::kDynamic ? Fp8GemvAct::kDynamic
                                          : Fp8GemvAct::kNone;
  };
  if (persistent) {
    // h: r in the activation dtype; with a dynamic down scale the up launch also writes its blocks' maxima of r.
    Tensor h = device::empty(Device::kCuda, act, {P, I});
    const int up_grid = fp8_persistent_gemv_grid(static_cast<int>(I), static_cast<int>(max_items));
    const Tensor amax = down_dyn ? device::empty(Device::kCuda, DType::kF32, {up_grid}) : Tensor();
    Fp8PersistentGemvParams g{};
    set_work_list(g);
    Fp8PersistentGemvParams gu = g;
    gu.weight = static_cast<const uint8_t*>(up.weight.data());
    gu.w_scale = f32_ptr(up.scale);
    gu.act = gemv_act(up.act);
    gu.in_scale = up.act == ops::ActQuant::kStatic ? f32_ptr(up.input_scale) : nullptr;
    gu.x = x.data();
    gu.out = h.data();
    gu.amax_out = down_dyn ? amax.data_as<float>() : nullptr;
    gu.T = static_cast<int>(T);
    gu.N = static_cast<int>(I);
    gu.K = static_cast<int>(D);
    gu.up = true;
    Fp8PersistentGemvParams gd = g;
    gd.weight = static_cast<const uint8_t*>(down.weight.data());
    gd.w_scale = f32_ptr(down.scale);
    gd.act = gemv_act(down.act);
    gd.in_scale = down.act == ops::ActQuant::kStatic ? f32_ptr(down.input_scale) : nullptr;
    gd.amax_in = down_dyn ? amax.data_as<float>() : nullptr;
    gd.amax_count = up_grid;
    gd.x = h.data();
    gd.out = y.data();
    gd.N = static_cast<int>(D);
    gd.K = static_cast<int>(I);
    gd.up = false;
    launch_moe_fp8_gemv_persistent(gu, act, stream);
    launch_moe_fp8_gemv_persistent(gd, act, stream);
  } else if (use_cutlass) {
    Tensor xq = device::empty(Device::kCuda, DType::kU8, {P, D});
    Tensor hq = device::empty(Device::kCuda, DType::kU8, {P, I});
    const Tensor hb = down_dyn ? device::empty(Device::kCuda, DType::kBF16, {P, I}) : Tensor();
    pair_row = device::empty(Device::kCuda, DType::kI32, {P});
#ifdef CHIMERA_HAVE_CUTLASS
    const size_t ws_bytes = fp8_cutlass_workspace_bytes(static_cast<int>(max_items));
#else
    const size_t ws_bytes = 16;  // not reached: cutlass_ok is false without CUTLASS
#endif
    Tensor ws = device::empty(Device::kCuda, DType::kU8, {static_cast<int64_t>(ws_bytes)});
    [[maybe_unused]] Fp8CutlassParams c{};  // unused in a build without CUTLASS (cutlass_ok is false there)
    c.up_weight = static_cast<const uint8_t*>(up.weight.data());
    c.down_weight = static_cast<const uint8_t*>(down.weight.data());
    c.up_scale = f32_ptr(up.scale);
    c.up_in_scale = f32_ptr(up_in);
    c.down_scale = f32_ptr(down.scale);
    c.down_in_scale = f32_ptr(down_in);
    c.hb = hb ? hb.data() : nullptr;
    c.x = x.data();
    c.sorted_pair = sorted_pair;
    c.items = items;
    c.n_items = n_items;
    c.P = static_cast<int>(P);
    c.top_k = static_cast<int>(k);
    c.D = static_cast<int>(D);
    c.I = static_cast<int>(I);
    c.E = static_cast<int>(E);
    c.groups = static_cast<int>(max_items);
    c.xq = static_cast<uint8_t*>(xq.data());
    c.hq = static_cast<uint8_t*>(hq.data());
    c.yp = y.data_as<float>();
    c.pair_row = pair_row.data_as<int32_t>();
#ifdef CHIMERA_HAVE_CUTLASS
    launch_moe_fp8_cutlass_up(c, ws.data(), ws_bytes, stream);
    if (down_dyn) quantize_fp8_dynamic(ctx, hq, hb, down_in);  // r (bf16) -> its codes and scale
    launch_moe_fp8_cutlass_down(c, ws.data(), ws_bytes, stream);
#endif
  } else {
    // h: e4m3 codes when the down projection quantizes its input with a static scale, else r in the activation
    // dtype (a dynamic scale is r's own: hq gets the codes after the up projection).
    Tensor h = device::empty(Device::kCuda, down_q && !down_dyn ? DType::kU8 : act, {P, I});
    const Tensor hq = down_dyn ? device::empty(Device::kCuda, DType::kU8, {P, I}) : h;
    Fp8GemvParams g{};
    set_work_list(g);
    Fp8GemvParams gu = g;
    gu.weight = static_cast<const uint8_t*>(up.weight.data());
    gu.w_scale = f32_ptr(up.scale);
    gu.in_scale = up_q ? f32_ptr(up_in) : nullptr;
    gu.out_scale = down_q && !down_dyn ? f32_ptr(down.input_scale) : nullptr;
    gu.x = x.data();
    gu.out = h.data();
    gu.N = static_cast<int>(I);
    gu.K = static_cast<int>(D);
    gu.up = true;
    Fp8GemvParams gd = g;
    gd.weight = static_cast<const uint8_t*>(down.weight.data());
    gd.w_scale = f32_ptr(down.scale);
    gd.in_scale = down_q ? f32_ptr(down_in) : nullptr;
    gd.x = hq.data();
    gd.out = y.data();
    gd.N = static_cast<int>(D);
    gd.K = static_cast<int>(I);
    gd.up = false;
    launch_moe_fp8_gemv(gu, act, stream);
    if (down_dyn) quantize_fp8_dynamic(ctx, hq, h, down_in);
    launch_moe_fp8_gemv(gd, act, stream);
  }

  CombineParams cp{};
  cp.y = y.data_as<float>();
  cp.topk_ids = topk_ids.data_as<int32_t>();
  cp.out = out.data();
  cp.T = static_cast<int>(T);
  cp.k = static_cast<int>(k);
  cp.D = static_cast<int>(D);
  cp.E = static_cast<int>(E);
  cp.out_dtype = out.dtype();
  if (use_cutlass) {
    cp.pair_row = pair_row.data_as<int32_t>();
    cp.topk_weights = topk_weights.data_as<float>();
  }
  launch_moe_combine(cp, stream);
}

}  // namespace moe
}  // namespace chimera::cuda
