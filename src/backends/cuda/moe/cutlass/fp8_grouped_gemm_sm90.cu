// FP8 MoE expert GEMMs at prefill sizes on CUTLASS 3.x's sm90 grouped GEMM (ptr-array, TMA, warp-specialized
// cooperative persistent kernel, FP8 wgmma with CUTLASS's periodic promotion of the accumulators into fp32
// registers). Built only with cmake -DCHIMERA_CUTLASS=ON; the contract and the launch sequence are in
// fp8_moe_kernels.h (Fp8CutlassParams).
//
// Shapes: as the bf16 CUTLASS path (grouped_gemm_sm90.cu): one group per active expert, swap-AB (A = W_e [N_out, K]
// e4m3 K-major, B = the expert's rows [rows, K] e4m3 K-major, D = out^T column-major = out [rows, N_out]), tile
// 128 weight rows x kTileN tokens x 128 k, rasterised along N so an expert's weight tile is read from HBM once.
//
// Epilogues, as epilogue visitor trees (EVT) with per-group scalars (Sm90ScalarBroadcastPtrArray reads
// *ptr_array[group] for the tile's group):
//   up   : hq = e4m3(bf16(relu(alpha_up[g] * acc)^2) / in_down[e]), saturated: the relu^2 and the down projection's
//          activation quantization in the up GEMM's epilogue, so the down GEMM reads FP8;
//   up, dynamic down scale: hb = bf16(relu(alpha_up[g] * acc)^2) (the scale needs every r first; the caller
//          quantizes hb);
//   down : yp = alpha_down[g] * acc in fp32, alpha = w_scale[e] * in_scale[e] (the product the GEMV forms too).
// The prepare kernel writes every group entry (shapes, pointers, strides, the up alphas, scalar pointers) on the
// device from the permutation's items (the down alphas follow in a kernel of their own, once in_down is final), and gathers x by token quantizing each row with its expert's input scale: no host
// synchronisation, graph-capturable.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cutlass/cutlass.h>
#include <cutlass/functional.h>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cute/tensor.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/sm90_visitor_compute_tma_warpspecialized.hpp>
#include <cutlass/epilogue/fusion/sm90_visitor_load_tma_warpspecialized.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include <algorithm>
#include <cstdint>

#include "backends/cuda/cuda_common.cuh"
#include "backends/cuda/launch.cuh"
#include "backends/cuda/moe/cutlass/relu2_epilogue.cuh"
#include "backends/cuda/moe/fp8_moe_kernels.h"

