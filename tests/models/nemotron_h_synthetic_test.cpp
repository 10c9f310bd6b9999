// Synthetic models (NemotronH::synthetic): the loader's shapes, deterministic weights, finite logits that
// depend on the seed, and --num-layers truncation.
#include <cmath>

#include <gtest/gtest.h>

#include "io/model_presets.h"
#include "models/model_fixtures.h"
#include "models/nemotron_h.h"
#include "runtime/memory_plan.h"

namespace chimera {
namespace {

std::vector<float> logits_of(const NemotronH& model) {
  return test::run_prompt(model, {1, 17, 300, 42, 7, 99, 1000}, 3, 64).logits;
}

TEST(Synthetic, TinyHasTheLoadersShapesAndTheConfigsParameterCount) {
  const ModelConfig c = model_preset("tiny");
  const NemotronH m = NemotronH::synthetic(c, {}, 0);
  int64_t total = 0;
  const auto counts = m.parameter_counts();
  for (const auto& [kind, n] : counts) total += n;
  EXPECT_EQ(total, parameter_count(c));
  EXPECT_EQ(counts, parameter_counts(c));
  EXPECT_EQ(m.mtp_blocks(), 0);  // the tiny preset has no MTP head
}

TEST(Synthetic, SameSeedSameLogitsOtherSeedOtherLogits) {
  const ModelConfig c = model_preset("tiny");
  const std::vector<float> a = logits_of(NemotronH::synthetic(c, {}, 7));
  const std::vector<float> b = logits_of(NemotronH::synthetic(c, {}, 7));
  const std::vector<float> d = logits_of(NemotronH::synthetic(c, {}, 8));
  ASSERT_EQ(a.size(), b.size());
  ASSERT_FALSE(a.empty());
  EXPECT_EQ(a, b);  // bit-exact
  EXPECT_NE(a, d);
  double sum_sq = 0.0;
  for (const float v : a) {
    ASSERT_TRUE(std::isfinite(v));
    sum_sq += static_cast<double>(v) * v;
  }
  // Sensible scales: logits neither vanish nor explode.
  const double rms = std::sqrt(sum_sq / static_cast<double>(a.size()));
  EXPECT_GT(rms, 0.05);
  EXPECT_LT(rms, 100.0);
}

TEST(Synthetic, NumLayersBuildsTheFirstLayersOnly) {
  ModelConfig c = model_preset("tiny");
  const NemotronH full = NemotronH::synthetic(c, {}, 3);
  truncate_layers(c, 3);
  const NemotronH cut = NemotronH::synthetic(c, {}, 3);
  EXPECT_EQ(cut.config().num_hidden_layers(), 3);
  EXPECT_EQ(cut.config().pattern(), full.config().pattern().substr(0, 3));
  EXPECT_EQ(logits_of(cut).size(), logits_of(full).size());
  EXPECT_EQ(cut.parameter_counts(), parameter_counts(c));
  EXPECT_LT(parameter_count(c), parameter_count(full.config()));
}

TEST(Synthetic, F32WeightsWork) {
  ModelOptions o;
  o.dtype = DType::kF32;
  const std::vector<float> a = logits_of(NemotronH::synthetic(model_preset("tiny"), o, 1));
  for (const float v : a) ASSERT_TRUE(std::isfinite(v));
}

}  // namespace
}  // namespace chimera
