#include "runtime/cache_sizing.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "runtime/memory_plan.h"

namespace chimera {
namespace {

size_t mul(size_t a, size_t b, const char* what) {
  size_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) invalid_input("cache sizing: {} overflows ({} x {})", what, a, b);
  return r;
}

size_t add(size_t a, size_t b, const char* what) {
  size_t r = 0;
  if (__builtin_add_overflow(a, b, &r)) invalid_input("cache sizing: {} overflows ({} + {})", what, a, b);
  return r;
}

size_t count(const ModelConfig& c, LayerKind k) {
  return static_cast<size_t>(std::count(c.layers.begin(), c.layers.end(), k));
}

size_t positive(int64_t v, const char* what) {
  if (v < 1) invalid_input("cache sizing: {} must be >= 1, got {}", what, v);
  return static_cast<size_t>(v);
}

}  // namespace

std::vector<int32_t> cuda_graph_batch_sizes(int32_t max_num_seqs) {
  std::vector<int32_t> sizes;
  for (int32_t b : {1, 2, 4}) {
    if (b < max_num_seqs) sizes.push_back(b);
  }
  for (int32_t b = 8; b < max_num_seqs; b += b < 256 ? 8 : 16) sizes.push_back(b);
  if (max_num_seqs >= 1) sizes.push_back(max_num_seqs);
  return sizes;
}

std::vector<int32_t> speculative_graph_batch_sizes(int32_t max_num_seqs, int32_t num_speculative_tokens,
                                                   int32_t block_size) {
  const int32_t K = num_speculative_tokens;
  CHIMERA_CHECK(K >= 1, "speculative graph batch sizes for {} drafts", K);
  if (2 * int64_t{K} > block_size) return {};
  std::vector<int32_t> sizes = cuda_graph_batch_sizes(max_num_seqs);
  std::erase_if(sizes, [K](int32_t n) { return int64_t{n} * (K + 1) > kMaxSpeculativeGraphRows; });
  return sizes;
}

int32_t cuda_graph_pad_rows(const std::vector<int32_t>& buckets) {
  int32_t widest = 0, previous = 0;
  for (int32_t b : buckets) {
    CHIMERA_CHECK(b > previous, "CUDA graph batch sizes must ascend from 1 (got {} after {})", b, previous);
    widest = std::max(widest, b - previous);
    previous = b;
  }
  return std::max(widest - 1, 0);
}

size_t mamba_slot_bytes(const ModelConfig& c, DType act_dtype, DType ssm_dtype) {
  const size_t conv = mul(mul(positive(c.conv_dim(), "conv_dim"), positive(c.conv_kernel - 1, "conv_kernel - 1"),
                              "conv state"),
                          dtype_size(act_dtype), "conv state bytes");
  const size_t ssm = mul(mul(mul(positive(c.mamba_num_heads, "mamba_num_heads"),
                                 positive(c.mamba_head_dim, "mamba_head_dim"), "SSM state"),
                             positive(c.ssm_state_size, "ssm_state_size"), "SSM state"),
                         dtype_size(ssm_dtype), "SSM state bytes");
  const size_t n = count(c, LayerKind::kMamba);
  return n == 0 ? 0 : mul(add(conv, ssm, "Mamba state"), n, "Mamba state of all layers");
}

size_t kv_block_bytes(const ModelConfig& c, DType act_dtype, int32_t block_size, bool kv_fp8) {
  const size_t n = count(c, LayerKind::kAttention);
  if (n == 0) return 0;
  const size_t per_token = mul(mul(2, positive(c.num_key_value_heads, "num_key_value_heads"), "KV"),
                               mul(positive(c.head_dim, "head_dim"), kv_fp8 ? 1 : dtype_size(act_dtype), "KV"),
                               "KV per token");
  return mul(mul(per_token, positive(block_size, "block size"), "KV block"), n, "KV block of all layers");
}

int32_t CacheSizingPlan::max_concurrency() const {
  const int64_t per_seq = (max_model_len + block_size - 1) / block_size;
  if (block_bytes == 0) return mamba_slots;
  return static_cast<int32_t>(std::min<int64_t>(mamba_slots, kv_blocks / per_seq));
}

