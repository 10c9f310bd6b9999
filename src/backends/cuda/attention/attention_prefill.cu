// Varlen causal prefill over a paged KV cache on tensor cores (FlashAttention-2 style forward).
//
// One CTA = one tile of kPrefillBlockM (64) query rows of one sequence x one q head; 4 warps, 16 rows each.
// Keys / values stream through shared memory in tiles of kPrefillBlockN (64) positions, double-buffered
// with cp.async: tile j+1 is in flight while tile j is multiplied. Each row of a K / V tile is gathered from
// the paged cache through the block table (zero-filled past the last key the tile's queries can see).
// Per tile and warp:  S = Q K^T (mma m16n8k16, fp32 accumulators) -> causal mask -> online softmax in fp32
// (running max m, running sum l, exp2 with the scale folded in) -> O = O * alpha + P V, P taken from the S
// registers as 16-bit A fragments. O / l is written once at the end.
// Work list: the host orders the tiles by decreasing key count (causal: later tiles see more keys), and
// the grid's fast dimension is the q head, so the heads sharing a kv head read a K / V tile from L2 together.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include "backends/cuda/attention/attention_kernels.cuh"
#include "backends/cuda/attention/mma_utils.cuh"
#include "backends/cuda/cuda_common.cuh"
#include "backends/cuda/launch.cuh"

namespace chimera::cuda::attn {
namespace {

constexpr int kThreads = 128;

template <int HD>
constexpr int prefill_smem_bytes() {
  return (kPrefillBlockM + 4 * kPrefillBlockN) * HD * 2;  // Q + 2 stages of K and V, 16-bit elements
}

template <typename T, int HD>
__global__ void __launch_bounds__(kThreads, 2) attention_prefill_kernel(AttentionParams p, const PrefillTile* tiles) {
  constexpr int BM = kPrefillBlockM, BN = kPrefillBlockN;
  constexpr int CH = HD / 8;              // 16-byte chunks per row
  extern __shared__ uint4 smem_u4[];
  T* sQ = reinterpret_cast<T*>(smem_u4);  // [BM][HD] swizzled
  T* sK = sQ + BM * HD;                   // [2][BN][HD]
  T* sV = sK + 2 * BN * HD;               // [2][BN][HD]

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, tq = lane % 4;
  pdl_wait();  // PDL: the tile list, q and the cache (this step's append) are earlier operations' outputs
  pdl_trigger();
  const int head = blockIdx.x;
  const PrefillTile tile = tiles[blockIdx.y];
  const AttnSeq sq = load_seq(p, tile.seq);
  const int kvh = head / (p.num_q_heads / p.num_kv_heads);
  const int m0 = tile.m0;
  const int rows = min(BM, sq.n_new - m0);
  const int kv_hi = sq.ctx_len + m0 + rows;  // keys [0, kv_hi) are visible to some row of the tile
  const int n_tiles = (kv_hi + BN - 1) / BN;
  const int64_t q_row_stride = static_cast<int64_t>(p.num_q_heads) * HD;

  // Q tile -> shared (cp.async group 0 together with K / V tile 0).
  {
    const T* qbase = static_cast<const T*>(p.q) + (static_cast<int64_t>(sq.q_start + m0) * p.num_q_heads + head) * HD;
    for (int c = tid; c < BM * CH; c += kThreads) {
      const int r = c / CH, ch = c % CH;
      const bool ok = r < rows;
      cp_async_16(sQ + swz<HD>(r, ch), ok ? qbase + r * q_row_stride + ch * 8 : qbase, ok);
    }
  }
  // Rows this thread copies in each K / V tile: r = tid / CH + i * (kThreads / CH), chunk tid % CH (load_kv_tile).
  const T* kc = static_cast<const T*>(p.k_cache);
  const T* vc = static_cast<const T*>(p.v_cache);
  const int my_ch = tid % CH, my_r0 = tid / CH;
  const int32_t* table = p.block_tables + static_cast<int64_t>(tile.seq) * p.max_blocks;
  auto load_kv = [&](int j, int buf) {
    load_kv_tile<T, HD, BN, kThreads>(sK, sV, buf, kc, vc, p, p.num_kv_heads, table, kvh, j * BN, kv_hi, my_r0, my_ch);
  };
  load_kv(0, 0);
  cp_async_commit();

  uint32_t qf[HD / 16][4];
  float o[HD / 8][4] = {};
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};
  // Last visible key of this thread's two rows (rows past the sequence end see everything, harmlessly).
  const int row_a = warp * 16 + g;
  const int lim[2] = {min(sq.ctx_len + m0 + row_a, kv_hi - 1), min(sq.ctx_len + m0 + row_a + 8, kv_hi - 1)};
  const int warp_first_q = sq.ctx_len + m0 + warp * 16;  // smallest query position of the warp

