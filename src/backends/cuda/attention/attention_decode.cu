// Paged decode attention: one new query token per sequence over a long cached context (flash-decoding).
//
// GQA packing: the `group` = Qh / KVh query heads that share a kv head are the 16 rows of one m16n8k16 MMA
// (zero rows when group < 16), so every K / V byte read from the cache serves all of them through the
// tensor cores; decode is bound by the KV read, and this keeps the arithmetic far under it.
// Split-KV: grid (split, kv head, sequence). Each CTA takes a near-equal range of key tiles of one sequence and
// streams them in tiles of kDecodeTileKeys (64) through a cp.async pipeline of kStages; inside a tile warp w
// owns keys 16w .. 16w+15 and keeps its own online softmax (m, l, O). At the end the 4 warps merge through
// shared memory; a sequence with one split writes the output, otherwise the split writes O / l and (m, l)
// to the workspace and attention_decode_combine_kernel merges the splits of each (sequence, q head) with
// log-sum-exp weights in split order (one thread per (head, dim)), so the result does not depend on which split
// finished first.
// Folded append (DecodeWorkspace::append_kv, the default on this path): the new token's k / v row (position ctx_len,
// the last key) lies in the last tile of the last split of each (sequence, kv head). That CTA gathers the row into
// its K / V tile straight from k_new / v_new (load_kv_tile's new_pos, same cp.async stage as the rest of the tile)
// and copies it into the paged cache; every other CTA's key range ends before ctx_len. So no CTA of the launch reads
// the cache row being written, and the output bits equal those of a separate append_kv launch before the kernel
// (the tile holds the same bits either way).
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
constexpr int kStages = 3;
constexpr int kTile = kDecodeTileKeys;

template <int HD>
constexpr int decode_smem_bytes() {
  return (16 + 2 * kStages * kTile) * HD * 2;  // Q (16 rows) + kStages of K and V tiles, 16-bit elements
}