namespace chimera::cuda::moe {
namespace {

using namespace cute;
namespace fusion = cutlass::epilogue::fusion;

// r = bf16(relu(v)^2) (the activation dtype's rounding point, as the GEMV path), then r / s rounded to nearest; the
// conversion of the result to e4m3 (CUTLASS's cvt.rn.satfinite) saturates at +-448.
template <class T>
struct Relu2Quant {
  CUTLASS_HOST_DEVICE T operator()(T const& v, T const& s) const {
    const T r = v > T(0) ? v : T(0);
    return static_cast<T>(static_cast<float>(cutlass::bfloat16_t(r * r))) / s;
  }
};
template <int N>
struct Relu2Quant<cutlass::Array<float, N>> {
  CUTLASS_HOST_DEVICE cutlass::Array<float, N> operator()(cutlass::Array<float, N> const& v,
                                                          cutlass::Array<float, N> const& s) const {
    cutlass::Array<float, N> out;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) {
      const float r = fmaxf(v[i], 0.0f);
#ifdef __CUDA_ARCH__
      out[i] = __fdiv_rn(__bfloat162float(__float2bfloat16_rn(r * r)), s[i]);
#else
      out[i] = static_cast<float>(cutlass::bfloat16_t(r * r)) / s[i];
#endif
    }
    return out;
  }
};

using ElementIn = cutlass::float_e4m3_t;
using ElementAcc = float;
using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // (M, N, K) per group
using LayoutA = cutlass::layout::RowMajor;                                    // W_e [N_out, K]
using LayoutB = cutlass::layout::ColumnMajor;                                 // rows [rows, K]
using LayoutD = cutlass::layout::ColumnMajor;                                 // out^T
constexpr int kAlignIn = 16;                                                  // 16-byte TMA rows: K % 16 == 0
using ClusterShape = Shape<_1, _1, _1>;
using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;  // FP8 with promotion
using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;

using GroupScalar = fusion::Sm90ScalarBroadcastPtrArray<float>;
using Scaled =
    fusion::Sm90EVT<fusion::Sm90Compute<cutlass::multiplies, float, float, kRound>, GroupScalar, fusion::Sm90AccFetch>;
using UpFusion =
    fusion::Sm90EVT<fusion::Sm90Compute<Relu2Quant, cutlass::float_e4m3_t, float, kRound>, Scaled, GroupScalar>;
using UpBf16Fusion = fusion::Sm90EVT<fusion::Sm90Compute<Relu2, cutlass::bfloat16_t, float, kRound>, Scaled>;
using DownFusion = Scaled;

template <class ElementD_, class Fusion_, int kTileN>
struct GemmConfig {
  using TileShape = Shape<_128, Int<kTileN>, _128>;
  using ElementD = ElementD_;
  static constexpr int kAlignD = 128 / cutlass::sizeof_bits<ElementD>::value;
  using Fusion = Fusion_;
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
constexpr int kTileN = 128;
using UpGemm = GemmConfig<cutlass::float_e4m3_t, UpFusion, kTileN>;
using UpBf16Gemm = GemmConfig<cutlass::bfloat16_t, UpBf16Fusion, kTileN>;
using DownGemm = GemmConfig<float, DownFusion, kTileN>;

using KMajorStride = Stride<int64_t, _1, _0>;
using ColMajorStride = Stride<_1, int64_t, _0>;
template <class Cfg>
constexpr bool strides_as_expected() {
  return cute::is_same_v<typename Cfg::StrideA, KMajorStride> && cute::is_same_v<typename Cfg::StrideB, KMajorStride> &&
         cute::is_same_v<typename Cfg::StrideD, ColMajorStride>;
}
static_assert(strides_as_expected<UpGemm>() && strides_as_expected<UpBf16Gemm>() && strides_as_expected<DownGemm>(),
              "A and B K-major, D column-major");
__device__ __forceinline__ KMajorStride k_major_stride(int ld) {
  return make_stride(int64_t{ld}, _1{}, _0{});
}
__device__ __forceinline__ ColMajorStride col_major_stride(int ld) {
  return make_stride(_1{}, int64_t{ld}, _0{});
}

// The device-side group arrays of one GEMM (G entries each), carved from the workspace.
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
  float* alpha;               // [G] w_scale[e] * in_scale[e]
  const float** alpha_ptr;    // [G] &alpha[g]
  const float** divisor_ptr;  // [G] up: &in_down[e] (the down projection's input scale); down: unused
};
using UpArrays = GroupArrays<cutlass::float_e4m3_t>;
using UpBf16Arrays = GroupArrays<cutlass::bfloat16_t>;
using DownArrays = GroupArrays<float>;

// The up GEMM's arrays with its outputs seen as bf16 (the same memory: the prepare kernel stored hb's row pointers).
UpBf16Arrays as_bf16(const UpArrays& a) {
  UpBf16Arrays b{};
  b.shapes = a.shapes;
  b.a = a.a;
  b.b = a.b;
  b.d = reinterpret_cast<cutlass::bfloat16_t**>(a.d);
  b.stride_a = a.stride_a;
  b.stride_b = a.stride_b;
  b.stride_d = a.stride_d;
  b.alpha = a.alpha;
  b.alpha_ptr = a.alpha_ptr;
  b.divisor_ptr = a.divisor_ptr;
  return b;
}

constexpr size_t kAlign = 256;
constexpr size_t align_up(size_t v) {
  return (v + kAlign - 1) / kAlign * kAlign;
}

size_t group_array_bytes(int groups) {
  const size_t g = static_cast<size_t>(groups);
  return align_up(g * sizeof(typename ProblemShape::UnderlyingProblemShape)) + 6 * align_up(g * sizeof(void*)) +
         2 * align_up(g * sizeof(KMajorStride)) + align_up(g * sizeof(ColMajorStride)) + align_up(g * sizeof(float));
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
  a.alpha = reinterpret_cast<float*>(take(g * sizeof(float)));
  a.alpha_ptr = reinterpret_cast<const float**>(take(g * sizeof(void*)));
  a.divisor_ptr = reinterpret_cast<const float**>(take(g * sizeof(void*)));
  return a;
}

struct PrepareParams {
  Fp8CutlassParams p;
  UpArrays up;
  DownArrays down;
};

constexpr int kPrepThreads = 256, kPrepRows = 8;

// Grid: ceil(P / kPrepRows) blocks. Block b quantizes the permuted rows [8 b, 8 b + 8) of x into xq with their
// expert's in_up (found by binary search over the items, which are expert-major with increasing first rows) and
// records their pairs' rows; block 0 also writes the G group entries of both GEMMs.
__global__ void __launch_bounds__(kPrepThreads) moe_fp8_cutlass_prepare_kernel(const PrepareParams q) {
  const Fp8CutlassParams& p = q.p;
  __shared__ int row_expert[kPrepRows];
  pdl_wait();
  pdl_trigger();
  const int n_items = *p.n_items;
  int valid = 0;
  if (n_items > 0) {
    const int4 last = p.items[n_items - 1];
    valid = last.y + last.z;
  }
  const int tid = static_cast<int>(threadIdx.x);
  if (blockIdx.x == 0) {
    for (int g = tid; g < p.groups; g += kPrepThreads) {
      const int4 it = g < n_items ? p.items[g] : make_int4(0, 0, 0, 0);
      const int e = it.x;
      const int64_t r0 = it.y;
      q.up.shapes[g] = make_shape(p.I, it.z, p.D);
      q.up.a[g] = reinterpret_cast<const ElementIn*>(p.up_weight + static_cast<int64_t>(e) * p.I * p.D);
      q.up.b[g] = reinterpret_cast<const ElementIn*>(p.xq + r0 * p.D);
      q.up.d[g] = p.hb != nullptr ? reinterpret_cast<cutlass::float_e4m3_t*>(static_cast<__nv_bfloat16*>(p.hb) + r0 * p.I)
                                  : reinterpret_cast<cutlass::float_e4m3_t*>(p.hq + r0 * p.I);
      q.up.stride_a[g] = k_major_stride(p.D);
      q.up.stride_b[g] = k_major_stride(p.D);
      q.up.stride_d[g] = col_major_stride(p.I);
      q.up.alpha[g] = p.up_scale[e] * p.up_in_scale[e];
      q.up.alpha_ptr[g] = q.up.alpha + g;
      q.up.divisor_ptr[g] = p.down_in_scale + e;
      q.down.shapes[g] = make_shape(p.D, it.z, p.I);
      q.down.a[g] = reinterpret_cast<const ElementIn*>(p.down_weight + static_cast<int64_t>(e) * p.D * p.I);
      q.down.b[g] = reinterpret_cast<const ElementIn*>(p.hq + r0 * p.I);
      q.down.d[g] = p.yp + r0 * p.D;
      q.down.stride_a[g] = k_major_stride(p.I);
      q.down.stride_b[g] = k_major_stride(p.I);
      q.down.stride_d[g] = col_major_stride(p.D);
      q.down.alpha_ptr[g] = q.down.alpha + g;  // the value: moe_fp8_cutlass_down_alpha_kernel
      q.down.divisor_ptr[g] = p.down_in_scale + e;
    }
  }
  const int row0 = static_cast<int>(blockIdx.x) * kPrepRows;
  if (tid < kPrepRows) {
    const int r = row0 + tid;
    int lo = 0, hi = n_items - 1;  // the last item whose first row is <= r
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (p.items[mid].y <= r) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    row_expert[tid] = n_items > 0 ? p.items[lo].x : 0;
  }
  __syncthreads();
  const int chunks = p.D / 8;
  for (int i = tid; i < kPrepRows * chunks; i += kPrepThreads) {
    const int rr = i / chunks, c = i % chunks, r = row0 + rr;
    if (r >= valid) break;
    const int pair = p.sorted_pair[r];
    if (c == 0) p.pair_row[pair] = r;
    const float in = p.up_in_scale[row_expert[rr]];
    const uint4 src = reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(p.x) +
                                                     static_cast<int64_t>(pair / p.top_k) * p.D)[c];
    const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&src);
    uint32_t lo = 0, hi = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t a = __nv_cvt_float_to_fp8(__fdiv_rn(__bfloat162float(h[j]), in), __NV_SATFINITE, __NV_E4M3);
      const uint32_t b = __nv_cvt_float_to_fp8(__fdiv_rn(__bfloat162float(h[4 + j]), in), __NV_SATFINITE, __NV_E4M3);
      lo |= a << (8 * j);
      hi |= b << (8 * j);
    }
    reinterpret_cast<uint2*>(p.xq + static_cast<int64_t>(r) * p.D)[c] = make_uint2(lo, hi);
  }
}

