// The memory plan's arithmetic on the published configs (parameter counts as published: Nemotron-H 8B ~8.1B,
// Nemotron 3 Nano 30B-A3B 31.6B, Nemotron 3 Super 120B-A12B ~120.7B without the MTP head) and its error.
#include <algorithm>

#include <gtest/gtest.h>

#include "common/backend_param.h"
#include "core/error.h"
#include "io/model_presets.h"
#include "runtime/memory_plan.h"

namespace chimera {
namespace {

constexpr double kGB = 1e9;
constexpr size_t kGiB = size_t{1} << 30;

TEST(MemoryPlan, ParameterCountsOfThePublishedModels) {
  // Exact sums of the docs/model.md 2.1 shapes (cross-checked by hand in Python).
  EXPECT_EQ(parameter_count(model_preset("nemotron-h-8b")), 8100852736);
  EXPECT_EQ(parameter_count(model_preset("nemotron-3-nano-30b-a3b")), 31577940288);
  EXPECT_EQ(parameter_count(model_preset("nemotron-3-super-120b-a12b")), 120668707840);
}

TEST(MemoryPlan, Nano30BWeightsInBf16AreAbout63GB) {
  const ModelConfig c = model_preset("nemotron-3-nano-30b-a3b");
  const MemoryPlan p = plan_memory(c, DType::kBF16, DType::kBF16, MemoryLimits{});
  EXPECT_GT(p.weights, 62.5 * kGB);
  EXPECT_LT(p.weights, 63.5 * kGB);
  // bf16 for everything but the fp32 parameters (A_log, D, dt_bias, router gate and bias).
  const int64_t f32 = fp32_parameter_count(c);
  EXPECT_EQ(f32, 23 * 3 * 64 + 23 * (128 * 2688 + 128));
  EXPECT_EQ(p.weights, static_cast<size_t>((parameter_count(c) - f32) * 2 + f32 * 4));
  // fp32 weights are twice as large (up to the fp32 parameters, which do not change).
  const MemoryPlan p32 = plan_memory(c, DType::kF32, DType::kF32, MemoryLimits{});
  EXPECT_EQ(p32.weights, static_cast<size_t>(parameter_count(c) * 4));
}

TEST(MemoryPlan, KvCacheAndMambaStateOfNano30B) {
  const ModelConfig c = model_preset("nemotron-3-nano-30b-a3b");
  MemoryLimits l;
  l.max_num_seqs = 8;
  l.max_model_len = 4096;
  l.block_size = 16;
  const MemoryPlan p = plan_memory(c, DType::kBF16, DType::kBF16, l);
  // 6 attention layers x (K, V) x 2 kv heads x 128 x 2 bytes = 6 KiB per token.
  EXPECT_EQ(p.kv_cache, size_t{6} * 2 * 2 * 128 * 2 * 4096 * 8);
  // 23 Mamba layers x (conv [6144, 3] bf16 + SSM [64, 64, 128] fp32) per sequence.
  const size_t per_seq = 23 * (size_t{64 * 64 + 2 * 8 * 128} * 3 * 2 + size_t{64} * 64 * 128 * 4);
  EXPECT_EQ(p.mamba_state, per_seq * 8);
  EXPECT_GT(p.workspace, 0u);
  EXPECT_EQ(p.total(), p.weights + p.kv_cache + p.mamba_state + p.workspace);

  // max_model_len rounds up to whole KV blocks.
  l.max_model_len = 4097;
  EXPECT_EQ(plan_memory(c, DType::kBF16, DType::kBF16, l).kv_cache, size_t{6} * 2 * 2 * 128 * 2 * 4112 * 8);

  // CUDA-graph pad rows: one more Mamba slot and one more KV block (16 tokens) each.
  l.graph_pad_rows = 3;
  const MemoryPlan padded = plan_memory(c, DType::kBF16, DType::kBF16, l);
  EXPECT_EQ(padded.kv_cache, size_t{6} * 2 * 2 * 128 * 2 * (4112 * 8 + 3 * 16));
  EXPECT_EQ(padded.mamba_state, per_seq * 11);

  // Prefix caching's checkpoints: one sequence's Mamba state each, and no KV.
  l.mamba_checkpoints = 5;
  const MemoryPlan cached = plan_memory(c, DType::kBF16, DType::kBF16, l);
  EXPECT_EQ(cached.mamba_state, per_seq * 16);
  EXPECT_EQ(cached.kv_cache, padded.kv_cache);
  EXPECT_TRUE(test::throws_error([&] { check_memory_plan(cached, 1, "host"); }, ErrorKind::kInvalidInput,
                                 "with 5 checkpoints of --mamba-checkpoint-slots"));
}

TEST(MemoryPlan, Super120BNeedsTruncationForOneGpu) {
  ModelConfig c = model_preset("nemotron-3-super-120b-a12b");
  const MemoryPlan full = plan_memory(c, DType::kBF16, DType::kBF16, MemoryLimits{});
  EXPECT_GT(full.weights, 140 * kGiB);  // > one H200
  truncate_layers(c, 44);
  const MemoryPlan half = plan_memory(c, DType::kBF16, DType::kBF16, MemoryLimits{});
  EXPECT_LT(half.total(), 130 * kGiB);
  EXPECT_NO_THROW(check_memory_plan(half, 139 * kGiB, "GPU"));
}

TEST(MemoryPlan, NotEnoughMemoryIsAnInputErrorWithTheNumbers) {
  const ModelConfig c = model_preset("nemotron-3-nano-30b-a3b");
  const MemoryPlan p = plan_memory(c, DType::kBF16, DType::kBF16, MemoryLimits{});
  EXPECT_NO_THROW(check_memory_plan(p, p.total(), "GPU"));
  try {
    check_memory_plan(p, 40 * kGiB, "GPU");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidInput);
    EXPECT_EQ(e.exit_code(), 2);
    const std::string want = "needs " + gib(p.total()) + " (weights " + gib(p.weights) + ", KV " + gib(p.kv_cache) +
                             ", Mamba state " + gib(p.mamba_state) + ", workspace " + gib(p.workspace) +
                             ") but the GPU has 40.00 GiB free";
    EXPECT_EQ(std::string(e.what()), want);
  }
  EXPECT_EQ(gib(size_t{3} << 29), "1.50 GiB");
}

}  // namespace
}  // namespace chimera

