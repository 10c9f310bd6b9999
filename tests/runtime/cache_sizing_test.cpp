// Sizing the caches from a device's memory: the plan's arithmetic against hand-set memory figures, the caches
// it describes allocated for real (their bytes must equal the plan's), the errors a user can cause, and one
// run against this host's MemAvailable, so the CPU path CI runs is the one the GPU uses.
#include "runtime/cache_sizing.h"

#include <gtest/gtest.h>

#include <algorithm>

#include "common/backend_param.h"
#include "common/compare.h"
#include "runtime/memory_plan.h"

namespace chimera {
namespace {

constexpr size_t kGiB = size_t{1} << 30;

ModelConfig tiny() { return load_model_config(test::source_path("models/nemotron-h-tiny")); }

TEST(CacheSizing, GraphBatchSizesAreVllmsCaptureSizesUpToMaxNumSeqs) {
  EXPECT_EQ(cuda_graph_batch_sizes(1), (std::vector<int32_t>{1}));
  EXPECT_EQ(cuda_graph_batch_sizes(4), (std::vector<int32_t>{1, 2, 4}));
  EXPECT_EQ(cuda_graph_batch_sizes(10), (std::vector<int32_t>{1, 2, 4, 8, 10}));
  EXPECT_EQ(cuda_graph_batch_sizes(24), (std::vector<int32_t>{1, 2, 4, 8, 16, 24}));
  const std::vector<int32_t> big = cuda_graph_batch_sizes(300);
  EXPECT_EQ(big.size(), 3u + 32u + 3u);  // 1 2 4 | 8..256 step 8 | 272 288 | 300
  EXPECT_EQ(big[35], 272);
  EXPECT_EQ(big.back(), 300);
  EXPECT_TRUE(std::is_sorted(big.begin(), big.end()));
}

TEST(CacheSizing, GraphPadRowsAreTheWidestGapBetweenBucketsLessOne) {
  EXPECT_EQ(cuda_graph_pad_rows({}), 0);
  EXPECT_EQ(cuda_graph_pad_rows({1}), 0);
  EXPECT_EQ(cuda_graph_pad_rows({1, 2}), 0);
  EXPECT_EQ(cuda_graph_pad_rows({1, 2, 4}), 1);          // 3 replays 4
  EXPECT_EQ(cuda_graph_pad_rows({1, 2, 4, 8, 10}), 3);   // 5 replays 8
  EXPECT_EQ(cuda_graph_pad_rows({1, 2, 4, 8, 16, 20}), 7);  // 9 replays 16
  EXPECT_EQ(cuda_graph_pad_rows({4}), 3);                // the gap from 0 counts: 1 replays 4
  EXPECT_EQ(cuda_graph_pad_rows(cuda_graph_batch_sizes(256)), 7);
  EXPECT_EQ(cuda_graph_pad_rows(cuda_graph_batch_sizes(257)), 7);    // 256 -> 257 adds a gap of 1
  EXPECT_EQ(cuda_graph_pad_rows(cuda_graph_batch_sizes(1024)), 15);    // multiples of 16 past 256
  // Every batch size B up to the largest bucket pads to the smallest bucket >= B with at most that many rows.
  for (int32_t max : {1, 3, 20, 100, 300, 1024}) {
    const std::vector<int32_t> buckets = cuda_graph_batch_sizes(max);
    const int32_t pads = cuda_graph_pad_rows(buckets);
    int32_t widest = 0;
    for (int32_t b = 1; b <= max; ++b) {
      const int32_t bucket = *std::lower_bound(buckets.begin(), buckets.end(), b);
      widest = std::max(widest, bucket - b);
    }
    EXPECT_EQ(pads, widest) << "max_num_seqs " << max;
  }
  EXPECT_THROW(cuda_graph_pad_rows({2, 1}), Error);  // not ascending
}

// A speculative engine captures whole steps of n sequences x (K + 1) rows: the decode buckets up to 512 rows, none
// when a pad sequence's draft steps would leave its scratch block (2K > block size).
TEST(CacheSizing, SpeculativeGraphBatchSizesKeepTheirRowsWithin512) {
  EXPECT_EQ(speculative_graph_batch_sizes(4, 1, 16), (std::vector<int32_t>{1, 2, 4}));
  EXPECT_EQ(speculative_graph_batch_sizes(64, 3, 16), cuda_graph_batch_sizes(64));  // 64 x 4 = 256 rows
  const std::vector<int32_t> k3 = speculative_graph_batch_sizes(1024, 3, 16);
  EXPECT_EQ(k3.back(), 128);  // 128 x 4 = 512 rows
  EXPECT_EQ(k3.size(), 3u + 16u);
  EXPECT_EQ(speculative_graph_batch_sizes(1024, 1, 16).back(), 256);
  EXPECT_EQ(speculative_graph_batch_sizes(1024, 8, 16).back(), 56);  // 56 x 9 = 504
  EXPECT_TRUE(speculative_graph_batch_sizes(64, 9, 16).empty());     // 18 positions > a 16-token block
  EXPECT_EQ(speculative_graph_batch_sizes(8, 9, 32), cuda_graph_batch_sizes(8));
  EXPECT_THROW(speculative_graph_batch_sizes(8, 0, 16), Error);
}

// The cache sizing reserves the graphs a speculative engine captures: the pool of its largest step (n sequences of
// K + 1 rows) and the pad scratch of its buckets, each pad slot with its spare slots.
TEST(CacheSizing, SpeculativeGraphsAreReserved) {
  const ModelConfig c = tiny();
  CacheSizingRequest r;
  r.max_num_seqs = 8;
  r.max_model_len = 1000;
  r.max_num_batched_tokens = 512;
  r.num_speculative_tokens = 3;
  const CacheSizingPlan p = size_caches(c, DType::kBF16, 0, {8 * kGiB, 10 * kGiB}, r);
  MemoryLimits largest;
  largest.max_num_seqs = 8;
  largest.max_model_len = 1000;
  largest.max_tokens_per_step = 8 * 4;
  largest.block_size = 16;
  const size_t ws = plan_memory(c, DType::kBF16, DType::kBF16, largest).workspace;
  EXPECT_EQ(p.graphs, ws + ws / 4);
  EXPECT_EQ(p.pad_rows, 3);                                        // buckets 1, 2, 4, 8
  EXPECT_EQ(p.slot_bytes, 5 * mamba_slot_bytes(c, DType::kBF16));  // the slot and its K + 1 spares
  // Drafts that no captured step takes (2K > the block size): nothing reserved.
  r.num_speculative_tokens = 9;
  const CacheSizingPlan none = size_caches(c, DType::kBF16, 0, {8 * kGiB, 10 * kGiB}, r);
  EXPECT_EQ(none.graphs, 0u);
  EXPECT_EQ(none.pad_rows, 0);
}

TEST(CacheSizing, PerSlotAndPerBlockBytesMatchWhatStateCacheAllocates) {
  const ModelConfig c = tiny();
  // 3 slots and 5 blocks of 16, allocated for real (CPU, F32): the bytes split exactly into slots and blocks.
  const StateCache cache(c, CacheSizes{.max_seqs = 3, .max_model_len = 64, .block_size = 16, .num_blocks = 5});
  EXPECT_EQ(cache.bytes(), 3 * mamba_slot_bytes(c, DType::kF32) + 5 * kv_block_bytes(c, DType::kF32, 16));
  // bf16 halves the conv state and KV, not the fp32 SSM state.
  EXPECT_EQ(kv_block_bytes(c, DType::kBF16, 16) * 2, kv_block_bytes(c, DType::kF32, 16));
  EXPECT_LT(mamba_slot_bytes(c, DType::kBF16), mamba_slot_bytes(c, DType::kF32));
  EXPECT_GT(mamba_slot_bytes(c, DType::kBF16) * 2, mamba_slot_bytes(c, DType::kF32));
}

// --mamba-ssm-cache-dtype: a 16-bit SSM state takes half the SSM bytes of a slot, the StateCache allocates exactly
// that, and the same budget then holds more slots (max_slots_that_fit, printed in the start-up line).
TEST(CacheSizing, SixteenBitSsmStateHalvesTheSsmBytesSoMoreSlotsFit) {
  const ModelConfig c = tiny();
  const size_t ssm_f32 = static_cast<size_t>(c.mamba_num_heads * c.mamba_head_dim * c.ssm_state_size) * 4 *
                         static_cast<size_t>(std::count(c.layers.begin(), c.layers.end(), LayerKind::kMamba));
  for (const DType sd : {DType::kBF16, DType::kF16}) {
    EXPECT_EQ(mamba_slot_bytes(c, DType::kBF16, DType::kF32) - mamba_slot_bytes(c, DType::kBF16, sd), ssm_f32 / 2);
    EXPECT_EQ(StateCache::mamba_state_bytes_per_seq(c, DType::kF32) - StateCache::mamba_state_bytes_per_seq(c, sd),
              ssm_f32 / 2);
    const CacheSizes sizes{.max_seqs = 3, .max_model_len = 64, .block_size = 16, .num_blocks = 5, .ssm_dtype = sd};
    StateCache cache(c, sizes, Device::kCpu, DType::kBF16);
    EXPECT_EQ(cache.bytes(), 3 * mamba_slot_bytes(c, DType::kBF16, sd) + 5 * kv_block_bytes(c, DType::kBF16, 16));
    for (size_t i = 0; i < c.layers.size(); ++i) {
      if (c.layers[i] == LayerKind::kMamba) {
        EXPECT_EQ(cache.state().ssm[i].dtype(), sd);
      }
    }
    MemoryLimits lim;
    lim.max_num_seqs = 4;
    lim.ssm_dtype = DType::kF32;
    const MemoryPlan p32 = plan_memory(c, DType::kBF16, DType::kBF16, lim);
    lim.ssm_dtype = sd;
    EXPECT_EQ(p32.mamba_state - plan_memory(c, DType::kBF16, DType::kBF16, lim).mamba_state, 4 * ssm_f32 / 2);
  }
  CacheSizingRequest r;
  r.max_num_seqs = 4;
  r.max_model_len = 256;
  r.max_num_batched_tokens = 256;
  r.cuda_graphs = false;
  const device::MemoryInfo mem{kGiB / 8, kGiB / 8};
  const CacheSizingPlan f32 = size_caches(c, DType::kBF16, 0, mem, r);
  r.ssm_dtype = DType::kF16;
  const CacheSizingPlan f16 = size_caches(c, DType::kBF16, 0, mem, r);
  EXPECT_EQ(f16.cache_sizes().ssm_dtype, DType::kF16);
  EXPECT_GT(f16.max_slots_that_fit, f32.max_slots_that_fit * 3 / 2);
  EXPECT_NE(format_cache_sizing(f16, "GPU").find("SSM state float16; at most " +
                                                 std::to_string(f16.max_slots_that_fit) + " slots fit"),
            std::string::npos)
      << format_cache_sizing(f16, "GPU");
}

// --kv-cache-dtype fp8: one byte a K / V element in the block size, the plan, the memory plan and the allocation.
TEST(CacheSizing, Fp8KvCacheCountsOneByteAnElement) {
  const ModelConfig c = tiny();
  const size_t per_token_elems = static_cast<size_t>(2 * c.num_key_value_heads * c.head_dim) *
                                 static_cast<size_t>(std::count(c.layers.begin(), c.layers.end(), LayerKind::kAttention));
  EXPECT_EQ(kv_block_bytes(c, DType::kBF16, 16, true), per_token_elems * 16);
  EXPECT_EQ(kv_block_bytes(c, DType::kF32, 16, true), per_token_elems * 16);
  EXPECT_EQ(StateCache::kv_bytes_per_token(c, 1), per_token_elems);
  StateCache cache(c, CacheSizes{.max_seqs = 2, .max_model_len = 64, .block_size = 16, .num_blocks = 6,
                                 .kv_cache_fp8 = true},
                   Device::kCpu, DType::kF32);
  EXPECT_EQ(cache.bytes(), 2 * mamba_slot_bytes(c, DType::kF32) + 6 * kv_block_bytes(c, DType::kF32, 16, true));
  for (size_t i = 0; i < c.layers.size(); ++i) {
    if (c.layers[i] == LayerKind::kAttention) {
      EXPECT_EQ(cache.state().kv[i].k.dtype(), DType::kF8E4M3);
      EXPECT_EQ(cache.state().kv[i].v.dtype(), DType::kF8E4M3);
      EXPECT_EQ(cache.state().kv[i].k_scale, 1.0f);
    }
  }
  MemoryLimits lim;
  lim.max_num_seqs = 3;
  const MemoryPlan bf16 = plan_memory(c, DType::kBF16, DType::kBF16, lim);
  lim.kv_cache_fp8 = true;
  EXPECT_EQ(plan_memory(c, DType::kBF16, DType::kBF16, lim).kv_cache * 2, bf16.kv_cache);
  CacheSizingRequest r;
  r.max_num_seqs = 2;
  r.max_model_len = 256;
  r.max_num_batched_tokens = 256;
  r.cuda_graphs = false;
  r.gpu_memory_utilization = 1.0;
  const device::MemoryInfo mem{kGiB / 64, kGiB / 64};
  const CacheSizingPlan p16 = size_caches(c, DType::kBF16, 0, mem, r);
  r.kv_cache_fp8 = true;
  const CacheSizingPlan p8 = size_caches(c, DType::kBF16, 0, mem, r);
  EXPECT_EQ(p8.block_bytes * 2, p16.block_bytes);
  EXPECT_TRUE(p8.cache_sizes().kv_cache_fp8);
  EXPECT_NE(format_cache_sizing(p8, "GPU").find(", fp8); Mamba state"), std::string::npos) << format_cache_sizing(p8, "GPU");
}

// Prefix caching's Mamba checkpoints: a tenth of the caches' memory by default (or the count asked), taken before the
// slots and blocks, allocated by the StateCache exactly as planned, and printed.
TEST(CacheSizing, PrefixCachingCheckpointsComeOffTheCaches) {
  const ModelConfig c = tiny();
  CacheSizingRequest r;
  r.max_num_seqs = 2;
  r.max_model_len = 256;
  r.max_num_batched_tokens = 256;
  r.cuda_graphs = false;
  r.gpu_memory_utilization = 1.0;
  const device::MemoryInfo mem{kGiB / 64, kGiB / 64};
  const CacheSizingPlan off = size_caches(c, DType::kF32, 0, mem, r);
  EXPECT_EQ(off.checkpoint_slots, 0);
  r.prefix_caching = true;
  r.mamba_checkpoint_interval = 64;
  const CacheSizingPlan on = size_caches(c, DType::kF32, 0, mem, r);
  const size_t slot = mamba_slot_bytes(c, DType::kF32);
  EXPECT_EQ(on.checkpoint_bytes, slot);
  const size_t caches = off.budget - off.workspace - off.graphs;
  EXPECT_EQ(static_cast<size_t>(on.checkpoint_slots), caches / 10 / slot);
  EXPECT_LE(on.kv_blocks, off.kv_blocks);
  EXPECT_LE(on.cache_bytes(), caches);
  const CacheSizes sizes = on.cache_sizes();
  EXPECT_TRUE(sizes.prefix_caching);
  EXPECT_EQ(sizes.checkpoint_interval, 64);
  EXPECT_EQ(StateCache(c, sizes, Device::kCpu, DType::kF32).bytes(), on.cache_bytes());
  EXPECT_NE(format_cache_sizing(on, "GPU").find(fmt::format("prefix caching: {} Mamba state checkpoints, one every 64 "
                                                            "tokens",
                                                            on.checkpoint_slots)),
            std::string::npos)
      << format_cache_sizing(on, "GPU");
  r.mamba_checkpoint_slots = 3;
  EXPECT_EQ(size_caches(c, DType::kF32, 0, mem, r).checkpoint_slots, 3);
  r.mamba_checkpoint_slots = 1 << 30;
  EXPECT_TRUE(test::throws_error([&] { size_caches(c, DType::kF32, 0, mem, r); }, ErrorKind::kInvalidInput,
                                 "--mamba-checkpoint-slots"));
  // The interval must be whole blocks.
  CacheSizes bad = sizes;
  bad.checkpoint_interval = 24;
  EXPECT_TRUE(test::throws_error([&] { StateCache(c, bad, Device::kCpu, DType::kF32); }, ErrorKind::kInvalidInput,
                                 "--mamba-checkpoint-interval 24"));
}

TEST(CacheSizing, BudgetIsUtilizationOfTotalLessWhatIsInUse) {
  const ModelConfig c = tiny();
  CacheSizingRequest r;
  r.gpu_memory_utilization = 0.5;
  r.max_num_seqs = 8;
  r.max_model_len = 1000;
  r.max_num_batched_tokens = 512;
  r.block_size = 16;
  // 10 GiB, 8 free: 5 GiB allowed, 2 in use -> 3 GiB budget: far more than 8 sequences of 1000 tokens use, so the
  // pool is capped at 8 x 63 blocks and every slot has its full length.
  const CacheSizingPlan p = size_caches(c, DType::kBF16, 123, {8 * kGiB, 10 * kGiB}, r);
  EXPECT_EQ(p.budget, 3 * kGiB);
  EXPECT_EQ(p.in_use, 2 * kGiB);
  EXPECT_EQ(p.weights, 123u);
  EXPECT_EQ(p.mamba_slots, 8);
  EXPECT_EQ(p.kv_blocks, 8 * 63);
  EXPECT_EQ(p.kv_tokens(), 8 * 63 * 16);
  EXPECT_EQ(p.max_concurrency(), 8);
  EXPECT_GT(p.workspace, 0u);
  // The graphs share one pool: the largest bucket's (8 rows) step workspace and a quarter more, not a sum.
  MemoryLimits largest;
  largest.max_num_seqs = 8;
  largest.max_model_len = 1000;
  largest.max_tokens_per_step = 8;
  largest.block_size = 16;
  const size_t ws8 = plan_memory(c, DType::kBF16, DType::kBF16, largest).workspace;
  EXPECT_EQ(p.graphs, ws8 + ws8 / 4);
  const CacheSizes s = p.cache_sizes();
  EXPECT_EQ(s.max_seqs, 8);
  EXPECT_EQ(s.num_blocks, 8 * 63);
  EXPECT_EQ(s.max_model_len, 1000);
  const std::string log = format_cache_sizing(p, "GPU");
  EXPECT_NE(log.find("KV cache: 504 blocks x 16 = 8064 tokens"), std::string::npos) << log;
  EXPECT_NE(log.find("Mamba state: 8 slots"), std::string::npos) << log;
  EXPECT_NE(log.find("maximum concurrency for 1000 tokens per request: 8.06x (8 sequences fit at once)"),
            std::string::npos)
      << log;

  // A budget that holds only part of that: the blocks are what remains after the slots and the overheads.
  const size_t slot = mamba_slot_bytes(c, DType::kBF16), block = kv_block_bytes(c, DType::kBF16, 16);
  const size_t caches = 8 * slot + 100 * block + block / 2;  // room for 100 whole blocks
  r.gpu_memory_utilization = 1.0;
  // Buckets 1, 2, 4, 8: a batch of 5 replays 8 with 3 pad rows, each with a scratch slot and block of its own.
  EXPECT_EQ(p.pad_rows, 3);
  const size_t free = p.workspace + p.graphs + 3 * (slot + block) + caches;
  const CacheSizingPlan q = size_caches(c, DType::kBF16, 0, {free, free + kGiB}, r);
  EXPECT_EQ(q.budget, free);
  EXPECT_EQ(q.kv_blocks, 100);
  EXPECT_EQ(q.max_concurrency(), 1);  // 100 blocks hold one 63-block sequence
  EXPECT_LE(q.cache_bytes() + q.workspace + q.graphs, q.budget);
  // The plan allocates: StateCache accepts its sizes (one full sequence fits) and holds exactly its bytes.
  const StateCache cache(c, q.cache_sizes(), Device::kCpu, DType::kBF16);
  EXPECT_EQ(cache.bytes(), q.cache_bytes());
  EXPECT_EQ(cache.bytes(), 11 * slot + 103 * block);  // the pads' 3 slots and 3 blocks past the sequences' part
  EXPECT_EQ(cache.sizes().num_blocks, 100);
  EXPECT_EQ(cache.free_blocks(), 100);
  EXPECT_EQ(cache.free_slots(), 8);
  EXPECT_NE(format_cache_sizing(q, "GPU").find("CUDA-graph pads: 3 scratch Mamba slots and KV blocks"),
            std::string::npos)
      << format_cache_sizing(q, "GPU");
  // Without graphs the allowance and the pad scratch go to the KV pool.
  r.cuda_graphs = false;
  const CacheSizingPlan eager = size_caches(c, DType::kBF16, 0, {free, free + kGiB}, r);
  EXPECT_EQ(eager.pad_rows, 0);
  EXPECT_GT(eager.kv_blocks, 103);
  EXPECT_EQ(format_cache_sizing(eager, "GPU").find("CUDA-graph pads"), std::string::npos);
}

TEST(CacheSizing, ClearErrorsForWhatDoesNotFit) {
  const ModelConfig c = tiny();
  CacheSizingRequest r;
  r.max_num_seqs = 4;
  r.max_model_len = 256;
  r.max_num_batched_tokens = 64;
  const device::MemoryInfo m{4 * kGiB, 8 * kGiB};
  for (double u : {0.0, -0.1, 1.5}) {
    r.gpu_memory_utilization = u;
    EXPECT_TRUE(test::throws_error([&] { size_caches(c, DType::kBF16, 0, m, r); }, ErrorKind::kInvalidInput,
                                   "--gpu-memory-utilization must be in (0, 1]"));
  }
  r.gpu_memory_utilization = 0.4;  // 3.2 GiB allowed, 4 in use
  EXPECT_TRUE(test::throws_error([&] { size_caches(c, DType::kBF16, 0, m, r); }, ErrorKind::kInvalidInput,
                                 "nothing is left for the caches"));

  // Room for exactly 10 slots beside one full sequence's KV: --max-num-seqs 11 is refused, naming 10.
  r.gpu_memory_utilization = 1.0;
  r.cuda_graphs = false;
  const size_t slot = mamba_slot_bytes(c, DType::kBF16), block = kv_block_bytes(c, DType::kBF16, 16);
  r.max_num_seqs = 11;
  const size_t workspace = size_caches(c, DType::kBF16, 0, m, r).workspace;
  const size_t free = workspace + 10 * slot + 16 * block + slot / 2;
  EXPECT_TRUE(test::throws_error([&] { size_caches(c, DType::kBF16, 0, {free, 8 * kGiB}, r); },
                                 ErrorKind::kInvalidInput, "--max-num-seqs 11 is above the 10 Mamba state slots"));
  r.max_num_seqs = 10;
  const CacheSizingPlan p = size_caches(c, DType::kBF16, 0, {free, 8 * kGiB}, r);
  EXPECT_EQ(p.mamba_slots, 10);
  EXPECT_EQ(p.kv_blocks, (free - p.workspace - 10 * slot) / block);  // 16 and what half a slot holds
  EXPECT_GE(p.max_slots_that_fit, 10);
  r.max_num_seqs = -1;
  EXPECT_TRUE(test::throws_error([&] { size_caches(c, DType::kBF16, 0, m, r); }, ErrorKind::kInvalidInput,
                                 "--max-num-seqs must be >= 1"));
}

// max_num_seqs 0: as many slots as fit beside the workspace planned for kAutoMaxNumSeqs, at most that many.
TEST(CacheSizing, AutomaticMaxNumSeqsTakesWhatFits) {
  const ModelConfig c = tiny();
  CacheSizingRequest r;
  r.max_model_len = 256;
  r.max_num_batched_tokens = 64;
  r.gpu_memory_utilization = 1.0;
  r.cuda_graphs = false;
  const size_t slot = mamba_slot_bytes(c, DType::kBF16), block = kv_block_bytes(c, DType::kBF16, 16);
  r.max_num_seqs = kAutoMaxNumSeqs;
  const size_t workspace = size_caches(c, DType::kBF16, 0, {8 * kGiB, 8 * kGiB}, r).workspace;
  r.max_num_seqs = 0;
  // Room for 37 slots beside one full sequence's KV.
  const size_t free = workspace + 37 * slot + 16 * block + slot / 2;
  const CacheSizingPlan p = size_caches(c, DType::kBF16, 0, {free, 8 * kGiB}, r);
  EXPECT_EQ(p.mamba_slots, 37);
  EXPECT_EQ(p.max_slots_that_fit, 37);
  EXPECT_EQ(p.cache_sizes().max_seqs, 37);
  // A device with room to spare stops at kAutoMaxNumSeqs.
  const CacheSizingPlan big = size_caches(c, DType::kBF16, 0, {8 * kGiB, 8 * kGiB}, r);
  EXPECT_EQ(big.mamba_slots, kAutoMaxNumSeqs);
  // Not even one slot beside one sequence's KV: the error says the sizing was automatic.
  EXPECT_TRUE(test::throws_error([&] { size_caches(c, DType::kBF16, 0, {workspace + 16 * block, 8 * kGiB}, r); },
                                 ErrorKind::kInvalidInput, "--max-num-seqs (automatic) is above the 0 Mamba"));
}

TEST(CacheSizing, SizesAgainstThisHostsAvailableMemory) {
  const device::MemoryInfo host = device::host_memory_info();
  ASSERT_GT(host.total, 0u);
  ASSERT_LE(host.free, host.total);
  CacheSizingRequest r;
  r.gpu_memory_utilization = 1.0;  // the whole of MemAvailable
  r.max_num_seqs = 2;
  r.max_model_len = 128;
  r.max_num_batched_tokens = 64;
  const ModelConfig c = tiny();
  const CacheSizingPlan p = size_caches(c, DType::kF32, 0, host, r);
  EXPECT_EQ(p.budget, host.free);
  EXPECT_EQ(p.mamba_slots, 2);
  EXPECT_EQ(p.kv_blocks, 2 * 8);  // capped at what two 128-token sequences use: the host has far more
  const StateCache cache(c, p.cache_sizes());
  EXPECT_EQ(cache.bytes(), p.cache_bytes());
}

}  // namespace
}  // namespace chimera
