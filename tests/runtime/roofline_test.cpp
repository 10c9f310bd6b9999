// The batch-1 decode roofline's arithmetic on the published configs (docs/perf.md, "Method and floors").
#include <gtest/gtest.h>

#include "core/error.h"
#include "io/model_presets.h"
#include "runtime/memory_plan.h"
#include "runtime/roofline.h"

namespace chimera {
namespace {

TEST(Roofline, Nano30BReadsAbout3p2BParamsPerToken) {
  const ModelConfig c = model_preset("nemotron-3-nano-30b-a3b");
  // 23 MoE layers keep 6 of 128 experts (2 x 1856 x 2688 each): 31.58B total -> 3.58B active with the
  // embeddings and lm_head (NVIDIA: "3.2B active, 3.6B with embeddings").
  const int64_t per_expert = 2 * 1856 * 2688;
  EXPECT_EQ(active_parameter_count(c), parameter_count(c) - 23 * (128 - 6) * per_expert);
  EXPECT_NEAR(static_cast<double>(active_parameter_count(c)), 3.58e9, 0.01e9);

  const DecodeRoofline r = batch1_decode_roofline(c, DType::kBF16, 4.2e12);
  // A decode token reads one embedding row, all of the rest: ~3.2B params, ~6.4 GB in bf16.
  EXPECT_NEAR(static_cast<double>(r.params_read), 3.23e9, 0.02e9);
  EXPECT_GT(r.bytes_per_token, 6.3e9);
  EXPECT_LT(r.bytes_per_token, 6.6e9);
  // 4.2e12 / 6.47e9 ~ 649 tok/s.
  EXPECT_GT(r.tokens_per_s, 630);
  EXPECT_LT(r.tokens_per_s, 740);
  EXPECT_DOUBLE_EQ(r.tokens_per_s, 4.2e12 / r.bytes_per_token);
  // fp32 weights read twice the bytes (the fp32-kept parameters are the same), so about half the rate.
  const DecodeRoofline f = batch1_decode_roofline(c, DType::kF32, 4.2e12);
  EXPECT_NEAR(f.tokens_per_s / r.tokens_per_s, 0.5, 0.01);
}

TEST(Roofline, DenseModelCountsEveryParameter) {
  const ModelConfig c = model_preset("nemotron-h-8b");
  EXPECT_EQ(active_parameter_count(c), parameter_count(c));
  // ~8.1B, ~7.6B read per token in bf16 at 4.2 TB/s: ~270-280 tok/s.
  const DecodeRoofline r = batch1_decode_roofline(c, DType::kBF16, 4.2e12);
  EXPECT_GT(r.tokens_per_s, 250);
  EXPECT_LT(r.tokens_per_s, 300);
}

TEST(Roofline, SuperWithFp8IsAbout366TokPerS) {
  const ModelConfig c = model_preset("nemotron-3-super-120b-a12b");
  const DecodeRoofline r = batch1_decode_roofline(c, DType::kF8E4M3, 4.2e12);
  EXPECT_GT(r.tokens_per_s, 300);
  EXPECT_LT(r.tokens_per_s, 420);
}

TEST(Roofline, NonPositiveBandwidthIsABadInput) {
  const ModelConfig c = model_preset("tiny");
  EXPECT_THROW(batch1_decode_roofline(c, DType::kBF16, 0.0), Error);
}

}  // namespace
}  // namespace chimera