namespace chimera {
namespace {

// The overflow case: 2^31-1 sequences of 2^31-1 tokens wrapped the KV size, so the total came out smaller than
// its KV part. Now every part is checked: the true size (~10^21 bytes) does not fit in 64 bits: an error.
TEST(MemoryPlan, OverflowingLimitsAreAnErrorNotAWrappedTotal) {
  const ModelConfig c = model_preset("nemotron-3-nano-30b-a3b");
  MemoryLimits lim;
  lim.max_num_seqs = 2147483647;
  lim.max_model_len = 2147483647;
  try {
    plan_memory(c, DType::kBF16, DType::kBF16, lim);
    ADD_FAILURE() << "no overflow error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidInput);
    EXPECT_NE(std::string(e.what()).find("KV cache overflows"), std::string::npos) << e.what();
  }
}

// Large limits that still fit: the KV part equals the exact product and the total
// covers every part.
TEST(MemoryPlan, LargeLimitsGiveTheExactTotal) {
  const ModelConfig c = model_preset("nemotron-3-nano-30b-a3b");
  MemoryLimits lim;
  lim.max_num_seqs = 1;
  lim.max_model_len = 2147483647;
  lim.block_size = 16;
  const MemoryPlan p = plan_memory(c, DType::kBF16, DType::kBF16, lim);
  // Exact in uint64 here (~10^13 bytes): checking the arithmetic changes no size that fits.
  const auto attention = static_cast<uint64_t>(std::count(c.layers.begin(), c.layers.end(), LayerKind::kAttention));
  const uint64_t tokens = (uint64_t{2147483647} + 15) / 16 * 16;
  const uint64_t kv = attention * 2 * static_cast<uint64_t>(c.num_key_value_heads * c.head_dim) * 2 * tokens;
  EXPECT_EQ(p.kv_cache, kv);
  EXPECT_EQ(static_cast<long double>(p.total()), static_cast<long double>(p.weights) + p.kv_cache + p.mamba_state +
                                                     p.workspace);
  EXPECT_GT(p.total(), p.kv_cache);
}

}  // namespace
}  // namespace chimera
