// Grouped expert GEMM on the tensor cores: mma.sync m16n8k16 (bf16 / f16 in, fp32 accumulate), cp.async
// multi-stage shared-memory pipeline, one kernel per projection with the epilogue fused:
//   up:   relu(acc)^2 rounded to the activation dtype (HF applies relu2 in bf16) -> h [P, I], permuted order
//   down: acc * routing weight in fp32 -> y [P, D], row = pair id (the deterministic combine sums it later)
//
// Swap-AB: the expert weight W_e [N, K] is the MMA's A operand (its rows fill the 16-row side) and the few
// tokens of an expert are the 8-column B side, so decode (1-3 tokens per expert) wastes MMA columns, not
// weight bandwidth. Every weight tile is read from HBM once per work item; MoE at Nemotron shapes is
// weight-bandwidth bound up to ~1k tokens (docs/model.md 9: Nano 128 x 10 MB experts, Super 512 x 5.5 MB).
//
// Block: 128 threads = 4 warps stacked along N; warp tile WM = BN / 4 weight rows x BT tokens. Shared tiles are
// [rows][BK = 64] 16-bit with the 16-byte chunk index XOR-swizzled by (row % 8), so the 8 row addresses of each
// ldmatrix phase hit 8 different bank groups. Portable sm_80+ code (no wgmma): kept in this file for every arch.
#include <cstdint>

#include "backends/cuda/cuda_common.cuh"
#include "backends/cuda/mma_sync.cuh"
#include "backends/cuda/moe/moe_kernels.h"