template <class Cfg, class Arrays>
typename Cfg::Gemm::Arguments make_args(const Arrays& a, int groups, int sms) {
  cutlass::KernelHardwareInfo hw{};
  CHIMERA_CUDA_CHECK(cudaGetDevice(&hw.device_id), "cuda::moe_experts_fp8");
  hw.sm_count = sms;
  typename Cfg::Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGrouped,
                                     {groups, a.shapes, nullptr},
                                     {a.a, a.stride_a, a.b, a.stride_b},
                                     {{}, nullptr, a.stride_d, a.d, a.stride_d},
                                     hw};
  // The EVT's arguments mirror its tree: {children..., op}. A group scalar: {scalars, scalar_ptrs, ptr_arrays,
  // dScalar}.
  typename GroupScalar::Arguments alpha{};
  alpha.scalar_ptr_arrays[0] = a.alpha_ptr;
  if constexpr (cute::is_same_v<typename Cfg::Fusion, UpFusion>) {
    typename GroupScalar::Arguments divisor{};
    divisor.scalar_ptr_arrays[0] = a.divisor_ptr;
    args.epilogue.thread = {{alpha, {}, {}}, divisor, {}};
  } else if constexpr (cute::is_same_v<typename Cfg::Fusion, UpBf16Fusion>) {
    args.epilogue.thread = {{alpha, {}, {}}, {}};
  } else {
    args.epilogue.thread = {alpha, {}, {}};
  }
  args.scheduler.raster_order = decltype(args.scheduler.raster_order)::AlongN;
  return args;
}