template <typename T, int HD>
__global__ void __launch_bounds__(kThreads) attention_decode_kernel(AttentionParams p, DecodeWorkspace ws) {
  constexpr int CH = HD / 8;
  extern __shared__ uint4 smem_u4[];
  T* sQ = reinterpret_cast<T*>(smem_u4);  // [16][HD]
  T* sK = sQ + 16 * HD;                   // [kStages][kTile][HD]
  T* sV = sK + kStages * kTile * HD;      // [kStages][kTile][HD]

  const int split = blockIdx.x, kvh = blockIdx.y, seq = blockIdx.z;
  const AttnSeq sq = load_seq(p, seq);  // step metadata: readable before the wait
  // PDL: q, k_new / v_new and the cache (without the folded append: this step's append_kv) are earlier kernels'
  // outputs; the cache row appended here may still be read by the previous step. Every block waits (launch.cuh).
  pdl_wait();
  pdl_trigger();
  if (sq.n_new == 0) return;  // idle sequence: nothing to attend to, nothing appended
  const int kv_len = sq.ctx_len + sq.n_new;  // n_new == 1 on this path
  const int num_splits = decode_num_splits(kv_len, ws.tiles_per_split);
  if (split >= num_splits) return;  // the captured plan's surplus CTAs
  const int seq_tiles = (kv_len + kTile - 1) / kTile;
  const int t_begin = static_cast<int>(static_cast<int64_t>(split) * seq_tiles / num_splits);
  const int t_end = static_cast<int>(static_cast<int64_t>(split + 1) * seq_tiles / num_splits);
  const int k_begin = t_begin * kTile;
  const int k_end = min(kv_len, t_end * kTile);
  const int n_tiles = t_end - t_begin;  // >= 1: num_splits <= seq_tiles
  const int group = p.num_q_heads / p.num_kv_heads;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, tq = lane % 4;

  // Q rows = the group's heads of the one query row (zero rows past the group).
  const T* qbase = static_cast<const T*>(p.q) + (static_cast<int64_t>(sq.q_start) * p.num_q_heads + kvh * group) * HD;
  for (int c = tid; c < 16 * CH; c += kThreads) {
    const int r = c / CH, ch = c % CH;
    const bool ok = r < group;
    cp_async_16(sQ + swz<HD>(r, ch), ok ? qbase + r * HD + ch * 8 : qbase, ok);
  }
  const T* kc = static_cast<const T*>(p.k_cache);
  const T* vc = static_cast<const T*>(p.v_cache);
  const int my_ch = tid % CH, my_r0 = tid / CH;
  const int32_t* table = p.block_tables + static_cast<int64_t>(seq) * p.max_blocks;
  // Folded append: the last split holds key ctx_len (k_end == kv_len), taken from this step's k / v row.
  const bool appends = ws.append_kv && split == num_splits - 1;
  const int new_pos = appends ? sq.ctx_len : -1;
  const int64_t new_off = (static_cast<int64_t>(sq.q_start) * p.num_kv_heads + kvh) * HD;  // in k_new / v_new
  auto load_kv = [&](int j, int buf) {
    load_kv_tile<T, HD, kTile, kThreads, true>(sK, sV, buf, kc, vc, p, p.num_kv_heads, table, kvh, k_begin + j * kTile,
                                               k_end, my_r0, my_ch, new_pos, new_off);
  };
#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) {
    if (st < n_tiles) load_kv(st, st);
    cp_async_commit();
  }
  // The append itself: the row's [HD] k and v slices of kv head kvh, one 16-byte chunk per thread (2 * CH <= 32: one
  // warp), the bits append_kv copies. Issued after the first tiles' cp.async so their latencies overlap.
  if (appends && tid < 2 * CH) {
    const int pos = sq.ctx_len, ch = tid % CH;
    const int64_t row = static_cast<int64_t>(table[pos / p.block_size]) * p.block_size + pos % p.block_size;
    const int64_t dst_off = (row * p.num_kv_heads + kvh) * HD;
    const bool is_v = tid >= CH;
    const uint4* src = reinterpret_cast<const uint4*>(static_cast<const T*>(is_v ? p.v_new : p.k_new) + new_off);
    uint4* dst = reinterpret_cast<uint4*>(static_cast<T*>(is_v ? p.v_cache : p.k_cache) + dst_off);
    dst[ch] = src[ch];
  }

  uint32_t qf[HD / 16][4];
  float o[HD / 8][4] = {};
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};

  for (int j = 0; j < n_tiles; ++j) {
    const int jn = j + kStages - 1;
    if (jn < n_tiles) load_kv(jn, jn % kStages);
    cp_async_commit();
    cp_async_wait<kStages - 1>();
    __syncthreads();
    if (j == 0) {
#pragma unroll
      for (int kk = 0; kk < HD / 16; ++kk) ldmatrix_x4(qf[kk], sQ + swz<HD>(lane & 15, kk * 2 + (lane >> 4)));
    }
    const T* tK = sK + (j % kStages) * kTile * HD;
    const T* tV = sV + (j % kStages) * kTile * HD;
    const int key0 = k_begin + j * kTile + warp * 16;  // first key of this warp's 16
    if (key0 < k_end) {
      float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
      for (int kk = 0; kk < HD / 16; ++kk) {
        uint32_t kb[4];
        ldmatrix_x4(kb, tK + swz<HD>(warp * 16 + (lane & 7) + ((lane >> 4) << 3), kk * 2 + ((lane >> 3) & 1)));
        mma_16816<T>(s[0], qf[kk], kb[0], kb[1]);
        mma_16816<T>(s[1], qf[kk], kb[2], kb[3]);
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int key = key0 + nt * 8 + 2 * tq + (c & 1);
          s[nt][c] = key < k_end ? s[nt][c] * p.scale_log2 : -INFINITY;
        }
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        // The new running max is finite: key0 < k_end is visible.
        online_softmax_step<2, HD>(s, o, m_run[h], l_run[h], h,
                                   fmaxf(fmaxf(s[0][2 * h], s[0][2 * h + 1]), fmaxf(s[1][2 * h], s[1][2 * h + 1])));
      }
      const uint32_t pa[4] = {pack2<T>(s[0][0], s[0][1]), pack2<T>(s[0][2], s[0][3]), pack2<T>(s[1][0], s[1][1]),
                              pack2<T>(s[1][2], s[1][3])};
#pragma unroll
      for (int nn = 0; nn < HD / 16; ++nn) {
        uint32_t vb[4];
        ldmatrix_x4_trans(vb, tV + swz<HD>(warp * 16 + (lane & 7) + (((lane >> 3) & 1) << 3), nn * 2 + (lane >> 4)));
        mma_16816<T>(o[2 * nn], pa, vb[0], vb[1]);
        mma_16816<T>(o[2 * nn + 1], pa, vb[2], vb[3]);
      }
    }
    __syncthreads();
  }
  cp_async_wait<0>();

  // Merge the 4 warps: unnormalised O and (m, l) per row through shared memory (the K / V stages are free).
  float* sO = reinterpret_cast<float*>(sK);          // [4][16][HD]
  float2* sML = reinterpret_cast<float2*>(sV);       // [4][16]
  static_assert(4 * 16 * HD * 4 <= kStages * kTile * HD * 2, "merge buffer must fit in the K stages");
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = g + 8 * h;
    const float l = quad_sum(l_run[h]);
    if (tq == 0) sML[warp * 16 + r] = make_float2(m_run[h], l);
