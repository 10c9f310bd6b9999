// ops::moe_experts on CUDA (docs/model.md 6.2): permutation -> grouped up GEMM (+relu2) -> grouped down GEMM
// (x routing weight) -> combine, four launches on ctx.stream with no host synchronisation (the tile counts live
// on the device; the grids are sized by an upper bound and surplus blocks exit at once).
//
// At decode sizes on the GEMV path the permutation runs inside the up launch (moe_kernels.h, GemvFold): router + up +
// down + combine per MoE layer. With that fold the down launch's routed units start streaming before its pdl_wait()
// (GemvFold::early_routed). The folds and early starts are switches of ctx.kernels (ops/kernel_config.h).
//
// With the layer's shared expert (ops::moe_experts_shared) on the GEMV path: its up and down run as extra units of
// the two GEMV launches (grouped_gemv.cu), so a decode MoE layer is router + 4 launches instead of router + 4 + 3
// (cuBLASLt up, relu2, cuBLASLt down); elsewhere the shared expert is cuda::relu2_mlp after the routed experts.
//
// Paths: bf16 / f16 activations with expert weights of the same dtype, K and N multiples of 8 and 16-byte aligned
// weights -> decode GEMV for T <= kGemvMaxTokens (grouped_gemv.cu; why that cut: moe_kernels.h), tensor cores
// above (grouped_gemm_mma.cu); anything else, fp32 activations in particular -> fp32 SIMT (grouped_gemm_simt.cu).
// ExpertsPath::kCutlass (tests and benchmarks): CUTLASS 3.x's sm90 grouped GEMM (cutlass/grouped_gemm_sm90.cu, built
// with -DCHIMERA_CUTLASS=ON). Why not cuBLAS's grouped GEMM: see docs/moe_cuda.md.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "backends/cuda/cuda_common.cuh"
#include "backends/cuda/cuda_ops.h"
#include "backends/cuda/moe/experts.h"
#include "backends/cuda/moe/moe_kernels.h"
#include "backends/device_api.h"

namespace chimera::cuda {
namespace {

// Device copies of the per-expert weight pointer arrays ([up_0..up_E-1, down_0..down_E-1]), cached by their
// values: a model calls with the same weights every step, so after the first call per layer there is no
// host-to-device copy. The cache holds pointer values only, so a freed and re-allocated weight is still right.
class PointerTables {
 public:
  const void* const* get(std::span<const Tensor> up, std::span<const Tensor> down) {
    std::vector<const void*> key;
    key.reserve(up.size() + down.size());
    for (const Tensor& t : up) key.push_back(t.data());
    for (const Tensor& t : down) key.push_back(t.data());
    uint64_t h = 1469598103934665603ull;
    for (const void* p : key) h = (h ^ reinterpret_cast<uintptr_t>(p)) * 1099511628211ull;
    std::lock_guard<std::mutex> lock(mu_);
    auto range = tables_.equal_range(h);
    for (auto it = range.first; it != range.second; ++it) {
      if (it->second.host == key) return it->second.device;
    }
    if (tables_.size() >= kMaxTables) clear();
    void* dev = nullptr;
    const size_t bytes = key.size() * sizeof(void*);
    CHIMERA_CUDA_CHECK(cudaMalloc(&dev, bytes), "ops::moe_experts");
    CHIMERA_CUDA_CHECK(cudaMemcpy(dev, key.data(), bytes, cudaMemcpyHostToDevice), "ops::moe_experts");
    Entry e{std::move(key), static_cast<const void* const*>(dev)};
    return tables_.emplace(h, std::move(e))->second.device;
  }