template <class Cfg, class Arrays>
void run_gemm(const Arrays& a, int groups, int sms, unsigned char* gemm_ws, size_t gemm_ws_bytes, cudaStream_t stream) {
  typename Cfg::Gemm gemm;
  const auto args = make_args<Cfg>(a, groups, sms);
  if (Cfg::Gemm::get_workspace_size(args) > gemm_ws_bytes) {
    throw_runtime("cuda::moe_experts_fp8: CUTLASS workspace larger than sized");
  }
  cutlass::Status st = gemm.can_implement(args);
  if (st != cutlass::Status::kSuccess) {
    throw_runtime(
        str_cat("cuda::moe_experts_fp8: CUTLASS grouped GEMM cannot implement: ", cutlassGetStatusString(st)));
  }
  st = gemm.initialize(args, gemm_ws, stream);
  if (st != cutlass::Status::kSuccess) {
    throw_runtime(str_cat("cuda::moe_experts_fp8: CUTLASS initialize: ", cutlassGetStatusString(st)));
  }
  st = gemm.run(stream);
  if (st != cutlass::Status::kSuccess) {
    throw_runtime(str_cat("cuda::moe_experts_fp8: CUTLASS run: ", cutlassGetStatusString(st)));
  }
  CHIMERA_LAUNCH_CHECK("cuda::moe_experts_fp8");
}