CacheSizingPlan size_caches(const ModelConfig& c, DType act_dtype, size_t weights_bytes,
                            const device::MemoryInfo& memory, const CacheSizingRequest& r) {
  if (!(r.gpu_memory_utilization > 0.0 && r.gpu_memory_utilization <= 1.0)) {
    invalid_input("--gpu-memory-utilization must be in (0, 1], got {}", r.gpu_memory_utilization);
  }
  if (r.max_num_seqs < 0) invalid_input("--max-num-seqs must be >= 1, got {}", r.max_num_seqs);
  const bool auto_seqs = r.max_num_seqs == 0;
  const int32_t want = auto_seqs ? kAutoMaxNumSeqs : r.max_num_seqs;
  if (r.max_model_len < 1) invalid_input("--max-model-len must be >= 1, got {}", r.max_model_len);
  if (r.max_num_batched_tokens < 1) {
    invalid_input("--max-num-batched-tokens must be >= 1, got {}", r.max_num_batched_tokens);
  }
  if (r.block_size < 1) invalid_input("the KV block size must be >= 1, got {}", r.block_size);
  if (memory.total == 0 || memory.free > memory.total) {
    invalid_input("cache sizing: device memory reads {} bytes free of {}", memory.free, memory.total);
  }

  CacheSizingPlan p;
  p.total = memory.total;
  p.in_use = memory.total - memory.free;
  p.weights = weights_bytes;
  p.block_size = r.block_size;
  p.max_model_len = r.max_model_len;
  const auto allowed = static_cast<size_t>(std::floor(static_cast<double>(memory.total) * r.gpu_memory_utilization));
  if (allowed <= p.in_use) {
    invalid_input("--gpu-memory-utilization {} allows {} of {}, but {} is in use already (weights {}): nothing is "
                  "left for the caches",
                  r.gpu_memory_utilization, gib(allowed), gib(memory.total), gib(p.in_use), gib(weights_bytes));
  }
  p.budget = allowed - p.in_use;

  MemoryLimits lim;
  lim.max_num_seqs = want;
  lim.max_model_len = r.max_model_len;
  lim.max_tokens_per_step = r.max_num_batched_tokens;
  lim.block_size = r.block_size;
  p.workspace = plan_memory(c, act_dtype, act_dtype, lim).workspace;
  // The decode graphs share one pool, captured largest batch first and replayed one at a time, so a capture
  // reuses the blocks of the ones before it (device::AllocPool) and every graph writes its logits into one
  // buffer: the pool holds about the workspace of the largest bucket. A quarter on top covers the blocks that a
  // smaller capture cannot reuse (its requests fall between two sizes the larger capture freed).
  // The step workspace grows with the batch, so the largest bucket's is the largest.
  // A speculative engine's graphs are whole steps of n sequences of K + 1 rows each.
  const int32_t K = r.num_speculative_tokens;
  std::vector<int32_t> buckets;
  if (r.cuda_graphs) {
    buckets = K > 0 ? speculative_graph_batch_sizes(want, K, r.block_size) : cuda_graph_batch_sizes(want);
  }
  if (!buckets.empty()) {
    lim.max_num_seqs = buckets.back();
    lim.max_tokens_per_step = buckets.back() * (K + 1);
    const size_t largest = plan_memory(c, act_dtype, act_dtype, lim).workspace;
    p.graphs = add(largest, largest / 4, "graph allowance");
  }
  p.ssm_dtype = r.ssm_dtype;
  // Speculative decoding: K + 1 spare Mamba slots per sequence and the MTP head's attention KV (CacheSizes).
  const size_t per_seq_slots = r.num_speculative_tokens > 0 ? static_cast<size_t>(r.num_speculative_tokens) + 2 : 1;
  p.slot_bytes = mul(mamba_slot_bytes(c, act_dtype, r.ssm_dtype), per_seq_slots, "Mamba slots of a sequence");
  p.kv_cache_fp8 = r.kv_cache_fp8;
  p.block_bytes = kv_block_bytes(c, act_dtype, r.block_size, r.kv_cache_fp8);
  if (r.num_speculative_tokens > 0 && c.num_nextn_predict_layers > 0) {
    ModelConfig head = c;  // the head's sublayers as a model of their own: their KV per block
    head.layers = mtp_cache_layers(c);
    p.block_bytes = add(p.block_bytes, kv_block_bytes(head, act_dtype, r.block_size, r.kv_cache_fp8), "KV block");
  }
  // The graphs' pad rows each own a scratch Mamba slot and KV block (StateCache, CacheSizes::num_pad).
  p.pad_rows = cuda_graph_pad_rows(buckets);
  const size_t pad_bytes = mul(static_cast<size_t>(p.pad_rows), add(p.slot_bytes, p.block_bytes, "pad row"),
                               "CUDA-graph pad scratch");
  const size_t overhead = add(add(p.workspace, p.graphs, "workspace + graphs"), pad_bytes, "graphs' pad scratch");
  if (overhead >= p.budget) {
    invalid_input("--gpu-memory-utilization {} leaves {} after weights and what is in use, less than the step "
                  "workspace {} and the CUDA graphs' {} (pad scratch {}); lower --max-num-batched-tokens or "
                  "--max-num-seqs",
                  r.gpu_memory_utilization, gib(p.budget), gib(p.workspace), gib(p.graphs), gib(pad_bytes));
  }
  size_t caches = p.budget - overhead;
  // Prefix caching's Mamba checkpoints come off the top: each holds one sequence's Mamba state.
  p.prefix_caching = r.prefix_caching;
  p.checkpoint_interval = r.mamba_checkpoint_interval;
  if (r.prefix_caching && count(c, LayerKind::kMamba) > 0) {
    if (r.mamba_checkpoint_slots < 0) {
      invalid_input("--mamba-checkpoint-slots must be >= 0, got {}", r.mamba_checkpoint_slots);
    }
    p.checkpoint_bytes = mamba_slot_bytes(c, act_dtype, r.ssm_dtype);
    const size_t n = r.mamba_checkpoint_slots > 0 ? static_cast<size_t>(r.mamba_checkpoint_slots)
                                                  : std::max<size_t>(1, caches / 10 / p.checkpoint_bytes);
    const size_t bytes = mul(n, p.checkpoint_bytes, "Mamba checkpoints");
    if (bytes >= caches || n > INT32_MAX) {
      invalid_input("--mamba-checkpoint-slots {} need {}, more than the {} left for the caches", n, gib(bytes),
                    gib(caches));
    }
    p.checkpoint_slots = static_cast<int32_t>(n);
    caches -= bytes;
  }
  const size_t per_seq_blocks = (static_cast<size_t>(r.max_model_len) + r.block_size - 1) / r.block_size;
  const size_t one_seq_kv = mul(per_seq_blocks, p.block_bytes, "KV of one sequence");
  const size_t for_slots = caches > one_seq_kv ? caches - one_seq_kv : 0;
  const size_t fit = p.slot_bytes == 0 ? static_cast<size_t>(want) : for_slots / p.slot_bytes;
  p.max_slots_that_fit = static_cast<int32_t>(std::min<size_t>(fit, INT32_MAX));
  // Automatic: as many as fit (the workspace, graphs and pads above were planned for `want`, which covers fewer).
  const int32_t seqs = auto_seqs ? static_cast<int32_t>(std::min<size_t>(fit, static_cast<size_t>(want))) : want;
  if (caches <= one_seq_kv || seqs < 1 || fit < static_cast<size_t>(seqs)) {
    invalid_input("--max-num-seqs {} is above the {} Mamba state slots that fit: {} for the caches ({} x "
                  "--gpu-memory-utilization {} less {} in use, {} workspace, {} graphs and their pad scratch) hold one "
                  "{}-token sequence's KV ({}) and {} per slot",
                  auto_seqs ? std::string("(automatic)") : std::to_string(want), p.max_slots_that_fit, gib(caches), gib(memory.total), r.gpu_memory_utilization,
                  gib(p.in_use), gib(p.workspace), gib(p.graphs), r.max_model_len, gib(one_seq_kv), gib(p.slot_bytes));
  }
  p.mamba_slots = seqs;
  const size_t slots_bytes = mul(static_cast<size_t>(p.mamba_slots), p.slot_bytes, "Mamba state");
  const size_t usable_blocks = mul(per_seq_blocks, static_cast<size_t>(seqs), "KV blocks");
  const size_t blocks = p.block_bytes == 0 ? per_seq_blocks : (caches - slots_bytes) / p.block_bytes;
  p.kv_blocks = static_cast<int32_t>(std::min({blocks, usable_blocks, static_cast<size_t>(INT32_MAX)}));
  return p;
}