 private:
  static constexpr size_t kMaxTables = 4096;
  struct Entry {
    std::vector<const void*> host;
    const void* const* device;
  };
  void clear() {
    // Queued kernels may still read the old tables.
    CHIMERA_CUDA_CHECK(cudaDeviceSynchronize(), "ops::moe_experts");
    for (auto& [h, e] : tables_) cudaFree(const_cast<void**>(e.device));
    tables_.clear();
  }
  std::mutex mu_;
  std::unordered_multimap<uint64_t, Entry> tables_;
};

PointerTables& pointer_tables() {
  static auto* t = new PointerTables();  // never destroyed: may be used during static destruction
  return *t;
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

const char* path_name(moe::ExpertsPath path) {
  switch (path) {
    case moe::ExpertsPath::kGemv:
      return "gemv";
    case moe::ExpertsPath::kMma:
      return "mma";
    case moe::ExpertsPath::kSimt:
      return "simt";
    case moe::ExpertsPath::kCutlass:
      return "cutlass";
    default:
      return "auto";
  }
}

}  // namespace

bool moe::cutlass_built() {
#ifdef CHIMERA_HAVE_CUTLASS
  return true;
#else
  return false;
#endif
}

void local_expert_ids(const ops::Context& ctx, const Tensor& ids, int64_t first, int64_t count) {
  moe::launch_local_expert_ids(ids.data_as<int32_t>(), ids.numel(), static_cast<int32_t>(first),
                               static_cast<int32_t>(count), as_stream(ctx.stream));
}

void moe_experts(const ops::Context& ctx, const Tensor& out, const Tensor& x, const Tensor& topk_ids,
                 const Tensor& topk_weights, std::span<const Tensor> up_proj, std::span<const Tensor> down_proj) {
  moe::moe_experts_on_path(ctx, out, x, topk_ids, topk_weights, up_proj, down_proj, moe::ExpertsPath::kAuto);
}

void moe_experts_shared(const ops::Context& ctx, const Tensor& out, const Tensor& x, const Tensor& topk_ids,
                        const Tensor& topk_weights, std::span<const Tensor> up_proj, std::span<const Tensor> down_proj,
                        const ops::SharedExpert& shared) {
  moe::moe_experts_on_path(ctx, out, x, topk_ids, topk_weights, up_proj, down_proj, moe::ExpertsPath::kAuto,
                           &shared);
}

namespace moe {

void moe_experts_on_path(const ops::Context& ctx, const Tensor& out, const Tensor& x, const Tensor& topk_ids,
                         const Tensor& topk_weights, std::span<const Tensor> up_proj,
                         std::span<const Tensor> down_proj, ExpertsPath path, const ops::SharedExpert* shared) {
  const int64_t T = x.dim(0), Din = x.dim(1), k = topk_ids.dim(1);
  const int E = static_cast<int>(up_proj.size());
  const int64_t I = up_proj[0].dim(0);
  const DType wt = up_proj[0].dtype();
  if (topk_weights.dtype() != DType::kF32) {
    throw_runtime(str_cat("ops::moe_experts: topk_weights ", topk_weights.describe(), " must be F32 on CUDA"));
  }
  if (out.dtype() != x.dtype()) {
    throw_runtime(str_cat("ops::moe_experts: out ", out.describe(), " must have the dtype of x ", x.describe(),
                          " on CUDA"));
  }
  if (E > moe::kPermuteMaxExperts || k > 32) {
    throw_runtime(str_cat("ops::moe_experts: ", E, " experts / top-", k, " is not supported on CUDA (supported: E <= ",
                          moe::kPermuteMaxExperts, ", k <= 32)"));
  }
  bool weights_aligned = true;
  for (int e = 0; e < E; ++e) {
    if (up_proj[e].dim(0) != I || up_proj[e].dtype() != wt || down_proj[e].dtype() != wt) {
      throw_runtime(str_cat("ops::moe_experts: expert ", e, " up ", up_proj[e].describe(), " down ",
                            down_proj[e].describe(), " differs from expert 0 up ", up_proj[0].describe(),
                            " (CUDA needs one intermediate size and one weight dtype for all experts)"));
    }
    weights_aligned = weights_aligned && aligned16(up_proj[e].data()) && aligned16(down_proj[e].data());
  }
  if (T == 0) return;
  // After the routed experts (or fused into their GEMV launches below).
  auto shared_separately = [&] {
    if (shared) cuda::relu2_mlp(ctx, shared->out, shared->x, shared->up_proj, shared->down_proj);
  };
  const int64_t P = T * k;
  if (P > (int64_t{1} << 30) || P * std::max(Din, I) > (int64_t{1} << 40)) {
    throw_runtime(str_cat("ops::moe_experts: ", T, " tokens x top-", k, " is too large"));
  }
  cudaStream_t stream = as_stream(ctx.stream);

  // The 16-bit domain of the tensor-core and GEMV paths.
  const bool vec16 = (x.dtype() == DType::kBF16 || x.dtype() == DType::kF16) && wt == x.dtype() && Din % 8 == 0 &&
                     I % 8 == 0 && weights_aligned && aligned16(x.data());
  const bool gemv_ok = vec16 && moe::gemv_fits(std::min<int64_t>(T, moe::kGemvMaxTokens), std::max(Din, I));
  if (path == ExpertsPath::kAuto) {
    path = !vec16 ? ExpertsPath::kSimt : gemv_ok && T <= moe::kGemvMaxTokens ? ExpertsPath::kGemv : ExpertsPath::kMma;
    if (path == ExpertsPath::kMma && x.dtype() == DType::kBF16 && T >= moe::kCutlassMinTokens && cutlass_built() &&
        ctx.kernels.moe_cutlass) {
      path = ExpertsPath::kCutlass;
    }
  } else if ((path == ExpertsPath::kMma && !vec16) || (path == ExpertsPath::kGemv && !gemv_ok) ||
             (path == ExpertsPath::kCutlass && !(vec16 && x.dtype() == DType::kBF16))) {
    throw_runtime(str_cat("ops::moe_experts: the ", path_name(path), " path does not take x ", x.describe(),
                          " with weights ", up_proj[0].describe()));
  }
  if (path == ExpertsPath::kCutlass && !cutlass_built()) {
    throw_runtime("ops::moe_experts: the cutlass path is not built (cmake -DCHIMERA_CUTLASS=ON)");
  }
  const bool gemv = path == ExpertsPath::kGemv, mma = path == ExpertsPath::kMma;
  const bool use_cutlass = path == ExpertsPath::kCutlass;
  // The shared expert inside the GEMV launches: one dtype everywhere, K multiples of 8, aligned rows, all T tokens
  // in one unit (T <= tile_rows, true on this path) and its token rows within the staging limit.
  bool fuse_shared = false;
  if (shared && gemv) {
    const ops::SharedExpert& s = *shared;
    const int64_t H = s.x.dim(1), Is = s.up_proj.dim(0);
    fuse_shared = s.x.dtype() == x.dtype() && s.out.dtype() == x.dtype() && s.up_proj.dtype() == x.dtype() &&
                  s.down_proj.dtype() == x.dtype() && s.x.dim(0) == T && H % 8 == 0 && Is % 8 == 0 &&
                  aligned16(s.x.data()) && aligned16(s.up_proj.data()) && aligned16(s.down_proj.data()) &&
                  moe::gemv_fits(T, std::max(Din, H)) && moe::gemv_fits(T, std::max(I, Is));
  }
  // Few rows per active expert (decode): the small tile (BT = 16, BN = 64) gives more blocks per expert.
  const int64_t active_bound = std::min<int64_t>(E, P);
  const moe::MmaTile tile = P <= 24 * active_bound ? moe::MmaTile::kSmall : moe::MmaTile::kLarge;
  // CUTLASS: one work item per active expert (a group of the grouped GEMM), so tile_rows >= P.
  const int tile_rows = gemv          ? moe::gemv_tile_rows(T)
                        : mma         ? moe::mma_tile_rows(tile)
                        : use_cutlass ? static_cast<int>(std::max<int64_t>(P, 1))
                                      : moe::kSimtTileRows;
  // Work items (tiles of <= tile_rows pairs of one expert): sum over the active experts of ceil(count / tile_rows)
  // <= P / tile_rows + active experts, and <= P (each holds a pair).
  const int64_t max_items =
      use_cutlass ? active_bound : std::min<int64_t>(P, (P + tile_rows - 1) / tile_rows + active_bound);

  // Workspace from the caching allocator; stream-ordered reuse makes freeing it at return safe.
  Tensor meta = device::empty(Device::kCuda, DType::kI32, {P + 8 + 4 * max_items});
  Tensor h = device::empty(Device::kCuda, gemv || mma || use_cutlass ? x.dtype() : DType::kF32, {P, I});
  Tensor pair_row;  // CUTLASS: the permuted row of each pair (y stays in permuted order)
  Tensor y = device::empty(Device::kCuda, DType::kF32, {P, Din});
  int32_t* sorted_pair = meta.data_as<int32_t>();
  int32_t* n_items = sorted_pair + P;
  // items start 16-byte aligned: P + 4 ints, rounded up
  int4* items = reinterpret_cast<int4*>(meta.data_as<int32_t>() + ((P + 4 + 3) / 4) * 4);

  moe::PermuteParams pp{};
  pp.topk_ids = topk_ids.data_as<int32_t>();
  pp.P = static_cast<int>(P);
  pp.E = E;
  pp.tile_rows = tile_rows;
  pp.sorted_pair = sorted_pair;
  pp.items = items;
  pp.n_items = n_items;
  // Decode: the permutation inside the up launch (moe_kernels.h, GemvFold).
  const bool fold = gemv && ctx.kernels.moe_gemv_fold && P <= moe::kGemvFoldMaxPairs && T <= tile_rows;
  if (!fold) moe::launch_moe_permute(pp, stream);

  const void* const* tables = pointer_tables().get(up_proj, down_proj);
  moe::GemmParams g{};
  g.sorted_pair = sorted_pair;
  g.items = items;
  g.n_items = n_items;
  g.topk_weights = topk_weights.data_as<float>();
  g.top_k = static_cast<int>(k);
  g.max_items = static_cast<int>(max_items);

  moe::GemmParams up = g;
  up.weights = tables;
  up.x = x.data();
  up.out = h.data();
  up.N = static_cast<int>(I);
  up.K = static_cast<int>(Din);
  moe::GemmParams down = g;
  down.weights = tables + E;
  down.x = h.data();
  down.out = y.data();
  down.N = static_cast<int>(Din);
  down.K = static_cast<int>(I);
  if (gemv) {
    moe::GemvShared shared_up{}, shared_down{};
    Tensor hs;  // the shared expert's relu2 intermediate [T, Is], the activation dtype (as relu2_mlp's)
    if (fuse_shared) {
      hs = device::empty(Device::kCuda, x.dtype(), {T, shared->up_proj.dim(0)});
      shared_up = {shared->up_proj.data(), shared->x.data(), hs.data(), static_cast<int>(hs.dim(1)),
                   static_cast<int>(shared->x.dim(1)), static_cast<int>(T)};
      shared_up.before_wait = ctx.kernels.moe_early_shared;
      shared_down = {shared->down_proj.data(), hs.data(), shared->out.data(), static_cast<int>(shared->out.dim(1)),
                     static_cast<int>(hs.dim(1)), static_cast<int>(T)};
    }
    moe::GemvFold fold_up{}, fold_down{};
    if (fold) {
      fold_up.topk_ids = topk_ids.data_as<int32_t>();
      fold_up.T = static_cast<int>(T);
      fold_up.E = E;
      fold_up.sorted_pair = sorted_pair;
      fold_up.items = items;
      fold_up.n_items = n_items;
      // The down launch comes right after the up launch, so topk_ids (written before the up launch) is two launches
      // back from it: its early start may read them before its wait.
      if (ctx.kernels.moe_down_early) {
        fold_down = fold_up;
        fold_down.early_routed = true;
      }
    }
    moe::launch_moe_gemv(up, shared_up, x.dtype(), tile_rows, true, stream, fold_up);
    moe::launch_moe_gemv(down, shared_down, x.dtype(), tile_rows, false, stream, fold_down);
  } else if (mma) {
    moe::launch_moe_gemm_mma(up, x.dtype(), tile, true, stream);
    moe::launch_moe_gemm_mma(down, x.dtype(), tile, false, stream);
  } else if (use_cutlass) {
#ifdef CHIMERA_HAVE_CUTLASS
    // prepare (gather x by token, group arrays) + up GEMM + down GEMM; y in permuted order, unscaled (moe_kernels.h).
    Tensor xp = device::empty(Device::kCuda, x.dtype(), {P, Din});
    pair_row = device::empty(Device::kCuda, DType::kI32, {P});
    const size_t ws_bytes = moe::cutlass_experts_workspace_bytes(static_cast<int>(max_items));
    Tensor ws = device::empty(Device::kCuda, DType::kU8, {static_cast<int64_t>(ws_bytes)});
    moe::CutlassExpertsParams c{};
    c.up_weights = tables;
    c.down_weights = tables + E;
    c.x = x.data();
    c.sorted_pair = sorted_pair;
    c.items = items;
    c.n_items = n_items;
    c.P = static_cast<int>(P);
    c.top_k = static_cast<int>(k);
    c.D = static_cast<int>(Din);
    c.I = static_cast<int>(I);
    c.groups = static_cast<int>(max_items);
    c.xp = xp.data();
    c.h = h.data();
    c.yp = y.data_as<float>();
    c.pair_row = pair_row.data_as<int32_t>();
    const int forced = ctx.kernels.moe_cutlass_tile_n;
    c.tile_n = forced != 0 ? forced : P > 96 * active_bound ? 128 : 64;
    moe::launch_moe_experts_cutlass(c, ws.data(), ws_bytes, stream);
#endif
  } else {
    moe::launch_moe_gemm_simt(up, x.dtype(), wt, true, stream);
    moe::launch_moe_gemm_simt(down, DType::kF32, wt, false, stream);
  }

  moe::CombineParams cp{};
  cp.y = y.data_as<float>();
  cp.topk_ids = topk_ids.data_as<int32_t>();
  cp.out = out.data();
  cp.T = static_cast<int>(T);
  cp.k = static_cast<int>(k);
  cp.D = static_cast<int>(Din);
  cp.E = E;
  cp.out_dtype = out.dtype();
  if (use_cutlass) {
    cp.pair_row = pair_row.data_as<int32_t>();
    cp.topk_weights = topk_weights.data_as<float>();
  }
  moe::launch_moe_combine(cp, stream);
  if (!fuse_shared) shared_separately();
}

}  // namespace moe
}  // namespace chimera::cuda