size_t gemm_workspace_bytes(int groups, int sms) {
  const UpArrays up{};
  const DownArrays down{};
  return align_up(std::max({UpGemm::Gemm::get_workspace_size(make_args<UpGemm>(up, groups, sms)),
                            UpBf16Gemm::Gemm::get_workspace_size(make_args<UpBf16Gemm>(as_bf16(up), groups, sms)),
                            DownGemm::Gemm::get_workspace_size(make_args<DownGemm>(down, groups, sms))}));
}

// alpha_down[g] = s_down[e] * in_down[e] for every group (in_down may have been written after the prepare kernel).
__global__ void __launch_bounds__(kPrepThreads) moe_fp8_cutlass_down_alpha_kernel(const Fp8CutlassParams p,
                                                                                  float* alpha) {
  pdl_wait();
  pdl_trigger();
  const int n_items = *p.n_items;
  for (int g = static_cast<int>(threadIdx.x); g < p.groups; g += kPrepThreads) {
    const int e = g < n_items ? p.items[g].x : 0;
    alpha[g] = p.down_scale[e] * p.down_in_scale[e];
  }
}

// The workspace as both launches carve it.
struct Carved {
  PrepareParams q;
  unsigned char* up_gemm_ws;
  unsigned char* down_gemm_ws;
  size_t gemm_ws;
};

Carved carve_workspace(const Fp8CutlassParams& p, void* workspace, size_t workspace_bytes) {
  if (p.D % 16 != 0 || p.I % 16 != 0) {
    throw_runtime(
        str_cat("cuda::moe_experts_fp8: the CUTLASS path needs D, I multiples of 16 (D ", p.D, ", I ", p.I, ")"));
  }
  if (workspace_bytes < fp8_cutlass_workspace_bytes(p.groups)) {
    throw_runtime("cuda::moe_experts_fp8: CUTLASS workspace too small");
  }
  Carved c{};
  auto* ws = static_cast<unsigned char*>(workspace);
  c.q.p = p;
  c.q.up = carve<UpArrays>(ws, p.groups);
  c.q.down = carve<DownArrays>(ws, p.groups);
  c.gemm_ws = gemm_workspace_bytes(p.groups, sm_count());
  c.up_gemm_ws = ws;
  c.down_gemm_ws = ws + c.gemm_ws;
  return c;
}

}  // namespace

size_t fp8_cutlass_workspace_bytes(int groups) {
  return 2 * group_array_bytes(groups) + 2 * gemm_workspace_bytes(groups, sm_count());
}

void launch_moe_fp8_cutlass_up(const Fp8CutlassParams& p, void* workspace, size_t workspace_bytes,
                               cudaStream_t stream) {
  if (p.P <= 0 || p.groups <= 0) return;
  const Carved c = carve_workspace(p, workspace, workspace_bytes);
  const unsigned blocks = static_cast<unsigned>((p.P + kPrepRows - 1) / kPrepRows);
  CHIMERA_CUDA_CHECK(launch(moe_fp8_cutlass_prepare_kernel, dim3(blocks), dim3(kPrepThreads), 0, stream, c.q),
                     "cuda::moe_experts_fp8");
  if (p.hb != nullptr) {
    run_gemm<UpBf16Gemm>(as_bf16(c.q.up), p.groups, sm_count(), c.up_gemm_ws, c.gemm_ws, stream);
  } else {
    run_gemm<UpGemm>(c.q.up, p.groups, sm_count(), c.up_gemm_ws, c.gemm_ws, stream);
  }
}

void launch_moe_fp8_cutlass_down(const Fp8CutlassParams& p, void* workspace, size_t workspace_bytes,
                                 cudaStream_t stream) {
  if (p.P <= 0 || p.groups <= 0) return;
  const Carved c = carve_workspace(p, workspace, workspace_bytes);
  CHIMERA_CUDA_CHECK(
      launch(moe_fp8_cutlass_down_alpha_kernel, dim3(1), dim3(kPrepThreads), 0, stream, p, c.q.down.alpha),
      "cuda::moe_experts_fp8");
  run_gemm<DownGemm>(c.q.down, p.groups, sm_count(), c.down_gemm_ws, c.gemm_ws, stream);
}

}  // namespace chimera::cuda::moe
