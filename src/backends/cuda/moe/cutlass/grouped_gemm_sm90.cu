// MoE expert GEMMs at prefill sizes on CUTLASS 3.x's sm90 grouped GEMM (ptr-array, TMA, warp-specialized
// cooperative persistent kernel, wgmma), bf16 in, fp32 accumulate. Built only with cmake -DCHIMERA_CUTLASS=ON
// (headers from scripts/fetch_cutlass.sh); the contract and the launch sequence are in moe_kernels.h
// (CutlassExpertsParams).
//
// Shapes. One group per active expert (work item g of a permutation with tile_rows >= P). Swap-AB, as the mma
// path: CUTLASS's A is the expert weight W_e [N_out, K] (RowMajor = K-major, M = N_out), B is the expert's token
// rows [rows, K] (ColumnMajor B = K-major, N = rows), D = out^T (M x N) ColumnMajor = out [rows, N_out] row-major.
// The tile is 128 weight rows x 64 or 128 tokens (CutlassExpertsParams::tile_n) x 64 k: the token side (a few to a
// few hundred rows per expert at prefill) is the one that can be small; the weight side fills the two consumer
// warpgroups' 64-row wgmmas.
// Rasterisation along N (the token tiles of one weight tile run on neighbouring CTAs), so an expert with more than
// 64 rows reads each weight tile from HBM once and from L2 for its other token tiles.
//
// Everything CUTLASS reads per group (problem shapes, A / B / D pointers, strides) is written on the device by
// moe_cutlass_prepare_kernel from the permutation's items; the host passes only G = max_items (an upper bound of the
// active experts) and host_problem_shapes = nullptr, so the scheduler sizes the persistent grid by the SM count and
// walks the device-side shapes (groups past *n_items have 0 rows: no tiles). No device-to-host copy: the whole path
// can be captured in a CUDA graph. Per call the host builds CUTLASS's params (TMA descriptor templates: driver
// calls, no synchronisation).
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/thread/activation.h>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cute/tensor.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/sm90_visitor_compute_tma_warpspecialized.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include <algorithm>
#include <cstdint>

#include "backends/cuda/cuda_common.cuh"
#include "backends/cuda/launch.cuh"
#include "backends/cuda/moe/cutlass/relu2_epilogue.cuh"
#include "backends/cuda/moe/moe_kernels.h"