namespace chimera::cuda::moe {
namespace {

constexpr int kThreads = 128, kBK = 64;

template <MmaTile kTile>
struct TileShape;
template <>
struct TileShape<MmaTile::kSmall> {  // decode: few tokens per expert; more blocks, deeper pipeline
  static constexpr int BN = 64, BT = 16, kStages = 8;
};
template <>
struct TileShape<MmaTile::kLarge> {  // prefill
  static constexpr int BN = 128, BT = 64, kStages = 4;
};

template <int BN, int BT, int kStages>
constexpr size_t smem_bytes() {
  const size_t pipe = static_cast<size_t>(kStages) * (BN + BT) * kBK * 2;
  const size_t epi = static_cast<size_t>(BT) * (BN + 4) * 4;
  return pipe > epi ? pipe : epi;
}

// Element offset of (row, 16-byte chunk) in a swizzled [rows][64] 16-bit tile.
__device__ __forceinline__ int swz(int row, int chunk) { return row * kBK + ((chunk ^ (row & 7)) << 3); }

template <typename T, MmaTile kTile, bool kUp>
__global__ void __launch_bounds__(kThreads) moe_gemm_mma_kernel(const GemmParams p) {
  constexpr int BN = TileShape<kTile>::BN, BT = TileShape<kTile>::BT, kStages = TileShape<kTile>::kStages;
  constexpr int WM = BN / 4, MI = WM / 16, NI = BT / 8;
  constexpr int kWChunks = BN * kBK / 8 / kThreads;  // 16-byte chunks per thread per stage
  constexpr int kXChunks = BT * kBK / 8 / kThreads;
  static_assert(kXChunks >= 1 && NI % 2 == 0, "tile shape");
  extern __shared__ __align__(128) unsigned char mma_smem[];
  T* sW = reinterpret_cast<T*>(mma_smem);  // [kStages][BN][BK]
  T* sX = sW + kStages * BN * kBK;         // [kStages][BT][BK]

  const int item_id = static_cast<int>(blockIdx.x) / p.n_tiles, n_tile = static_cast<int>(blockIdx.x) % p.n_tiles;
  if (item_id >= *p.n_items) return;
  const int4 item = p.items[item_id];
  const int r0 = item.y, rows = item.z, n0 = n_tile * BN;
  const T* W = static_cast<const T*>(p.weights[item.x]);
  const T* X = static_cast<const T*>(p.x);
  const int tid = static_cast<int>(threadIdx.x), lane = tid % 32, warp = tid / 32;
  const int KT = (p.K + kBK - 1) / kBK;

  // Loader assignment: chunk c = tid + i * 128 -> (row c / 8, chunk c % 8); the chunk column is the same for
  // every i, so one k-validity test per stage and thread.
  const int ld_chunk = tid % 8;
  const T* w_src[kWChunks];
  bool w_ok[kWChunks];
#pragma unroll
  for (int i = 0; i < kWChunks; ++i) {
    const int r = (tid + i * kThreads) / 8;
    w_ok[i] = n0 + r < p.N;
    w_src[i] = W + static_cast<int64_t>(w_ok[i] ? n0 + r : 0) * p.K + ld_chunk * 8;
  }
  const T* x_src[kXChunks];
  bool x_ok[kXChunks];
#pragma unroll
  for (int i = 0; i < kXChunks; ++i) {
    const int r = (tid + i * kThreads) / 8;
    x_ok[i] = r < rows;
    const int64_t src = !x_ok[i] ? 0 : kUp ? p.sorted_pair[r0 + r] / p.top_k : r0 + r;
    x_src[i] = X + src * p.K + ld_chunk * 8;
  }
  auto load_stage = [&](int stage, int kt) {
    const int k0 = kt * kBK;
    const bool k_ok = k0 + ld_chunk * 8 < p.K;
    T* dw = sW + stage * BN * kBK;
    T* dx = sX + stage * BT * kBK;
#pragma unroll
    for (int i = 0; i < kWChunks; ++i) {
      const int r = (tid + i * kThreads) / 8;
      const bool ok = w_ok[i] && k_ok;
      cp_async_16(smem_addr(dw + swz(r, ld_chunk)), ok ? w_src[i] + k0 : W, ok);
    }
#pragma unroll
    for (int i = 0; i < kXChunks; ++i) {
      const int r = (tid + i * kThreads) / 8;
      const bool ok = x_ok[i] && k_ok;
      cp_async_16(smem_addr(dx + swz(r, ld_chunk)), ok ? x_src[i] + k0 : X, ok);
    }
  };

  float acc[MI][NI][4];
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int ni = 0; ni < NI; ++ni)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[mi][ni][c] = 0.0f;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < KT) load_stage(s, s);
    cp_async_commit();
  }

  // ldmatrix lane roles. A (x4): lanes 0-15 rows 0-15 at k 0-7, lanes 16-31 rows 0-15 at k 8-15.
  // B (x4, two n8 tiles): lane -> token (lane / 16) * 8 + lane % 8, k half (lane / 8) % 2.
  const int a_row = warp * WM + lane % 16, a_khalf = lane / 16;
  const int b_row = (lane / 16) * 8 + lane % 8, b_khalf = (lane / 8) % 2;

  for (int kt = 0; kt < KT; ++kt) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    {
      const int nk = kt + kStages - 1;
      if (nk < KT) load_stage(nk % kStages, nk);
      cp_async_commit();
    }
    const T* tw = sW + (kt % kStages) * BN * kBK;
    const T* tx = sX + (kt % kStages) * BT * kBK;