#pragma unroll
    for (int nt = 0; nt < HD / 8; ++nt) {
      sO[(warp * 16 + r) * HD + nt * 8 + 2 * tq] = o[nt][2 * h];
      sO[(warp * 16 + r) * HD + nt * 8 + 2 * tq + 1] = o[nt][2 * h + 1];
    }
  }
  __syncthreads();
  const bool direct = num_splits == 1;
  const int64_t part = (static_cast<int64_t>(seq) * p.num_kv_heads + kvh) * ws.max_splits + split;
  for (int idx = tid; idx < group * HD; idx += kThreads) {
    const int r = idx / HD, d = idx % HD;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < 4; ++w) mx = fmaxf(mx, sML[w * 16 + r].x);  // finite: warp 0 saw key k_begin
    float l = 0.0f, acc = 0.0f;
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const float2 ml = sML[w * 16 + r];
      const float f = exp2f(ml.x - mx);  // 0 for a warp that saw no key (m = -inf)
      l += ml.y * f;
      acc += sO[(w * 16 + r) * HD + d] * f;
    }
    if (direct) {
      T* orow = static_cast<T*>(p.out) + (static_cast<int64_t>(sq.q_start) * p.num_q_heads + kvh * group + r) * HD;
      orow[d] = from_float<T>(acc / l);
    } else {
      ws.part_o[(part * 16 + r) * HD + d] = acc / l;
      if (d == 0) ws.part_ml[part * 16 + r] = make_float2(mx, l);
    }
  }
}

// Merges the splits of each (sequence, q head): out = sum_i w_i O_i, w_i = l_i 2^(m_i - M) / sum_j (...).
// grid (q head, sequence), HD threads.
template <typename T, int HD>
__global__ void __launch_bounds__(HD) attention_decode_combine_kernel(AttentionParams p, DecodeWorkspace ws) {
  const int head = blockIdx.x, seq = blockIdx.y, d = threadIdx.x;
  const AttnSeq sq = load_seq(p, seq);  // step metadata: readable before the wait
  pdl_wait();  // PDL: the split kernel's partial results
  pdl_trigger();
  if (sq.n_new == 0) return;
  const int kv_len = sq.ctx_len + sq.n_new;
  const int num_splits = decode_num_splits(kv_len, ws.tiles_per_split);
  if (num_splits == 1) return;  // written by the split kernel
  const int group = p.num_q_heads / p.num_kv_heads;
  const int kvh = head / group, r = head % group;
  const int64_t part0 = (static_cast<int64_t>(seq) * p.num_kv_heads + kvh) * ws.max_splits;
  // Unrolled so that several splits' loads are in flight (the sums keep split order).
  float mx = -INFINITY;
#pragma unroll 8
  for (int i = 0; i < num_splits; ++i) mx = fmaxf(mx, ws.part_ml[(part0 + i) * 16 + r].x);
  float l = 0.0f, acc = 0.0f;
#pragma unroll 8
  for (int i = 0; i < num_splits; ++i) {
    const float2 ml = ws.part_ml[(part0 + i) * 16 + r];
    const float w = ml.y * exp2f(ml.x - mx);
    l += w;
    acc += w * ws.part_o[((part0 + i) * 16 + r) * HD + d];
  }
  T* orow = static_cast<T*>(p.out) + (static_cast<int64_t>(sq.q_start) * p.num_q_heads + head) * HD;
  orow[d] = from_float<T>(acc / l);
}


}  // namespace

template <typename T, int HD>
void launch_attention_decode(const AttentionParams& p, const DecodeWorkspace& ws, cudaStream_t stream) {
  if (p.num_seqs == 0) return;
  constexpr int smem = decode_smem_bytes<HD>();
  static const bool configured = [] {
    CHIMERA_CUDA_CHECK(cudaFuncSetAttribute(attention_decode_kernel<T, HD>,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
                       "ops::attention (decode)");
    return true;
  }();
  (void)configured;
  if (p.num_seqs > 65535 || ws.max_splits > 65535) {
    throw_runtime(str_cat("ops::attention: decode grid (", ws.max_splits, " splits, ", p.num_seqs,
                          " sequences) exceeds 65535"));
  }
  const dim3 grid(ws.max_splits, p.num_kv_heads, p.num_seqs);
  launch(attention_decode_kernel<T, HD>, grid, dim3(kThreads), smem, stream, p, ws);
  CHIMERA_LAUNCH_CHECK("ops::attention (decode)");
  if (ws.max_splits > 1) {
    launch(attention_decode_combine_kernel<T, HD>, dim3(p.num_q_heads, p.num_seqs), dim3(HD), 0, stream, p, ws);
    CHIMERA_LAUNCH_CHECK("ops::attention (decode combine)");
  }
}

template void launch_attention_decode<__nv_bfloat16, 64>(const AttentionParams&, const DecodeWorkspace&, cudaStream_t);
template void launch_attention_decode<__nv_bfloat16, 128>(const AttentionParams&, const DecodeWorkspace&,
                                                          cudaStream_t);
template void launch_attention_decode<__half, 64>(const AttentionParams&, const DecodeWorkspace&, cudaStream_t);
template void launch_attention_decode<__half, 128>(const AttentionParams&, const DecodeWorkspace&, cudaStream_t);

}  // namespace chimera::cuda::attn