std::string format_cache_sizing(const CacheSizingPlan& p, const std::string& device_name) {
  const double per_request = static_cast<double>(p.kv_tokens()) / static_cast<double>(p.max_model_len);
  std::string pads;
  if (p.pad_rows > 0) {
    pads = fmt::format("CUDA-graph pads: {} scratch Mamba slots and KV blocks ({})\n", p.pad_rows,
                       gib(static_cast<size_t>(p.pad_rows) * (p.slot_bytes + p.block_bytes)));
  }
  std::string checkpoints;
  if (p.checkpoint_slots > 0) {
    checkpoints =
        fmt::format("prefix caching: {} Mamba state checkpoints, one every {} tokens ({})\n", p.checkpoint_slots,
                    p.checkpoint_interval, gib(static_cast<size_t>(p.checkpoint_slots) * p.checkpoint_bytes));
  } else if (p.prefix_caching) {
    checkpoints = "prefix caching: KV blocks only (the model has no Mamba layers)\n";
  }
  return fmt::format(
      "{} memory: {} total, {} allowed; in use {} (weights {}); workspace {}, CUDA graphs {}\n"
      "KV cache: {} blocks x {} = {} tokens ({}{}); Mamba state: {} slots ({}, SSM state {}; at most {} slots fit)\n"
      "{}{}maximum concurrency for {} tokens per request: {:.2f}x ({} sequences fit at once)\n",
      device_name, gib(p.total), gib(p.budget + p.in_use), gib(p.in_use), gib(p.weights), gib(p.workspace),
      gib(p.graphs), p.kv_blocks, p.block_size, p.kv_tokens(), gib(static_cast<size_t>(p.kv_blocks) * p.block_bytes),
      p.kv_cache_fp8 ? ", fp8" : "", p.mamba_slots, gib(p.mamba_slots * p.slot_bytes),
      ssm_cache_dtype_name(p.ssm_dtype), p.max_slots_that_fit, pads, checkpoints, p.max_model_len, per_request,
      p.max_concurrency());
}

}  // namespace chimera
