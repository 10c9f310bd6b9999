// Sizing the caches from the device's memory (as vLLM's --gpu-memory-utilization): after the weights are
// loaded, the engine may use `gpu_memory_utilization` of the device's total memory. Whatever is in use already
// (the weights, the CUDA context, other processes) comes off that budget, then the step workspace and the CUDA
// graphs' allowance and the graphs' pad scratch (pad Mamba slots and as many KV blocks, one each per pad row a
// graph bucket can carry); the rest holds the Mamba state slots (one per sequence in flight, max_num_seqs of
// them) and the paged KV pool (every remaining whole block, up to what max_num_seqs sequences of max_model_len
// tokens can use). The same arithmetic runs on the host against MemAvailable / MemTotal.
//   budget    = total x utilization - (total - free)
//   caches    = budget - workspace - graphs - pad x (slot_bytes + block_bytes)
//   slots     = max_num_seqs                         (kInvalidInput when fewer fit beside one full sequence's KV)
//   kv_blocks = min((caches - slots x slot_bytes) / block_bytes, max_num_seqs x blocks_per_seq)
//   max concurrency = min(slots, kv_blocks / blocks_per_seq): sequences of max_model_len that fit at once
// All products and sums are checked (kInvalidInput on overflow, naming the quantity).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "backends/device_api.h"
#include "core/dtype.h"
#include "io/model_config.h"
#include "runtime/state_cache.h"

