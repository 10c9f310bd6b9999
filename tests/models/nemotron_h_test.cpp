// The CPU backend reproduces transformers on fixtures made by transformers itself
// (scripts/make_fixtures.py; the fixture format and the shared helpers are in models/model_fixtures.h).
#include "models/nemotron_h.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/compare.h"
#include "common/tolerances.h"
#include "core/error.h"
#include "io/npy.h"
#include "models/model_fixtures.h"
#include "runtime/engine.h"

namespace chimera {
namespace {

using namespace chimera::test;  // the fixture helpers

class TransformersParity : public ::testing::TestWithParam<std::string> {};

TEST_P(TransformersParity, GreedyAndLogitsMatchTransformers) {
  const Fixture f = load_fixture(GetParam());
  LoadedFixture l = load_model(f.dir);
  const int64_t V = l.config.vocab_size;
  double worst = 0.0;
  for (size_t p = 0; p < f.prompts.size(); ++p) {
    SCOPED_TRACE(fmt::format("{} prompt {} ({} tokens)", f.name, p, f.prompts[p].size()));
    const Tensor ref = read_npy(f.dir / fmt::format("logits_{}.npy", p));
    const auto n_new = static_cast<int32_t>(f.greedy[p].size());
    ASSERT_GE(n_new, 32);
    // Whole prompt in one prefill step, then decode one token at a time (the state handoff).
    RunResult r = run_prompt(*l.model, f.prompts[p], n_new, 4096);
    EXPECT_EQ(r.tokens, f.greedy[p]);
    // Rows: every prompt position and every generated step but the last (whose token is never fed back).
    const int64_t rows = static_cast<int64_t>(f.prompts[p].size()) + n_new - 1;
    ASSERT_EQ(ref.dim(1), V);
    EXPECT_TRUE(logits_match(r.logits, ref, rows, V, test::kModelLogitsRelToMax, &worst));
  }
  std::printf("[ parity   ] %s: worst max|logit - ref| / max|ref| = %.2e (bound %.0e)\n", f.name.c_str(), worst,
              test::kModelLogitsRelToMax);
}

TEST_P(TransformersParity, ChunkedPrefillMatchesTransformers) {
  // The prompt is fed in pieces of 7 tokens: every chunk starts from the state the previous one left.
  const Fixture f = load_fixture(GetParam());
  LoadedFixture l = load_model(f.dir);
  const int64_t V = l.config.vocab_size;
  for (size_t p = 0; p < f.prompts.size(); ++p) {
    SCOPED_TRACE(fmt::format("{} prompt {}", f.name, p));
    const Tensor ref = read_npy(f.dir / fmt::format("logits_{}.npy", p));
    RunResult r = run_prompt(*l.model, f.prompts[p], 8, 7);
    EXPECT_TRUE(std::equal(r.tokens.begin(), r.tokens.end(), f.greedy[p].begin()));
    EXPECT_TRUE(logits_match(r.logits, ref, static_cast<int64_t>(f.prompts[p].size()) + 7, V));
  }
}

TEST_P(TransformersParity, TokenByTokenDecodeEqualsFullForward) {
  // Chimera against itself: the prompt + reference continuation in ONE prefill step must give the same
  // logits as prefill + token-by-token decode (the state handoff between the two paths).
  const Fixture f = load_fixture(GetParam());
  LoadedFixture l = load_model(f.dir);
  const int64_t V = l.config.vocab_size;
  const size_t p = f.prompts.size() - 1;
  std::vector<int32_t> all = f.prompts[p];
  all.insert(all.end(), f.greedy[p].begin(), f.greedy[p].end() - 1);
  RunResult full = run_prompt(*l.model, all, 1, 4096);
  RunResult inc = run_prompt(*l.model, f.prompts[p], static_cast<int32_t>(f.greedy[p].size()), 4096);
  const int64_t rows = static_cast<int64_t>(all.size());
  ASSERT_EQ(static_cast<int64_t>(full.logits.size()), rows * V);
  ASSERT_EQ(static_cast<int64_t>(inc.logits.size()), rows * V);
  const Tensor full_t = Tensor::from_f32({rows, V}, full.logits);
  EXPECT_TRUE(logits_match(inc.logits, full_t, rows, V));
}

TEST_P(TransformersParity, BatchOfPromptsEqualsEachAlone) {
  const Fixture f = load_fixture(GetParam());
  LoadedFixture l = load_model(f.dir);
  const int64_t V = l.config.vocab_size;
  const std::vector<int32_t> n_new = finish_apart(f);
  const std::vector<RunResult> batch = run_batch(*l.model, f.prompts, n_new);
  ASSERT_EQ(batch.size(), f.prompts.size());
  for (size_t p = 0; p < f.prompts.size(); ++p) {
    SCOPED_TRACE(fmt::format("{} prompt {}", f.name, p));
    const std::vector<int32_t>& gen = batch[p].tokens;
    ASSERT_EQ(gen.size(), f.greedy[p].size() - p * 5);
    EXPECT_TRUE(std::equal(gen.begin(), gen.end(), f.greedy[p].begin()));
    const Tensor ref = read_npy(f.dir / fmt::format("logits_{}.npy", p));
    const int64_t prompt_len = static_cast<int64_t>(f.prompts[p].size());
    EXPECT_TRUE(logits_match(batch[p].logits, ref, prompt_len + static_cast<int64_t>(gen.size()) - 1, V));
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, TransformersParity, ::testing::ValuesIn(fixture_names()),
                         [](const auto& param_info) { return param_info.param; });

TEST(TransformersFixtures, AllFixtureKindsArePresent) {
  // The fixtures must cover: all four layer kinds, a LatentMoE Super-like model, a legacy dense config.
  const auto names = fixture_names();
  EXPECT_GE(names.size(), 3u);
  bool kinds[4] = {false, false, false, false};
  bool latent = false, hf_naming = false, nvidia_naming = false;
  for (const auto& n : names) {
    const fs::path dir = fs::path(test::source_path("tests/fixtures/models")) / n;
    const ModelConfig c = load_model_config(dir);
    for (LayerKind k : c.layers) kinds[static_cast<int>(k)] = true;
    latent |= c.moe_latent_size.has_value();
    const Checkpoint ck = Checkpoint::open(dir);
    for (const auto& t : ck.names()) {
      hf_naming |= t.rfind("model.", 0) == 0;
      nvidia_naming |= t.rfind("backbone.", 0) == 0;
    }
  }
  EXPECT_TRUE(kinds[0] && kinds[1] && kinds[2] && kinds[3]);
  EXPECT_TRUE(latent);
  EXPECT_TRUE(hf_naming);
  EXPECT_TRUE(nvidia_naming);
}

}  // namespace
}  // namespace chimera
