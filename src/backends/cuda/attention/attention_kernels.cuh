// Attention kernels of the CUDA backend (docs/model.md 4: causal GQA, no positional encoding, paged KV cache).
// Plain params structs and launchers; no framework types. attention.cu adapts Tensors to these.
//
//   q, out:        [T, Qh, hd]                       activation dtype (F32, BF16 or F16)
//   k_new, v_new:  [T, KVh, hd]                      this step's keys / values
//   k/v cache:     [num_blocks, block_size, KVh, hd] same dtype as the activations, or FP8 E4M3 bytes holding
//                  e4m3(x / k_scale) (ops.h KvCacheView; the *_fp8 launchers)
//   block_tables:  [S, max_blocks] I32 on the device (row s lists sequence s's blocks in order)
//   seqs:          [S] AttnSeq on the device (uploaded from cu_seqlens / context_lens), or null and then
//   cu_seqlens:    [S + 1] I32 on the device  } the step's metadata, written by the host before the step (a
//   context_lens:  [S] I32 on the device      } captured step's inputs): kernels build AttnSeq from them (load_seq)
// Sequence s owns query rows [q_start, q_start + n_new); query i of it sits at position ctx_len + i and
// attends to positions [0, ctx_len + i]; the sequence's keys span [0, ctx_len + n_new).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace chimera::cuda::attn {

struct AttnSeq {
  int q_start;  // first query row of the sequence in q / out
  int n_new;    // tokens this step (0: idle sequence)
  int ctx_len;  // tokens already cached before this step
  int pad;
};

struct AttentionParams {
  const void* q = nullptr;
  const void* k_new = nullptr;
  const void* v_new = nullptr;
  void* out = nullptr;
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  const int32_t* block_tables = nullptr;
  const AttnSeq* seqs = nullptr;          // the eager path: a host-built table, uploaded
  const int32_t* cu_seqlens = nullptr;    // the captured path (seqs null): device step metadata
  const int32_t* context_lens = nullptr;
  int num_seqs = 0;
  int num_tokens = 0;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int block_size = 0;
  int max_blocks = 0;    // columns of block_tables
  float scale_log2 = 0;  // softmax scale * log2(e): the kernels use exp2
  float k_scale = 1.0f;  // FP8 cache only: stored = e4m3(x / scale), read = e4m3 * scale
  float v_scale = 1.0f;
};

// Sequence s's AttnSeq, from the uploaded table or, on the captured path, from the device cu_seqlens /
// context_lens (no table-building launch: one attention layer's decode step is on the critical path per launch).
// Both are step metadata the host wrote before the step: readable before pdl_wait() (launch.cuh).
__device__ __forceinline__ AttnSeq load_seq(const AttentionParams& p, int s) {
  if (p.seqs != nullptr) return p.seqs[s];
  const int q0 = p.cu_seqlens[s];
  return {q0, p.cu_seqlens[s + 1] - q0, p.context_lens[s], 0};
}
// Its first query row alone (the binary search of attention_generic.cu).
__device__ __forceinline__ int load_q_start(const AttentionParams& p, int s) {
  return p.seqs != nullptr ? p.seqs[s].q_start : p.cu_seqlens[s];
}

// Prefill work list entry: one tile of kPrefillBlockM query rows of one sequence.
struct PrefillTile {
  int seq;
  int m0;  // first query row of the tile, relative to the sequence
};
inline constexpr int kPrefillBlockM = 64;  // query rows per CTA (4 warps x 16)
inline constexpr int kPrefillBlockN = 64;  // keys per pipeline stage

// Split-KV decode (flash-decoding): the n_tiles = ceil(kv_len / kDecodeTileKeys) key tiles of each
// (sequence, kv head) are cut into splits = ceil(n_tiles / tiles_per_split) near-equal ranges (split i
// takes tiles [i * n_tiles / splits, (i + 1) * n_tiles / splits)); each split is one CTA. With more than
// one split, the partial results land in the workspace and a combine kernel merges them in split order
// (attention_decode.cu).
inline constexpr int kDecodeTileKeys = 64;  // keys per pipeline stage (16 per warp)
inline constexpr int kDecodeMaxGroup = 16;  // query heads of one kv head packed into the MMA's 16 rows
__host__ __device__ inline int decode_num_splits(int kv_len, int tiles_per_split) {
  const int n_tiles = (kv_len + kDecodeTileKeys - 1) / kDecodeTileKeys;
  return (n_tiles + tiles_per_split - 1) / tiles_per_split;
}
struct DecodeWorkspace {
  float* part_o = nullptr;   // [S, KVh, max_splits, 16, hd]   per split, already divided by its l
  float2* part_ml = nullptr; // [S, KVh, max_splits, 16]       (running max in log2 units, sum l)
  int tiles_per_split = 1;
  int max_splits = 1;
  // The decode kernel appends this step's k_new / v_new rows to the cache itself (no launch_append_kv before it):
  // needs k_new / v_new 16-byte aligned.
  bool append_kv = false;
};

// Appends k_new / v_new into the paged cache at positions ctx_len .. ctx_len + n_new - 1 (bit-exact copy).
template <typename T>
void launch_append_kv(const AttentionParams& p, cudaStream_t stream);

// An FP8 E4M3 cache (ops.h KvCacheView): the append stores e4m3(x / scale) (round to nearest even, saturated, as
// the CPU's f32_to_e4m3), the attention is the generic kernel reading e4m3 x scale. T: the activation dtype.
template <typename T>
void launch_append_kv_fp8(const AttentionParams& p, cudaStream_t stream);
template <typename T>
void launch_attention_generic_fp8(const AttentionParams& p, cudaStream_t stream);

// Any head_dim, any dtype: one warp per (query row, head), keys streamed with an online softmax in fp32.
// The F32 path, and the fallback for head dims / GQA groups the tensor-core kernels do not cover.
template <typename T>
void launch_attention_generic(const AttentionParams& p, cudaStream_t stream);

// Varlen causal prefill on tensor cores (mma.sync m16n8k16, bf16 / f16 operands, fp32 accumulation).
template <typename T, int HD>
void launch_attention_prefill(const AttentionParams& p, const PrefillTile* tiles, int num_tiles,
                              cudaStream_t stream);

// One new token per sequence over a long paged context, split across CTAs, then combined. With ws.append_kv it
// also appends that token's k / v (the same cache bits as launch_append_kv), so no append launch precedes it.
template <typename T, int HD>
void launch_attention_decode(const AttentionParams& p, const DecodeWorkspace& ws, cudaStream_t stream);

}  // namespace chimera::cuda::attn
