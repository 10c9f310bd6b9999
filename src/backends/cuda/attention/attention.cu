// ops::attention on CUDA: Tensors -> AttentionParams, host metadata -> device, kernel choice.
//
//   1. append this step's k, v into the paged cache (attention_generic.cu: append_kv_kernel); on the split-KV
//      decode path the decode kernel does it itself (attention_decode.cu; CHIMERA_ATTN_DECODE_APPEND=0: separate)
//   2. attention over the cache, by dtype / head_dim / shape of the batch:
//        F32, or head_dim not 64 / 128, or unaligned tensors -> attention_generic_kernel (any shape)
//        BF16 / F16, every sequence has at most one new token, Qh / KVh <= 16 -> split-KV decode
//        BF16 / F16 otherwise (prefill, chunked prefill, mixed batches)   -> tensor-core prefill
#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <type_traits>
#include <vector>

#include "backends/cuda/attention/attention_kernels.cuh"
#include "backends/cuda/cuda_common.cuh"
#include "backends/cuda/cuda_ops.h"
#include "backends/cuda/launch.cuh"
#include "backends/device_api.h"

namespace chimera::cuda {
namespace {

constexpr char kOp[] = "ops::attention";

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// Target key tiles per decode split: about four CTAs per SM over the whole batch (balanced splits of
// near-equal size per sequence, decode_num_splits), at least one 64-key tile each.
int decode_tiles_per_split(const std::vector<attn::AttnSeq>& seqs, int kv_heads) {
  int64_t tiles = 0;
  for (const auto& s : seqs) {
    if (s.n_new > 0) tiles += int64_t{kv_heads} * ceil_div(s.ctx_len + s.n_new, attn::kDecodeTileKeys);
  }
  const int64_t target_ctas = int64_t{4} * sm_count();
  return static_cast<int>(std::max<int64_t>(1, (tiles + target_ctas - 1) / target_ctas));
}

// The split plan of a graph-captured decode step cannot look at this step's context lengths: it is sized for
// every sequence at the longest context its block table row can hold (kv_bound), the kernel computing each
// sequence's own split count from its device AttnSeq (CTAs past it exit at once).
void plan_splits_for_bound(attn::DecodeWorkspace& ws, int num_seqs, int kv_heads, int kv_bound) {
  const int64_t tiles = int64_t{num_seqs} * kv_heads * ceil_div(kv_bound, attn::kDecodeTileKeys);
  const int64_t target_ctas = int64_t{4} * sm_count();
  ws.tiles_per_split = static_cast<int>(std::max<int64_t>(1, (tiles + target_ctas - 1) / target_ctas));
  ws.max_splits = attn::decode_num_splits(kv_bound, ws.tiles_per_split);
}

// aligned: q, out and the cache 16-byte aligned (the tensor-core kernels); new_aligned: k, v too (the folded append).
template <typename T>
void run(const ops::Context& ctx, const attn::AttentionParams& base, const std::vector<attn::AttnSeq>& seqs,
         int max_new, bool aligned, bool new_aligned, bool device_meta) {
  cudaStream_t stream = as_stream(ctx.stream);
  attn::AttentionParams p = base;
  if constexpr (std::is_same_v<T, float>) {
    attn::launch_append_kv<T>(p, stream);
    attn::launch_attention_generic<T>(p, stream);
  } else {
    const int hd = p.head_dim, group = p.num_q_heads / p.num_kv_heads;
    const bool tensor_cores = (hd == 64 || hd == 128) && aligned;
    const bool decode = tensor_cores && max_new <= 1 && group <= attn::kDecodeMaxGroup;
    if (tensor_cores && !decode && device_meta) {
      throw_runtime(str_cat(kOp, ": device-side metadata (a captured step) is supported for decode batches only, "
                                 "not for a prefill of ", max_new, " tokens"));
    }
    // The split-KV decode kernel appends the step's k / v rows itself: no append launch on the decode path.
    const bool fold_append = decode && new_aligned && ctx.kernels.attention_decode_append;
    if (!fold_append) attn::launch_append_kv<T>(p, stream);
    if (!tensor_cores) {
      attn::launch_attention_generic<T>(p, stream);
    } else if (decode) {
      attn::DecodeWorkspace ws;
      ws.append_kv = fold_append;
      if (device_meta) {
        plan_splits_for_bound(ws, p.num_seqs, p.num_kv_heads, p.max_blocks * p.block_size);
      } else {
        ws.tiles_per_split = decode_tiles_per_split(seqs, p.num_kv_heads);
        for (const auto& s : seqs) {
          ws.max_splits = std::max(ws.max_splits, attn::decode_num_splits(s.ctx_len + s.n_new, ws.tiles_per_split));
        }
      }
      // Workspace from the caching allocator: released at return, but any reuse is a later launch on the
      // same stream, so it is ordered after these kernels.
      Tensor part_o, part_ml;
      if (ws.max_splits > 1) {
        const int64_t parts = int64_t{p.num_seqs} * p.num_kv_heads * ws.max_splits * 16;
        part_o = device::empty(Device::kCuda, DType::kF32, {parts, hd});
        part_ml = device::empty(Device::kCuda, DType::kF32, {parts, 2});
        ws.part_o = part_o.f32();
        ws.part_ml = reinterpret_cast<float2*>(part_ml.f32());
      }
      if (hd == 64) attn::launch_attention_decode<T, 64>(p, ws, stream);
      else attn::launch_attention_decode<T, 128>(p, ws, stream);
    } else {
      // Tiles of 64 query rows, heaviest (most keys) first.
      std::vector<attn::PrefillTile> tiles;
      std::vector<int> work;
      for (int s = 0; s < static_cast<int>(seqs.size()); ++s) {
        for (int m0 = 0; m0 < seqs[static_cast<size_t>(s)].n_new; m0 += attn::kPrefillBlockM) {
          tiles.push_back({s, m0});
          work.push_back(seqs[static_cast<size_t>(s)].ctx_len + m0);
        }
      }
      std::vector<int> order(tiles.size());
      for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
      std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return work[a] > work[b]; });
      std::vector<attn::PrefillTile> sorted(tiles.size());
      for (size_t i = 0; i < order.size(); ++i) sorted[i] = tiles[static_cast<size_t>(order[i])];
      const auto* dev_tiles = static_cast<const attn::PrefillTile*>(
          upload_scratch(sorted.data(), sorted.size() * sizeof(attn::PrefillTile), stream, 1));
      const int n = static_cast<int>(sorted.size());
      if (hd == 64) attn::launch_attention_prefill<T, 64>(p, dev_tiles, n, stream);
      else attn::launch_attention_prefill<T, 128>(p, dev_tiles, n, stream);
    }
  }
}

}  // namespace