namespace chimera {

// vLLM's defaults for a server on a GPU of >= 70 GiB: up to 1024 sequences at once, 8192 tokens per step.
inline constexpr int32_t kAutoMaxNumSeqs = 1024;
inline constexpr int32_t kLargeGpuMaxNumBatchedTokens = 8192;
inline constexpr int32_t kSmallGpuMaxNumBatchedTokens = 2048;
inline constexpr size_t kLargeGpuBytes = size_t{70} << 30;

struct CacheSizingRequest {
  double gpu_memory_utilization = 0.9;  // in (0, 1]
  // 0: as many as fit, up to kAutoMaxNumSeqs (the caches and graphs are planned for kAutoMaxNumSeqs first, then
  // the slots are cut to what fits); otherwise exactly this many, or kInvalidInput when fewer fit.
  int32_t max_num_seqs = 256;
  int32_t max_model_len = 4096;
  int32_t max_num_batched_tokens = 2048;
  int32_t block_size = 16;
  // Reserve the graphs' allowance and pad scratch: decode buckets up to max_num_seqs, or with speculative decoding
  // the speculative steps' buckets (speculative_graph_batch_sizes).
  bool cuda_graphs = true;
  DType ssm_dtype = DType::kF32;  // the SSM state's dtype (--mamba-ssm-cache-dtype): its bytes per slot
  bool kv_cache_fp8 = false;      // --kv-cache-dtype fp8: one byte per K / V element
  // Speculative decoding's K (0: off): each sequence's slot_bytes include its K + 1 spare Mamba slots, and a block's
  // bytes the MTP head's attention sublayers (CacheSizes::spare_slots, CacheSizes::mtp).
  int32_t num_speculative_tokens = 0;
  // Prefix caching: the Mamba checkpoints' spacing, and their slots; 0: a tenth of the cache memory (after the
  // workspace, graphs and pads) in checkpoints of one sequence's Mamba state each, at least one.
  bool prefix_caching = false;
  int32_t mamba_checkpoint_interval = 2048;
  int32_t mamba_checkpoint_slots = 0;
};

struct CacheSizingPlan {
  size_t total = 0;          // device memory
  size_t in_use = 0;         // total - free when sized (weights included)
  size_t weights = 0;        // as the caller counted them (reported, already inside in_use)
  size_t budget = 0;         // total x utilization - in_use
  size_t workspace = 0;      // step activations at max_num_batched_tokens (memory_plan's estimate)
  size_t graphs = 0;         // allowance for the captured decode graphs' private pool
  int32_t pad_rows = 0;      // scratch Mamba slots and KV blocks for the graphs' pad rows (cuda_graph_pad_rows)
  size_t slot_bytes = 0;     // Mamba conv + SSM state of one sequence, all Mamba layers (and its spare slots)
  size_t block_bytes = 0;    // K + V of one block, all attention layers
  int32_t mamba_slots = 0;
  int32_t kv_blocks = 0;
  bool prefix_caching = false;
  int32_t checkpoint_slots = 0;  // Mamba checkpoints (prefix caching)
  int32_t checkpoint_interval = 0;
  size_t checkpoint_bytes = 0;  // one checkpoint: one sequence's Mamba state
  int32_t block_size = 0;
  int32_t max_model_len = 0;
  int32_t max_slots_that_fit = 0;  // Mamba slots the budget could hold beside one full sequence's KV
  DType ssm_dtype = DType::kF32;
  bool kv_cache_fp8 = false;
  int64_t kv_tokens() const { return static_cast<int64_t>(kv_blocks) * block_size; }
  // Sequences of max_model_len tokens that fit at once (slots and KV both).
  int32_t max_concurrency() const;
  // Everything the StateCache allocates: the sequences' slots and blocks and the pad scratch.
  size_t cache_bytes() const {
    return (static_cast<size_t>(mamba_slots) + pad_rows) * slot_bytes +
           (static_cast<size_t>(kv_blocks) + pad_rows) * block_bytes +
           static_cast<size_t>(checkpoint_slots) * checkpoint_bytes;
  }
  CacheSizes cache_sizes() const {
    return CacheSizes{.max_seqs = mamba_slots,
                      .max_model_len = max_model_len,
                      .block_size = block_size,
                      .num_blocks = kv_blocks,
                      .num_pad = pad_rows,
                      .ssm_dtype = ssm_dtype,
                      .kv_cache_fp8 = kv_cache_fp8,
                      .prefix_caching = prefix_caching,
                      .checkpoint_slots = checkpoint_slots,
                      .checkpoint_interval = checkpoint_interval};
  }
};

// The decode batch sizes the engine captures CUDA graphs for, ascending, ending at max_num_seqs:
// 1, 2, 4, 8, then every multiple of 8 up to 256, then of 16 (vLLM's capture sizes), capped.
std::vector<int32_t> cuda_graph_batch_sizes(int32_t max_num_seqs);
// A captured speculative step's rows at most (runtime/engine.h): its logits, in the activation dtype and then fp32
// for the sampler, are the largest part of the graph pool.
inline constexpr int64_t kMaxSpeculativeGraphRows = 512;
// The batch sizes (sequences) a speculative engine captures whole steps for, K = num_speculative_tokens >= 1 drafts
// each: the decode buckets whose n (K + 1) rows are at most kMaxSpeculativeGraphRows; none when 2K > block_size (a
// pad sequence's draft steps write the head's KV up to position 2K - 1 of its one scratch block).
std::vector<int32_t> speculative_graph_batch_sizes(int32_t max_num_seqs, int32_t num_speculative_tokens,
                                                   int32_t block_size);
// The most pad rows a decode step of B rows carries when it replays the smallest bucket >= B: the widest gap
// between consecutive buckets (and between 0 and the first) less one. Buckets ascending; empty -> 0.
//   {1, 2, 4, 8, 16, 20} -> 7 (B = 9 replays 16);  vLLM's sizes past 256 -> 15
int32_t cuda_graph_pad_rows(const std::vector<int32_t>& buckets);

// Bytes of one sequence's Mamba state (conv state in act_dtype, SSM state in ssm_dtype) and of one KV block, exactly
// as StateCache allocates them.
size_t mamba_slot_bytes(const ModelConfig& config, DType act_dtype, DType ssm_dtype = DType::kF32);
// kv_fp8: an FP8 E4M3 cache (1 byte an element) instead of act_dtype.
size_t kv_block_bytes(const ModelConfig& config, DType act_dtype, int32_t block_size, bool kv_fp8 = false);

// kInvalidInput, naming the flag, for a utilization outside (0, 1], limits < 1, a budget that holds nothing, or
// --max-num-seqs above the Mamba slots that fit.
CacheSizingPlan size_caches(const ModelConfig& config, DType act_dtype, size_t weights_bytes,
                            const device::MemoryInfo& memory, const CacheSizingRequest& request);

// The start-up lines, e.g.
//   memory: 139.80 GiB total, 0.90 utilization; weights 58.95 GiB; in use 60.12 GiB; workspace 1.20 GiB;
//   graphs 0.50 GiB
//   KV cache: 41210 blocks x 16 = 659360 tokens (30.12 GiB); Mamba state: 256 slots (11.01 GiB, SSM state float32;
//   at most 1391 slots fit)
//   CUDA-graph pads: 15 scratch Mamba slots and KV blocks (0.65 GiB)            (only with pad rows)
//   maximum concurrency for 4096 tokens per request: 160.98x (256 sequences fit in both)
std::string format_cache_sizing(const CacheSizingPlan& plan, const std::string& device_name);

}  // namespace chimera
