// The transformers fixtures (scripts/make_fixtures.py) and the helpers the model tests share: every fixture
// directory holds config.json, the checkpoint, expected.json (prompts, reference greedy continuations) and
// logits_<p>.npy: the logits of one full forward over prompt + continuation, row i = logits after token i.
#pragma once

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/compare.h"
#include "common/tolerances.h"
#include "io/model_config.h"
#include "io/npy.h"
#include "io/safetensors.h"
#include "models/nemotron_h.h"
#include "runtime/engine.h"

namespace chimera::test {

namespace fs = std::filesystem;

struct Fixture {
  std::string name;
  fs::path dir;
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::vector<int32_t>> greedy;
};

inline std::vector<std::string> fixture_names() {
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

inline Fixture load_fixture(const std::string& name) {
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

inline LoadedFixture load_model(const fs::path& dir, const ModelOptions& options = {}) {
  LoadedFixture l;
  l.config = load_model_config(dir);
  l.ckpt = std::make_unique<Checkpoint>(Checkpoint::open(dir));
  l.model = std::make_unique<NemotronH>(NemotronH::load(l.config, *l.ckpt, options));
  return l;
}

// Per row: max |got - ref| <= rel_to_max * max |ref|. `worst_ratio` (if given) receives the largest
// max|got - ref| / max|ref| over the rows, so the margin to the bound can be reported.
inline ::testing::AssertionResult logits_match(const std::vector<float>& got, const Tensor& ref, int64_t rows,
                                               int64_t vocab, double rel_to_max = test::kModelLogitsRelToMax,
                                               double* worst_ratio = nullptr) {
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
    if (!(max_err <= rel_to_max * max_ref)) {
      return ::testing::AssertionFailure() << "row " << r << ": max |logit - ref| = " << max_err << " at token "
                                           << worst << " (got " << g[worst] << ", want " << w[worst]
                                           << "), bound " << rel_to_max * max_ref;
    }
  }
  return ::testing::AssertionSuccess();
}

// One teacher-forced position of a bf16 run against transformers' bf16 logits (V of each): both top-1 choices, the
// reference's top-2 margin, and max|logit - ref| / max|ref|. Decidable: the margin above kGpuBf16TieMargin of the
// reference's largest |logit| (below it both runs' rounding noise decides the order).
struct Top1Row {
  int64_t top_got = 0, top_ref = 0;
  float margin = 0.0f, max_abs = 0.0f;
  double rel_err = 0.0;
  bool decidable = false;
};
inline Top1Row compare_top1_row(const float* got, const float* ref, int64_t V) {
  Top1Row r;
  r.top_got = std::max_element(got, got + V) - got;
  r.top_ref = std::max_element(ref, ref + V) - ref;
  float second = -INFINITY, err = 0.0f;
  for (int64_t v = 0; v < V; ++v) {
    if (v != r.top_ref) second = std::max(second, ref[v]);
    r.max_abs = std::max(r.max_abs, std::fabs(ref[v]));
    err = std::max(err, std::fabs(got[v] - ref[v]));
  }
  r.margin = ref[r.top_ref] - second;
  r.rel_err = r.max_abs > 0 ? err / r.max_abs : err;
  r.decidable = r.margin > kGpuBf16TieMargin * r.max_abs;
  return r;
}

// The reference's smallest MoE router selection margin at each of the `rows` teacher-forced positions of prompt p
// (router_margin_<p>.npy, scripts/make_fixtures.py --bf16-logits-only: k-th minus (k+1)-th biased score, the least
// over the MoE layers, from fp32 math on the bf16 weights). +inf everywhere for a model without MoE layers; a MoE
// fixture without the file fails (it would silently make every position robust).
inline std::vector<float> router_margins(const Fixture& f, const ModelConfig& config, size_t p, int64_t rows) {
  const fs::path path = f.dir / ("router_margin_" + std::to_string(p) + ".npy");
  const bool moe = std::find(config.layers.begin(), config.layers.end(), LayerKind::kMoe) != config.layers.end();
  if (!moe) return std::vector<float>(static_cast<size_t>(rows), INFINITY);
  if (!fs::exists(path)) {
    ADD_FAILURE() << path << " is missing (scripts/make_fixtures.py --bf16-logits-only writes it for MoE fixtures)";
    return std::vector<float>(static_cast<size_t>(rows), -INFINITY);
  }
  const Tensor t = read_npy(path);
  EXPECT_EQ(t.numel(), rows) << path << " has one margin per teacher-forced position";
  std::vector<float> m(t.f32(), t.f32() + t.numel());
  m.resize(static_cast<size_t>(rows), INFINITY);
  return m;
}

// One prompt's teacher-forced reference from transformers run in bf16 (scripts/make_fixtures.py --bf16-logits-only):
// the tokens fed (prompt, then the reference continuation but its last token), the bf16 logits [rows, vocab] and
// the router margin of each row.
struct Bf16Reference {
  std::vector<int32_t> tokens;
  Tensor logits;
  std::vector<float> router_margin;
  int64_t rows() const { return static_cast<int64_t>(tokens.size()); }
};

// The first logits_bf16_<p>.npy the fixture lacks ("" when it has them all): the bf16 tests skip without them.
inline std::string missing_bf16_reference(const Fixture& f) {
  for (size_t p = 0; p < f.prompts.size(); ++p) {
    const std::string name = "logits_bf16_" + std::to_string(p) + ".npy";
    if (!fs::exists(f.dir / name)) return name;
  }
  return "";
}

// Fills `ref` for prompt p (call under ASSERT_NO_FATAL_FAILURE: a logits file of the wrong shape fails).
inline void load_bf16_reference(const Fixture& f, const ModelConfig& config, size_t p, Bf16Reference& ref) {
  ref.tokens = f.prompts[p];
  ref.tokens.insert(ref.tokens.end(), f.greedy[p].begin(), f.greedy[p].end() - 1);
  ref.logits = read_npy(f.dir / ("logits_bf16_" + std::to_string(p) + ".npy"));
  ASSERT_EQ(ref.logits.shape(), (Shape{ref.rows(), config.vocab_size}))
      << "logits_bf16 rows are the teacher-forced positions";
  ref.router_margin = router_margins(f, config, p, ref.rows());
}

// Both bf16 tests' tally of teacher-forced rows against transformers' bf16 logits. Robust rows: decidable, and the
// reference's routers there at least kBf16RouterTieMargin away from another expert set (tolerances.h says why).
struct Bf16Tally {
  int64_t total = 0, agree = 0, decidable = 0, agree_decidable = 0, robust = 0, agree_robust = 0;
  std::vector<double> row_err;  // per position max|logit - ref| / max|ref|

  void add(const Top1Row& c, float router_margin) {
    const bool same = c.top_got == c.top_ref, robust_row = c.decidable && router_margin >= kBf16RouterTieMargin;
    ++total;
    agree += same;
    decidable += c.decidable;
    agree_decidable += c.decidable && same;
    robust += robust_row;
    agree_robust += robust_row && same;
    row_err.push_back(c.rel_err);
  }
  static double rate(int64_t hits, int64_t n) {
    return n > 0 ? static_cast<double>(hits) / static_cast<double>(n) : 1.0;
  }
  double rate_decidable() const { return rate(agree_decidable, decidable); }
  double rate_robust() const { return rate(agree_robust, robust); }
  double percentile(double q) const {
    std::vector<double> s = row_err;
    std::sort(s.begin(), s.end());
    return s.empty() ? 0.0 : s[static_cast<size_t>(q * static_cast<double>(s.size() - 1))];
  }
};

struct RunResult {
  std::vector<int32_t> tokens;
  std::vector<float> logits;
};

// Runs one prompt through the engine (prefill in chunks of `max_batched_tokens` tokens, then token-by-token
// decode), collecting the logits of every prompt position and every generated step. Runs on the model's device.
inline RunResult run_prompt(const Model& model, const std::vector<int32_t>& prompt, int32_t n_new,
                            int32_t max_batched_tokens) {
  EngineConfig ec;
  ec.cache.max_seqs = 1;
  ec.cache.max_model_len = static_cast<int32_t>(prompt.size()) + n_new + 1;
  ec.cache.block_size = 16;
  ec.scheduler.max_num_seqs = 1;
  ec.scheduler.max_num_batched_tokens = max_batched_tokens;
  ec.return_prompt_logits = true;
  Engine engine(model, ops::Context{model.device(), nullptr}, ec);
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

// Token counts for the prompts of one batch: n[p] less 5 per earlier prompt, so the sequences finish at different
// times and the decode batch shrinks step by step.
inline std::vector<int32_t> finish_apart(std::vector<int32_t> n) {
  for (size_t p = 0; p < n.size(); ++p) n[p] -= static_cast<int32_t>(p) * 5;
  return n;
}
// The fixture's greedy continuation lengths, finishing apart.
inline std::vector<int32_t> finish_apart(const Fixture& f) {
  std::vector<int32_t> n;
  for (const auto& g : f.greedy) n.push_back(static_cast<int32_t>(g.size()));
  return finish_apart(std::move(n));
}

// Runs several prompts in ONE engine (4 sequences, a 40-token step budget: prompts are split into chunks and
// later steps mix prefill chunks with decodes), prompt p generating n_new[p] tokens; returns each prompt's
// generated tokens and (with keep_logits) its logits rows, prompt rows included, in prompt order, the engine's
// CUDA graph buckets and how many steps replayed them. Without keep_logits nobody asks for the rows, so a GPU engine samples on the
// device. Runs on the model's device.
struct BatchOptions {
  bool cuda_graphs = true;
  bool keep_logits = true;
  SamplingParams sampling;  // max_new_tokens comes from n_new; ignore_eos is set
  ops::KernelConfig kernels = {};  // the engine context's kernel configuration
};
struct BatchRun {
  std::vector<RunResult> results;
  std::vector<int32_t> graph_sizes;  // the engine's CUDA graph buckets (captured at start-up)
  int64_t graph_steps = 0;           // steps that replayed one of them
};
inline BatchRun run_batch_with(const Model& model, const std::vector<std::vector<int32_t>>& prompts,
                               const std::vector<int32_t>& n_new, const BatchOptions& options) {
  EngineConfig ec;
  ec.cache.max_seqs = 4;
  ec.cache.max_model_len = 128;
  ec.cache.block_size = 8;
  ec.scheduler.max_num_seqs = 4;
  ec.scheduler.max_num_batched_tokens = 40;
  ec.return_prompt_logits = options.keep_logits;
  ec.cuda_graphs = options.cuda_graphs;
  Engine engine(model, ops::Context{model.device(), nullptr, nullptr, options.kernels}, ec);
  std::map<int32_t, RunResult> by_id;
  if (options.keep_logits) {
    engine.on_logits = [&](int32_t id, std::span<const float> row) {
      by_id[id].logits.insert(by_id[id].logits.end(), row.begin(), row.end());
    };
  }
  SamplingParams sp = options.sampling;
  sp.ignore_eos = true;
  std::vector<int32_t> ids;
  for (size_t p = 0; p < prompts.size(); ++p) {
    sp.max_new_tokens = n_new[p];
    ids.push_back(engine.add_request(prompts[p], sp));
  }
  while (engine.has_unfinished()) engine.step();
  for (Sequence& s : engine.take_finished()) by_id[s.id].tokens.assign(s.tokens.begin() + s.prompt_len, s.tokens.end());
  BatchRun out;
  for (int32_t id : ids) out.results.push_back(by_id[id]);
  out.graph_sizes = engine.graph_batch_sizes();
  out.graph_steps = engine.num_graph_steps();
  return out;
}
inline std::vector<RunResult> run_batch(const Model& model, const std::vector<std::vector<int32_t>>& prompts,
                                        const std::vector<int32_t>& n_new) {
  return run_batch_with(model, prompts, n_new, BatchOptions{}).results;
}

}  // namespace chimera::test