void attention(const ops::Context& ctx, const Tensor& out, const Tensor& q, const Tensor& k, const Tensor& v,
               const ops::KvCacheView& cache, const ops::Indices& cu_seqlens, const ops::Indices& context_lens,
               const Tensor& block_tables, float scale) {
  // One dtype per call: activations and the cache (KV cache dtype = activation dtype), or an FP8 E4M3 cache.
  const DType dt = q.dtype();
  const bool fp8 = cache.k.dtype() == DType::kF8E4M3 && cache.v.dtype() == DType::kF8E4M3;
  for (const Tensor* t : {&out, &k, &v, &cache.k, &cache.v}) {
    if (t->dtype() != dt && !(fp8 && (t == &cache.k || t == &cache.v))) {
      throw_runtime(str_cat(kOp, ": ", t->describe(), " does not match q ", q.describe(),
                            " (q, k, v, out and the KV cache share one dtype on CUDA, or the cache is F8_E4M3)"));
    }
  }
  const int64_t T = q.dim(0);
  if (T == 0) return;
  if (T > INT32_MAX || cache.k.dim(0) * cache.k.dim(1) > INT32_MAX) {
    throw_runtime(str_cat(kOp, ": ", q.describe(), " / ", cache.k.describe(), " exceed 32-bit row counts"));
  }

  std::vector<attn::AttnSeq> seqs(context_lens.size());
  int max_new = 0;
  for (size_t s = 0; s < seqs.size(); ++s) {
    seqs[s] = {cu_seqlens[s], cu_seqlens[s + 1] - cu_seqlens[s], context_lens[s], 0};
    max_new = std::max(max_new, seqs[s].n_new);
  }
  cudaStream_t stream = as_stream(ctx.stream);

  attn::AttentionParams p;
  p.q = q.data();
  p.k_new = k.data();
  p.v_new = v.data();
  p.out = out.data();
  p.k_cache = cache.k.data();
  p.v_cache = cache.v.data();
  p.block_tables = block_tables.data_as<const int32_t>();
  // Graph-capturable decode (ops::Indices::device given): the kernels build each sequence's AttnSeq from the device
  // cu_seqlens / context_lens (load_seq), so nothing of this step's host values reaches a launch, and no launch
  // builds a table.
  const bool device_meta = cu_seqlens.device != nullptr && context_lens.device != nullptr;
  if (device_meta) {
    p.cu_seqlens = cu_seqlens.device;
    p.context_lens = context_lens.device;
  } else {
    p.seqs = static_cast<const attn::AttnSeq*>(
        upload_scratch(seqs.data(), seqs.size() * sizeof(attn::AttnSeq), stream, 0));
  }
  p.num_seqs = static_cast<int>(seqs.size());
  p.num_tokens = static_cast<int>(T);
  p.num_q_heads = static_cast<int>(q.dim(1));
  p.num_kv_heads = static_cast<int>(k.dim(1));
  p.head_dim = static_cast<int>(q.dim(2));
  p.block_size = static_cast<int>(cache.k.dim(1));
  p.max_blocks = static_cast<int>(block_tables.dim(1));
  p.scale_log2 = scale * 1.4426950408889634f;
  p.k_scale = cache.k_scale;
  p.v_scale = cache.v_scale;
  if (fp8) {  // the FP8 cache: a quantizing append, then the generic kernel dequantizing as it reads
    CHIMERA_DISPATCH_FLOAT(dt, "ops::attention q", Tc, {
      attn::launch_append_kv_fp8<Tc>(p, stream);
      attn::launch_attention_generic_fp8<Tc>(p, stream);
    });
    return;
  }
  const bool aligned = aligned16(p.q) && aligned16(p.out) && aligned16(p.k_cache) && aligned16(p.v_cache);
  const bool new_aligned = aligned16(p.k_new) && aligned16(p.v_new);

  CHIMERA_DISPATCH_FLOAT(dt, "ops::attention q", Tc,
                         run<Tc>(ctx, p, seqs, max_new, aligned, new_aligned, device_meta));
}


}  // namespace chimera::cuda