namespace chimera::cuda::moe {
namespace {

using namespace cute;

using ElementIn = cutlass::bfloat16_t;
using ElementAcc = float;
using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // (M, N, K) per group
using LayoutA = cutlass::layout::RowMajor;                                    // W_e [N_out, K]
using LayoutB = cutlass::layout::ColumnMajor;                                 // token rows [rows, K]
using LayoutD = cutlass::layout::ColumnMajor;                                 // out^T: out [rows, N_out] row-major
constexpr int kAlignIn = 128 / cutlass::sizeof_bits<ElementIn>::value;        // 16-byte TMA rows: K % 8 == 0
using ClusterShape = Shape<_1, _1, _1>;
using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;

// kUp: D = bf16(relu(acc)^2); down: D = acc in fp32 (the routing weight is applied by the combine).
// kTileN: tokens per tile (64: a few dozen rows per expert, T ~ 1k; 128: hundreds, T ~ 4k), 128 weight rows, 64 k.
template <bool kUp, int kTileN>
struct GemmConfig {
  using TileShape = Shape<_128, Int<kTileN>, _64>;
  using ElementD = cute::conditional_t<kUp, cutlass::bfloat16_t, float>;
  static constexpr int kAlignD = 128 / cutlass::sizeof_bits<ElementD>::value;
  using Fusion = cute::conditional_t<
      kUp,
      cutlass::epilogue::fusion::Sm90EVT<cutlass::epilogue::fusion::Sm90Compute<Relu2, ElementD, float, kRound>,
                                         cutlass::epilogue::fusion::Sm90AccFetch>,
      cutlass::epilogue::fusion::Sm90EVT<
          cutlass::epilogue::fusion::Sm90Compute<cutlass::epilogue::thread::Identity, ElementD, float, kRound>,
          cutlass::epilogue::fusion::Sm90AccFetch>>;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, ElementAcc, float, void, LayoutD*, kAlignD, ElementD, LayoutD*,
      kAlignD, EpilogueSchedule, Fusion>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementIn, LayoutA*, kAlignIn, ElementIn, LayoutB*, kAlignIn,
      ElementAcc, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
};

// Per-group strides (grouped GEMM: (M or N, K, L) modes, L unused). A RowMajor and B ColumnMajor are both K-major:
// (leading dimension K, 1, 0); D ColumnMajor (M, N): (1, M, 0).
using KMajorStride = Stride<int64_t, _1, _0>;
using ColMajorStride = Stride<_1, int64_t, _0>;
template <class Cfg>
constexpr bool strides_as_expected() {
  return cute::is_same_v<typename Cfg::StrideA, KMajorStride> && cute::is_same_v<typename Cfg::StrideB, KMajorStride> &&
         cute::is_same_v<typename Cfg::StrideD, ColMajorStride>;
}
static_assert(strides_as_expected<GemmConfig<true, 64>>() && strides_as_expected<GemmConfig<false, 64>>() &&
                  strides_as_expected<GemmConfig<true, 128>>() && strides_as_expected<GemmConfig<false, 128>>(),
              "A and B K-major, D column-major (out^T)");
__device__ __forceinline__ KMajorStride k_major_stride(int ld) {
  return make_stride(int64_t{ld}, _1{}, _0{});
}
__device__ __forceinline__ ColMajorStride col_major_stride(int ld) {
  return make_stride(_1{}, int64_t{ld}, _0{});
}

// The device-side group arrays of one GEMM (G entries each), carved from the workspace. ElementD: bf16 (up) or
// float (down); the same for every tile shape.
template <class ElementD>
struct GroupArrays {
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;
  Shape3* shapes;
  const ElementIn** a;
  const ElementIn** b;
  ElementD** d;
  KMajorStride* stride_a;
  KMajorStride* stride_b;
  ColMajorStride* stride_d;
};
using UpArrays = GroupArrays<cutlass::bfloat16_t>;
using DownArrays = GroupArrays<float>;

constexpr size_t kAlign = 256;
constexpr size_t align_up(size_t v) {
  return (v + kAlign - 1) / kAlign * kAlign;
}

size_t group_array_bytes(int groups) {
  const size_t g = static_cast<size_t>(groups);
  return align_up(g * sizeof(typename ProblemShape::UnderlyingProblemShape)) + 3 * align_up(g * sizeof(void*)) +
         2 * align_up(g * sizeof(KMajorStride)) + align_up(g * sizeof(ColMajorStride));
}

template <class Arrays>
Arrays carve(unsigned char*& ws, int groups) {
  const size_t g = static_cast<size_t>(groups);
  Arrays a{};
  auto take = [&](size_t bytes) {
    unsigned char* p = ws;
    ws += align_up(bytes);
    return p;
  };
  a.shapes = reinterpret_cast<typename ProblemShape::UnderlyingProblemShape*>(
      take(g * sizeof(typename ProblemShape::UnderlyingProblemShape)));
  a.a = reinterpret_cast<const ElementIn**>(take(g * sizeof(void*)));
  a.b = reinterpret_cast<const ElementIn**>(take(g * sizeof(void*)));
  a.d = reinterpret_cast<decltype(a.d)>(take(g * sizeof(void*)));
  a.stride_a = reinterpret_cast<KMajorStride*>(take(g * sizeof(KMajorStride)));
  a.stride_b = reinterpret_cast<KMajorStride*>(take(g * sizeof(KMajorStride)));
  a.stride_d = reinterpret_cast<ColMajorStride*>(take(g * sizeof(ColMajorStride)));
  return a;
}

struct PrepareParams {
  CutlassExpertsParams p;
  UpArrays up;
  DownArrays down;
};

constexpr int kPrepThreads = 256, kPrepRows = 8;  // rows gathered per block

// Grid: ceil(P / kPrepRows) blocks (>= 1). Block b gathers the permuted rows [b * 8, b * 8 + 8) of x into xp (16-byte
// chunks, D % 8 == 0) and records their pairs' rows; block 0 also writes the G group entries of both GEMMs.
// Rows past the valid pairs (ids outside [0, E)) are neither gathered nor read by the GEMMs.
__global__ void __launch_bounds__(kPrepThreads) moe_cutlass_prepare_kernel(const PrepareParams q) {
  const CutlassExpertsParams& p = q.p;
  pdl_wait();  // PDL: the permutation is the previous kernel's output; xp / h may still be read by a predecessor
  pdl_trigger();
  const int n_items = *p.n_items;
  int valid = 0;  // pairs with a valid expert = the end of the last item (items are expert-major, contiguous rows)
  if (n_items > 0) {
    const int4 last = p.items[n_items - 1];
    valid = last.y + last.z;
  }
  const int tid = static_cast<int>(threadIdx.x);
  if (blockIdx.x == 0) {
    const auto* x_base = static_cast<const ElementIn*>(p.xp);
    auto* h_base = static_cast<ElementIn*>(p.h);
    for (int g = tid; g < p.groups; g += kPrepThreads) {
      const int4 it = g < n_items ? p.items[g] : make_int4(0, 0, 0, 0);
      const int64_t r0 = it.y;
      // Up: M = I weight rows, N = the expert's rows, K = D.
      q.up.shapes[g] = make_shape(p.I, it.z, p.D);
      q.up.a[g] = static_cast<const ElementIn*>(p.up_weights[it.x]);
      q.up.b[g] = x_base + r0 * p.D;
      q.up.d[g] = h_base + r0 * p.I;
      q.up.stride_a[g] = k_major_stride(p.D);
      q.up.stride_b[g] = k_major_stride(p.D);
      q.up.stride_d[g] = col_major_stride(p.I);
      // Down: M = D weight rows, N = the expert's rows, K = I.
      q.down.shapes[g] = make_shape(p.D, it.z, p.I);
      q.down.a[g] = static_cast<const ElementIn*>(p.down_weights[it.x]);
      q.down.b[g] = h_base + r0 * p.I;
      q.down.d[g] = p.yp + r0 * p.D;
      q.down.stride_a[g] = k_major_stride(p.I);
      q.down.stride_b[g] = k_major_stride(p.I);
      q.down.stride_d[g] = col_major_stride(p.D);
    }
  }
  const int chunks = p.D / 8;
  const int row0 = static_cast<int>(blockIdx.x) * kPrepRows;
  for (int i = tid; i < kPrepRows * chunks; i += kPrepThreads) {
    const int r = row0 + i / chunks, c = i % chunks;
    if (r >= valid) break;  // i increases with r
    const int pair = p.sorted_pair[r];
    if (c == 0) p.pair_row[pair] = r;
    const uint4* src = reinterpret_cast<const uint4*>(static_cast<const ElementIn*>(p.x) +
                                                      static_cast<int64_t>(pair / p.top_k) * p.D) +
                       c;
    reinterpret_cast<uint4*>(static_cast<ElementIn*>(p.xp) + static_cast<int64_t>(r) * p.D)[c] = *src;
  }
}

template <class Cfg, class Arrays>
typename Cfg::Gemm::Arguments make_args(const Arrays& a, int groups, int sms) {
  cutlass::KernelHardwareInfo hw{};
  CHIMERA_CUDA_CHECK(cudaGetDevice(&hw.device_id), "ops::moe_experts");
  hw.sm_count = sms;
  typename Cfg::Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGrouped,
                                     {groups, a.shapes, nullptr},
                                     {a.a, a.stride_a, a.b, a.stride_b},
                                     {{}, nullptr, a.stride_d, a.d, a.stride_d},
                                     hw};
  // Token tiles of one weight tile on neighbouring CTAs (N = tokens): each weight tile comes from HBM once.
  args.scheduler.raster_order = decltype(args.scheduler.raster_order)::AlongN;
  return args;
}

template <class Cfg, class Arrays>
void run_gemm(const Arrays& a, int groups, int sms, unsigned char* gemm_ws, size_t gemm_ws_bytes, cudaStream_t stream) {
  typename Cfg::Gemm gemm;
  const auto args = make_args<Cfg>(a, groups, sms);
  if (Cfg::Gemm::get_workspace_size(args) > gemm_ws_bytes) {
    throw_runtime("ops::moe_experts: CUTLASS workspace larger than sized");
  }
  cutlass::Status st = gemm.can_implement(args);
  if (st != cutlass::Status::kSuccess) {
    throw_runtime(str_cat("ops::moe_experts: CUTLASS grouped GEMM cannot implement: ", cutlassGetStatusString(st)));
  }
  st = gemm.initialize(args, gemm_ws, stream);
  if (st != cutlass::Status::kSuccess) {
    throw_runtime(str_cat("ops::moe_experts: CUTLASS initialize: ", cutlassGetStatusString(st)));
  }
  st = gemm.run(stream);
  if (st != cutlass::Status::kSuccess) {
    throw_runtime(str_cat("ops::moe_experts: CUTLASS run: ", cutlassGetStatusString(st)));
  }
  CHIMERA_LAUNCH_CHECK("ops::moe_experts");
}

// CUTLASS's workspace of one GEMM (per-SM tensor maps, scheduler): the largest over the tile shapes, so one size
// serves every variant.
size_t gemm_workspace_bytes(int groups, int sms) {
  const UpArrays up{};
  const DownArrays down{};
  size_t bytes = 0;
  for (size_t b :
       {GemmConfig<true, 64>::Gemm::get_workspace_size(make_args<GemmConfig<true, 64>>(up, groups, sms)),
        GemmConfig<false, 64>::Gemm::get_workspace_size(make_args<GemmConfig<false, 64>>(down, groups, sms)),
        GemmConfig<true, 128>::Gemm::get_workspace_size(make_args<GemmConfig<true, 128>>(up, groups, sms)),
        GemmConfig<false, 128>::Gemm::get_workspace_size(make_args<GemmConfig<false, 128>>(down, groups, sms))}) {
    bytes = std::max(bytes, b);
  }
  return align_up(bytes);
}

}  // namespace