#pragma unroll
    for (int kk = 0; kk < kBK / 16; ++kk) {
      uint32_t a[MI][4];
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) ldmatrix_x4(a[mi], smem_addr(tw + swz(a_row + mi * 16, kk * 2 + a_khalf)));
#pragma unroll
      for (int nj = 0; nj < NI; nj += 2) {
        uint32_t b[4];
        ldmatrix_x4(b, smem_addr(tx + swz(b_row + nj * 8, kk * 2 + b_khalf)));
#pragma unroll
        for (int mi = 0; mi < MI; ++mi) {
          mma_16816<T>(acc[mi][nj], a[mi], b[0], b[1]);
          mma_16816<T>(acc[mi][nj + 1], a[mi], b[2], b[3]);
        }
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();

  // Epilogue through shared memory (fp32 [BT][BN + 4]) so that global stores are whole 16-byte row chunks.
  // Accumulator (m16n8): c0, c1 at (weight row g, tokens 2q, 2q + 1), c2, c3 at row g + 8; g = lane / 4, q = lane % 4.
  constexpr int kLd = BN + 4;
  float* sOut = reinterpret_cast<float*>(mma_smem);
#pragma unroll
  for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
    for (int ni = 0; ni < NI; ++ni) {
      const int n = warp * WM + mi * 16 + lane / 4, m = ni * 8 + 2 * (lane % 4);
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        float v = acc[mi][ni][c];
        if constexpr (kUp) {
          v = fmaxf(v, 0.0f);
          v = v * v;
        }
        sOut[(m + (c & 1)) * kLd + n + (c >> 1) * 8] = v;
      }
    }
  }
  __syncthreads();

  if constexpr (kUp) {
    // h row r0 + m, columns n0 .. n0 + BN: 8 elements (16 bytes) per store. N % 8 == 0.
    T* h = static_cast<T*>(p.out);
    constexpr int kChunksPerRow = BN / 8;
    for (int c = tid; c < BT * kChunksPerRow; c += kThreads) {
      const int m = c / kChunksPerRow, n = (c % kChunksPerRow) * 8;
      if (m >= rows || n0 + n >= p.N) continue;
      const float* src = sOut + m * kLd + n;
      alignas(16) T v[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = from_float<T>(src[j]);
      *reinterpret_cast<uint4*>(h + static_cast<int64_t>(r0 + m) * p.N + n0 + n) = *reinterpret_cast<uint4*>(v);
    }
  } else {
    float* y = static_cast<float*>(p.out);
    constexpr int kChunksPerRow = BN / 4;
    for (int c = tid; c < BT * kChunksPerRow; c += kThreads) {
      const int m = c / kChunksPerRow, n = (c % kChunksPerRow) * 4;
      if (m >= rows || n0 + n >= p.N) continue;
      const int pair = p.sorted_pair[r0 + m];
      const float w = p.topk_weights[pair];
      const float* src = sOut + m * kLd + n;
      const float4 v = make_float4(src[0] * w, src[1] * w, src[2] * w, src[3] * w);
      *reinterpret_cast<float4*>(y + static_cast<int64_t>(pair) * p.N + n0 + n) = v;
    }
  }
}

template <typename T, MmaTile kTile, bool kUp>
void launch(GemmParams p, cudaStream_t stream) {
  using S = TileShape<kTile>;
  constexpr size_t smem = smem_bytes<S::BN, S::BT, S::kStages>();
  p.n_tiles = ceil_div(p.N, S::BN);
  const int64_t blocks = static_cast<int64_t>(p.n_tiles) * p.max_items;
  if (blocks == 0) return;
  if (blocks > 0x7fffffff) throw_runtime(str_cat("ops::moe_experts: ", blocks, " GEMM blocks is too many"));
  static const bool configured = [] {
    set_max_dynamic_smem(moe_gemm_mma_kernel<T, kTile, kUp>, smem, "ops::moe_experts");
    return true;
  }();
  (void)configured;
  moe_gemm_mma_kernel<T, kTile, kUp><<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(p);
  CHIMERA_LAUNCH_CHECK("ops::moe_experts");
}

template <typename T>
void launch_dtype(const GemmParams& p, MmaTile tile, bool up, cudaStream_t stream) {
  if (tile == MmaTile::kSmall) {
    up ? launch<T, MmaTile::kSmall, true>(p, stream) : launch<T, MmaTile::kSmall, false>(p, stream);
  } else {
    up ? launch<T, MmaTile::kLarge, true>(p, stream) : launch<T, MmaTile::kLarge, false>(p, stream);
  }
}

}  // namespace

int mma_tile_rows(MmaTile tile) {
  return tile == MmaTile::kSmall ? TileShape<MmaTile::kSmall>::BT : TileShape<MmaTile::kLarge>::BT;
}

void launch_moe_gemm_mma(GemmParams p, DType dtype, MmaTile tile, bool up, cudaStream_t stream) {
  switch (dtype) {
    case DType::kBF16:
      return launch_dtype<__nv_bfloat16>(p, tile, up, stream);
    case DType::kF16:
      return launch_dtype<__half>(p, tile, up, stream);
    default:
      throw_runtime(str_cat("ops::moe_experts: the tensor-core path takes BF16 or F16, not ", dtype_name(dtype)));
  }
}

}  // namespace chimera::cuda::moe