  for (int j = 0; j < n_tiles; ++j) {
    if (j + 1 < n_tiles) load_kv(j + 1, (j + 1) & 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    if (j == 0) {
#pragma unroll
      for (int kk = 0; kk < HD / 16; ++kk) ldmatrix_x4(qf[kk], sQ + swz<HD>(warp * 16 + (lane & 15), kk * 2 + (lane >> 4)));
    }
    const T* tK = sK + (j & 1) * BN * HD;
    const T* tV = sV + (j & 1) * BN * HD;

    // S = Q K^T: [16 rows, BN keys] per warp.
    float s[BN / 8][4];
#pragma unroll
    for (int i = 0; i < BN / 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
#pragma unroll
      for (int nn = 0; nn < BN / 16; ++nn) {
        uint32_t kb[4];
        ldmatrix_x4(kb, tK + swz<HD>(nn * 16 + (lane & 7) + ((lane >> 4) << 3), kk * 2 + ((lane >> 3) & 1)));
        mma_16816<T>(s[2 * nn], qf[kk], kb[0], kb[1]);
        mma_16816<T>(s[2 * nn + 1], qf[kk], kb[2], kb[3]);
      }
    }
    // Scale, and mask where the tile reaches past the warp's first query (the diagonal) or kv_hi.
    const bool need_mask = j * BN + BN - 1 > warp_first_q;
#pragma unroll
    for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        float v = s[nt][c] * p.scale_log2;
        if (need_mask) {
          const int key = j * BN + nt * 8 + 2 * tq + (c & 1);
          if (key > lim[c >> 1]) v = -INFINITY;
        }
        s[nt][c] = v;
      }
    }
    // Online softmax; key 0 is visible to every row, so after tile 0 the running max is finite.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * h], s[nt][2 * h + 1]));
      online_softmax_step<BN / 8, HD>(s, o, m_run[h], l_run[h], h, mx);
    }
    // O += P V: P from the S registers, V^T fragments by transposed ldmatrix.
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      const uint32_t pa[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]), pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                              pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                              pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int nn = 0; nn < HD / 16; ++nn) {
        uint32_t vb[4];
        ldmatrix_x4_trans(vb, tV + swz<HD>(kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3), nn * 2 + (lane >> 4)));
        mma_16816<T>(o[2 * nn], pa, vb[0], vb[1]);
        mma_16816<T>(o[2 * nn + 1], pa, vb[2], vb[3]);
      }
    }
    __syncthreads();  // the buffer of tile j is refilled by the next iteration's load
  }

  // out = O / l for the tile's valid rows.
  T* obase = static_cast<T*>(p.out) + (static_cast<int64_t>(sq.q_start + m0) * p.num_q_heads + head) * HD;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = row_a + 8 * h;
    const float inv = 1.0f / quad_sum(l_run[h]);
    if (r < rows) {
      uint32_t* orow = reinterpret_cast<uint32_t*>(obase + r * q_row_stride);
#pragma unroll
      for (int nt = 0; nt < HD / 8; ++nt) orow[nt * 4 + tq] = pack2<T>(o[nt][2 * h] * inv, o[nt][2 * h + 1] * inv);
    }
  }
}

}  // namespace

template <typename T, int HD>
void launch_attention_prefill(const AttentionParams& p, const PrefillTile* tiles, int num_tiles, cudaStream_t stream) {
  if (num_tiles == 0) return;
  constexpr int smem = prefill_smem_bytes<HD>();
  static const bool configured = [] {
    CHIMERA_CUDA_CHECK(cudaFuncSetAttribute(attention_prefill_kernel<T, HD>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
                       "ops::attention (prefill)");
    return true;
  }();
  (void)configured;
  if (num_tiles > 65535) {
    throw_runtime(str_cat("ops::attention: ", num_tiles, " prefill tiles exceed the grid limit of 65535"));
  }
  const dim3 grid(p.num_q_heads, num_tiles), block(kThreads);
  launch(attention_prefill_kernel<T, HD>, grid, block, smem, stream, p, tiles);
  CHIMERA_LAUNCH_CHECK("ops::attention (prefill)");
}

template void launch_attention_prefill<__nv_bfloat16, 64>(const AttentionParams&, const PrefillTile*, int, cudaStream_t);
template void launch_attention_prefill<__nv_bfloat16, 128>(const AttentionParams&, const PrefillTile*, int,
                                                           cudaStream_t);
template void launch_attention_prefill<__half, 64>(const AttentionParams&, const PrefillTile*, int, cudaStream_t);
template void launch_attention_prefill<__half, 128>(const AttentionParams&, const PrefillTile*, int, cudaStream_t);

}  // namespace chimera::cuda::attn