size_t cutlass_experts_workspace_bytes(int groups) {
  return 2 * group_array_bytes(groups) + 2 * gemm_workspace_bytes(groups, sm_count());
}

void launch_moe_experts_cutlass(const CutlassExpertsParams& p, void* workspace, size_t workspace_bytes,
                                cudaStream_t stream) {
  if (p.P <= 0 || p.groups <= 0) return;
  if (p.D % 8 != 0 || p.I % 8 != 0) {
    throw_runtime(str_cat("ops::moe_experts: the CUTLASS path needs D, I multiples of 8 (D ", p.D, ", I ", p.I, ")"));
  }
  if (p.tile_n != 64 && p.tile_n != 128) {
    throw_runtime(str_cat("ops::moe_experts: CUTLASS token tile ", p.tile_n, " (supported: 64, 128)"));
  }
  if (workspace_bytes < cutlass_experts_workspace_bytes(p.groups)) {
    throw_runtime("ops::moe_experts: CUTLASS workspace too small");
  }
  const int sms = sm_count();
  auto* ws = static_cast<unsigned char*>(workspace);
  PrepareParams q{};
  q.p = p;
  q.up = carve<UpArrays>(ws, p.groups);
  q.down = carve<DownArrays>(ws, p.groups);
  const size_t gemm_ws = gemm_workspace_bytes(p.groups, sms);
  unsigned char* up_gemm_ws = ws;
  unsigned char* down_gemm_ws = ws + gemm_ws;

  const unsigned blocks = static_cast<unsigned>((p.P + kPrepRows - 1) / kPrepRows);
  CHIMERA_CUDA_CHECK(launch(moe_cutlass_prepare_kernel, dim3(blocks), dim3(kPrepThreads), 0, stream, q),
                     "ops::moe_experts");
  // The GEMMs are plain launches (no PDL attribute): each starts after its predecessor has completed.
  if (p.tile_n == 64) {
    run_gemm<GemmConfig<true, 64>>(q.up, p.groups, sms, up_gemm_ws, gemm_ws, stream);
    run_gemm<GemmConfig<false, 64>>(q.down, p.groups, sms, down_gemm_ws, gemm_ws, stream);
  } else {
    run_gemm<GemmConfig<true, 128>>(q.up, p.groups, sms, up_gemm_ws, gemm_ws, stream);
    run_gemm<GemmConfig<false, 128>>(q.down, p.groups, sms, down_gemm_ws, gemm_ws, stream);
  }
}

}  // namespace chimera::cuda::moe
