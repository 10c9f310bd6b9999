// The bar of issue 2: the CPU backend reproduces transformers on fixtures made by transformers itself
// (scripts/make_fixtures.py). Every fixture directory holds config.json, the checkpoint, expected.json
// (prompts, reference greedy continuations) and logits_<p>.npy: the logits of one full forward over
// prompt + continuation, row i = logits after token i.
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
#include "runtime/engine.h"

namespace chimera {
namespace {

namespace fs = std::filesystem;

struct Fixture {
  std::string name;
  fs::path dir;
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::vector<int32_t>> greedy;
};

std::vector<std::string> fixture_names() {
  std::vector<std::string> names;
  const fs::path root = test::source_path("tests/fixtures/models");
  if (fs::is_directory(root)) {
    for (const auto& e : fs::directory_iterator(root)) {
      if (fs::exists(e.path() / "expected.json")) names.push_back(e.path().filename().string());
    }
  }
  std::sort(names.begin(), names.end());
  return names;
}

Fixture load_fixture(const std::string& name) {
  Fixture f;
  f.name = name;
  f.dir = fs::path(test::source_path("tests/fixtures/models")) / name;
  std::ifstream in(f.dir / "expected.json");
  const nlohmann::json j = nlohmann::json::parse(in);
  f.prompts = j.at("prompts").get<std::vector<std::vector<int32_t>>>();
  f.greedy = j.at("greedy").get<std::vector<std::vector<int32_t>>>();
  return f;
}

struct LoadedFixture {
  ModelConfig config;
  std::unique_ptr<Checkpoint> ckpt;
  std::unique_ptr<NemotronH> model;
};

LoadedFixture load_model(const fs::path& dir) {
  LoadedFixture l;
  l.config = load_model_config(dir);
  l.ckpt = std::make_unique<Checkpoint>(Checkpoint::open(dir));
  l.model = std::make_unique<NemotronH>(NemotronH::load(l.config, *l.ckpt));
  return l;
}

// Per row: max |got - ref| <= kModelLogitsRelToMax * max |ref|. `worst_ratio` (if given) receives the largest
// max|got - ref| / max|ref| over the rows, so the margin to the bound can be reported.
::testing::AssertionResult logits_match(const std::vector<float>& got, const Tensor& ref, int64_t rows,
                                        int64_t vocab, double* worst_ratio = nullptr) {
  if (static_cast<int64_t>(got.size()) != rows * vocab) {
    return ::testing::AssertionFailure() << "got " << got.size() / vocab << " rows, want " << rows;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = got.data() + r * vocab;
    const float* w = ref.f32() + r * vocab;
    double max_ref = 0.0, max_err = 0.0;
    int64_t worst = 0;
    for (int64_t v = 0; v < vocab; ++v) {
      max_ref = std::max(max_ref, std::fabs(static_cast<double>(w[v])));
      const double e = std::fabs(static_cast<double>(g[v]) - w[v]);
      if (!(e <= max_err)) {
        max_err = e;
        worst = v;
      }
    }
    if (worst_ratio) *worst_ratio = std::max(*worst_ratio, max_err / std::max(max_ref, 1e-30));
    if (!(max_err <= test::kModelLogitsRelToMax * max_ref)) {
      return ::testing::AssertionFailure() << "row " << r << ": max |logit - ref| = " << max_err << " at token "
                                           << worst << " (got " << g[worst] << ", want " << w[worst]
                                           << "), bound " << test::kModelLogitsRelToMax * max_ref;
    }
  }
  return ::testing::AssertionSuccess();
}

class TransformersParity : public ::testing::TestWithParam<std::string> {};

// Runs one prompt through the engine (prefill in chunks of `chunk` tokens, then token-by-token decode),
// collecting the logits of every prompt position and every generated step.
struct RunResult {
  std::vector<int32_t> tokens;
  std::vector<float> logits;
};

RunResult run_prompt(const NemotronH& model, const std::vector<int32_t>& prompt, int32_t n_new,
                     int32_t max_batched_tokens) {
  EngineConfig ec;
  ec.cache.max_seqs = 1;
  ec.cache.max_model_len = static_cast<int32_t>(prompt.size()) + n_new + 1;
  ec.cache.block_size = 16;
  ec.scheduler.max_num_seqs = 1;
  ec.scheduler.max_num_batched_tokens = max_batched_tokens;
  ec.return_prompt_logits = true;
  Engine engine(model, ops::Context{}, ec);
  RunResult r;
  engine.on_logits = [&](int32_t, std::span<const float> row) { r.logits.insert(r.logits.end(), row.begin(), row.end()); };
  SamplingParams sp;
  sp.max_new_tokens = n_new;
  sp.ignore_eos = true;
  engine.add_request(prompt, sp);
  while (engine.has_unfinished()) engine.step();
  auto done = engine.take_finished();
  EXPECT_EQ(done.size(), 1u);
  r.tokens.assign(done[0].tokens.begin() + done[0].prompt_len, done[0].tokens.end());
  return r;
}

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
    EXPECT_TRUE(logits_match(r.logits, ref, rows, V, &worst));
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
  EngineConfig ec;
  ec.cache.max_seqs = 4;
  ec.cache.max_model_len = 128;
  ec.cache.block_size = 8;
  ec.scheduler.max_num_seqs = 4;
  // A small token budget: prompts are split into chunks and later steps mix prefill chunks with decodes.
  ec.scheduler.max_num_batched_tokens = 40;
  ec.return_prompt_logits = true;
  Engine engine(*l.model, ops::Context{}, ec);
  std::map<int32_t, std::vector<float>> logits;
  engine.on_logits = [&](int32_t id, std::span<const float> row) {
    logits[id].insert(logits[id].end(), row.begin(), row.end());
  };
  SamplingParams sp;
  sp.ignore_eos = true;
  std::vector<int32_t> ids;
  for (size_t p = 0; p < f.prompts.size(); ++p) {
    sp.max_new_tokens = static_cast<int32_t>(f.greedy[p].size()) - static_cast<int32_t>(p) * 5;  // finish apart
    ids.push_back(engine.add_request(f.prompts[p], sp));
  }
  while (engine.has_unfinished()) engine.step();
  std::map<int32_t, Sequence> done;
  for (Sequence& s : engine.take_finished()) done[s.id] = s;
  ASSERT_EQ(done.size(), f.prompts.size());
  for (size_t p = 0; p < f.prompts.size(); ++p) {
    SCOPED_TRACE(fmt::format("{} prompt {}", f.name, p));
    const Sequence& s = done[ids[p]];
    const std::vector<int32_t> gen(s.tokens.begin() + s.prompt_len, s.tokens.end());
    ASSERT_EQ(gen.size(), f.greedy[p].size() - p * 5);
    EXPECT_TRUE(std::equal(gen.begin(), gen.end(), f.greedy[p].begin()));
    const Tensor ref = read_npy(f.dir / fmt::format("logits_{}.npy", p));
    EXPECT_TRUE(logits_match(logits[ids[p]], ref, s.prompt_len + static_cast<int64_t>(gen.size()) - 1, V));
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
