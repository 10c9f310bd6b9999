// Speculative decoding with the MTP head (runtime/speculative.h, runtime/engine.h):
//   * the parts without a model: --speculative-config parsing, greedy acceptance, and rejection sampling, whose
//     emitted tokens must be distributed as the target (a chi-square test over many draws);
//   * the engine on the MTP fixture (a tiny random Nemotron-H with a head, scripts/make_mtp_fixture.py), CPU and CUDA
//     in fp32: greedy with K = 1, 2, 3 emits exactly the tokens of greedy without speculation (and transformers'
//     reference continuation), at batch 1 and in a mixed batch of prompts and lengths;
//   * state rollback under drafts we choose: a test model wraps the fixture and replaces the head's logits by an
//     oracle that knows the greedy continuation and lies at chosen positions, so drafts are fully accepted, fully
//     rejected or accepted up to every position in turn; sequences finishing inside an accepted run (a stop token,
//     max_tokens) and preemption in the middle of speculative runs must still give the reference tokens;
//   * sampling with speculation: the second generated token's distribution over many seeds matches sampling without
//     it (chi-square, significance 0.001), and the same seed gives the same tokens on every run.
#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <vector>

#include <gtest/gtest.h>

#include "backends/device_api.h"
#include "common/backend_param.h"
#include "core/counter_rng.h"
#include "core/error.h"
#include "models/model_fixtures.h"
#include "runtime/engine.h"
#include "runtime/speculative.h"

namespace chimera {
namespace {

using test::BackendTest;

// ---- configuration and acceptance rules ----------------------------------------------------------------

TEST(SpeculativeConfig, ParsesVllmSpelling) {
  const SpeculativeConfig c = parse_speculative_config(R"({"method": "mtp", "num_speculative_tokens": 3})", "--x");
  EXPECT_EQ(c.method, "mtp");
  EXPECT_EQ(c.num_speculative_tokens, 3);
  EXPECT_TRUE(c.enabled());
  EXPECT_EQ(parse_speculative_config(R"({"method": "nemotron_h_mtp", "num_speculative_tokens": 1})", "x").method,
            "mtp");
  EXPECT_FALSE(SpeculativeConfig{}.enabled());
}

TEST(SpeculativeConfig, RejectsBadInputNamingTheField) {
  const auto bad = [](const char* json, const char* message) {
    EXPECT_TRUE(test::throws_error([&] { parse_speculative_config(json, "--speculative-config"); },
                                   ErrorKind::kInvalidInput, message))
        << json;
  };
  bad(R"({"method": "ngram", "num_speculative_tokens": 3})", "method \"ngram\" is not supported");
  bad(R"({"method": "mtp", "num_speculative_tokens": 0})", "num_speculative_tokens must be in [1, 8], got 0");
  bad(R"({"method": "mtp", "num_speculative_tokens": 99})", "got 99");
  bad(R"({"method": "mtp", "num_speculative_tokens": 2.5})", "must be an integer");
  bad(R"({"method": "mtp"})", "\"num_speculative_tokens\" is missing");
  bad(R"({"num_speculative_tokens": 2})", "\"method\" is missing");
  bad(R"({"method": "mtp", "num_speculative_tokens": 2, "draft_model": "x"})", "unknown key \"draft_model\"");
  bad(R"([1, 2])", "expected a JSON object");
  bad(R"({"method": "mtp",)", "--speculative-config");
}

TEST(SpeculativeAccept, GreedyTakesTheLongestMatchingPrefixThenTheTarget) {
  using V = std::vector<int32_t>;
  EXPECT_EQ(accept_greedy(V{5, 6, 7}, V{5, 6, 7, 8}), (V{5, 6, 7, 8}));  // all accepted, bonus 8
  EXPECT_EQ(accept_greedy(V{5, 6, 7}, V{5, 9, 7, 8}), (V{5, 9}));        // rejected at 1: correction 9
  EXPECT_EQ(accept_greedy(V{5, 6, 7}, V{4, 6, 7, 8}), (V{4}));           // none accepted
  EXPECT_EQ(accept_greedy(V{}, V{3}), (V{3}));                           // no drafts: a plain decode
}

TEST(SpeculativeAccept, StatsSummary) {
  SpeculativeStats s;
  EXPECT_EQ(s.acceptance_rate(), 0.0);
  EXPECT_EQ(s.mean_acceptance_length(), 1.0);
  s.num_drafts = 4, s.num_draft_tokens = 12, s.num_accepted_tokens = 6, s.accepted_per_position = {4, 2, 0};
  EXPECT_DOUBLE_EQ(s.acceptance_rate(), 0.5);
  EXPECT_DOUBLE_EQ(s.mean_acceptance_length(), 2.5);
  EXPECT_EQ(s.summary(),
            "drafts 4, draft tokens 12, accepted 6 (50.0 %), mean acceptance length 2.50, "
            "per position 1.000 0.500 0.000");
  SpeculativeStats later = s;
  later.num_drafts = 7, later.num_draft_tokens = 21, later.num_accepted_tokens = 8;
  later.accepted_per_position = {6, 2, 0};
  const SpeculativeStats d = later.since(s);
  EXPECT_EQ(d.num_drafts, 3);
  EXPECT_EQ(d.num_draft_tokens, 9);
  EXPECT_EQ(d.num_accepted_tokens, 2);
  EXPECT_EQ(d.accepted_per_position, (std::vector<int64_t>{2, 0, 0}));
}

// The chi-square statistic of observed counts against expected probabilities, and the 0.001 upper quantile of the
// chi-square distribution with df degrees of freedom (Wilson-Hilferty; z = 3.090).
double chi_square(const std::vector<int64_t>& counts, const std::vector<double>& probs, int64_t n, int* df) {
  double x2 = 0.0;
  *df = -1;
  for (size_t i = 0; i < counts.size(); ++i) {
    if (probs[i] <= 0.0) {
      EXPECT_EQ(counts[i], 0) << "token " << i << " has no probability but was emitted";
      continue;
    }
    const double e = probs[i] * static_cast<double>(n);
    x2 += (static_cast<double>(counts[i]) - e) * (static_cast<double>(counts[i]) - e) / e;
    ++*df;
  }
  return x2;
}
double chi_square_critical_001(int df) {
  const double k = df, z = 3.090;
  const double t = 1.0 - 2.0 / (9.0 * k) + z * std::sqrt(2.0 / (9.0 * k));
  return k * t * t * t;
}

// Draft x ~ q, one rejection step: the emitted token must be distributed as p, for p and q that overlap partly,
// q with mass where p has none, and q = p.
TEST(SpeculativeAccept, RejectionSamplingEmitsTheTargetDistribution) {
  const std::vector<std::vector<float>> ps = {{0.5f, 0.2f, 0.2f, 0.1f, 0.0f, 0.0f},
                                              {0.05f, 0.05f, 0.3f, 0.3f, 0.2f, 0.1f}};
  const std::vector<std::vector<float>> qs = {{0.1f, 0.1f, 0.1f, 0.1f, 0.3f, 0.3f},
                                              {0.05f, 0.05f, 0.3f, 0.3f, 0.2f, 0.1f}};
  for (size_t c = 0; c < ps.size(); ++c) {
    const std::vector<float>&p = ps[c], &q = qs[c];
    const int64_t n = 200000;
    std::vector<int64_t> counts(p.size(), 0);
    int64_t accepted = 0;
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t step = static_cast<uint64_t>(i);
      const int32_t x = sample_from_probs(q, spec_uniform(7, SpecStream::kDraft, step));
      const RejectionResult r = rejection_step(p, q, x, spec_uniform(7, SpecStream::kAccept, step),
                                               spec_uniform(7, SpecStream::kResample, step));
      ++counts[static_cast<size_t>(r.token)];
      accepted += r.accepted;
    }
    int df = 0;
    const std::vector<double> pd(p.begin(), p.end());
    const double x2 = chi_square(counts, pd, n, &df);
    EXPECT_LT(x2, chi_square_critical_001(df)) << "case " << c << ": chi-square " << x2 << " with " << df << " df";
    // The acceptance rate is sum_i min(p_i, q_i).
    double overlap = 0.0;
    for (size_t i = 0; i < p.size(); ++i) overlap += std::min(p[i], q[i]);
    EXPECT_NEAR(static_cast<double>(accepted) / n, overlap, 0.01) << "case " << c;
  }
}

// ---- the engine on the MTP fixture -----------------------------------------------------------------------

// The fixture model, with the head's logits optionally replaced by an oracle's (drafts we choose).
class OracleModel : public Model {
 public:
  enum class Mode { kRealHead, kAlwaysRight, kAlwaysWrong, kWrongEveryThird, kWrongByHash };

  OracleModel(const NemotronH& inner, Mode mode) : inner_(inner), mode_(mode) {}
  // The reference sequences (prompt + greedy continuation) the oracle reads its drafts from.
  void learn(const std::vector<int32_t>& seq) {
    for (size_t i = 0; i + 1 < seq.size(); ++i) next_[{static_cast<int32_t>(i), seq[i]}] = seq[i + 1];
  }

  const ModelConfig& config() const override { return inner_.config(); }
  Device device() const override { return inner_.device(); }
  DType activation_dtype() const override { return inner_.activation_dtype(); }
  Tensor forward(const ops::Context& ctx, const StepBatch& b, ModelState& st) const override {
    return inner_.forward(ctx, b, st);
  }
  Tensor forward_device(const ops::Context& ctx, const StepBatch& b, ModelState& st) const override {
    return inner_.forward_device(ctx, b, st);
  }
  int mtp_blocks() const override { return inner_.mtp_blocks(); }
  Tensor forward_device(const ops::Context& ctx, const StepBatch& b, ModelState& st, Tensor& hidden) const override {
    return inner_.forward_device(ctx, b, st, hidden);
  }
  Tensor mtp_forward_device(const ops::Context& ctx, const StepBatch& b, const Tensor& hidden, ModelState& st,
                            int block, Tensor* mtp_hidden) const override {
    Tensor logits = inner_.mtp_forward_device(ctx, b, hidden, st, block, mtp_hidden);
    ++head_calls_;
    if (mode_ == Mode::kRealHead) return logits;
    // Row r of the head at position t carries token x_{t+1}, and predicts x_{t+2}: the oracle's token after
    // (t + 1, x_{t+1}) in a reference sequence, made wrong at the mode's positions.
    const int64_t V = inner_.config().vocab_size, R = static_cast<int64_t>(b.logit_rows.size());
    Tensor host = Tensor::zeros(DType::kF32, {R, V});
    for (int64_t i = 0; i < R; ++i) {
      const int32_t row = b.logit_rows[static_cast<size_t>(i)];
      size_t s = 0;
      while (b.cu_seqlens[s + 1] <= row) ++s;
      const int32_t t = b.context_lens[s] + row - b.cu_seqlens[s];
      const auto it = next_.find({t + 1, b.token_ids[static_cast<size_t>(row)]});
      int32_t token = it == next_.end() ? 0 : it->second;
      const int32_t target_pos = t + 2;
      const bool wrong = mode_ == Mode::kAlwaysWrong || (mode_ == Mode::kWrongEveryThird && target_pos % 3 == 0) ||
                         (mode_ == Mode::kWrongByHash && splitmix64(static_cast<uint64_t>(target_pos)) % 4 == 0);
      if (wrong) token = static_cast<int32_t>((token + 1) % V);
      host.f32()[i * V + token] = 10.0f;
    }
    return ctx.device == Device::kCpu ? host : device::to_device(host, ctx.device, inner_.activation_dtype());
  }
  int64_t head_calls() const { return head_calls_; }

 private:
  const NemotronH& inner_;
  Mode mode_;
  std::map<std::pair<int32_t, int32_t>, int32_t> next_;
  mutable int64_t head_calls_ = 0;
};

struct RunResult {
  std::vector<std::vector<int32_t>> tokens;  // generated, per request in order
  SpeculativeStats stats;
  int64_t preemptions = 0;
  int64_t graph_steps = 0;  // steps that replayed a CUDA graph
};

RunResult run(const Model& model, Device device, const EngineConfig& ec,
              const std::vector<std::vector<int32_t>>& prompts, const std::vector<SamplingParams>& sampling) {
  Engine engine(model, ops::Context{device, nullptr}, ec);
  std::vector<int32_t> ids;
  for (size_t i = 0; i < prompts.size(); ++i) ids.push_back(engine.add_request(prompts[i], sampling[i]));
  std::map<int32_t, std::vector<int32_t>> streamed;  // the events' tokens must be the final sequences' too
  while (engine.has_unfinished()) {
    for (const TokenEvent& ev : engine.step()) {
      EXPECT_NE(ev.finish, FinishReason::kError) << ev.error;
      if (ev.token >= 0) streamed[ev.seq_id].push_back(ev.token);
    }
  }
  std::map<int32_t, std::vector<int32_t>> by_id;
  for (Sequence& s : engine.take_finished()) {
    by_id[s.id] = std::vector<int32_t>(s.tokens.begin() + s.prompt_len, s.tokens.end());
  }
  RunResult r;
  for (int32_t id : ids) {
    EXPECT_EQ(by_id[id], streamed[id]) << "request " << id << ": events and the finished sequence disagree";
    r.tokens.push_back(by_id[id]);
  }
  r.stats = engine.speculative_stats();
  r.preemptions = engine.num_preemptions();
  r.graph_steps = engine.num_graph_steps();
  return r;
}

EngineConfig config(int32_t k, int32_t max_seqs = 4, int32_t num_blocks = 0) {
  EngineConfig ec;
  ec.cache.max_seqs = max_seqs;
  ec.cache.max_model_len = 128;
  ec.cache.block_size = 16;
  ec.cache.num_blocks = num_blocks;
  ec.scheduler.max_num_seqs = max_seqs;
  if (k > 0) ec.speculative = SpeculativeConfig{"mtp", k};
  return ec;
}

// The oracle's head computes its logits on the host, which no CUDA graph can capture: engines drafting with it run
// eagerly (the real head's runs keep the default, captured speculative steps on CUDA).
EngineConfig eager(EngineConfig c) {
  c.cuda_graphs = false;
  return c;
}

SamplingParams greedy(int32_t max_tokens) {
  SamplingParams p;
  p.max_new_tokens = max_tokens;
  p.ignore_eos = true;
  return p;
}

class SpeculativeEngine : public BackendTest {
 protected:
  void SetUp() override {
    BackendTest::SetUp();
    if (IsSkipped()) return;
    fixture_ = test::load_fixture("mtp");
    loaded_ = test::load_model(fixture_.dir, ModelOptions{GetParam(), DType::kF32});
  }
  const NemotronH& model() const { return *loaded_.model; }
  // Prompt + reference continuation of fixture prompt p.
  std::vector<int32_t> reference(size_t p) const {
    std::vector<int32_t> s = fixture_.prompts[p];
    s.insert(s.end(), fixture_.greedy[p].begin(), fixture_.greedy[p].end());
    return s;
  }
  test::Fixture fixture_;
  test::LoadedFixture loaded_;
};

// Batch 1, each prompt alone, K = 1, 2, 3 with the real (random-weight) head: the reference continuation exactly.
TEST_P(SpeculativeEngine, GreedyEqualsGreedyWithoutSpeculationAtBatchOne) {
  for (int32_t k : {1, 2, 3}) {
    for (size_t p = 0; p < fixture_.prompts.size(); ++p) {
      SCOPED_TRACE(::testing::Message() << "K=" << k << " prompt " << p);
      const RunResult r = run(model(), GetParam(), config(k, 1), {fixture_.prompts[p]}, {greedy(32)});
      EXPECT_EQ(r.tokens[0], fixture_.greedy[p]);
      EXPECT_GT(r.stats.num_drafts, 0);
      EXPECT_EQ(r.stats.num_draft_tokens > 0, true);
    }
  }
}

// A mixed batch: three prompts of 2, 37 and 53 tokens with different max_tokens (finishing at different steps), so
// sequences in one step verify different numbers of drafts and accept different lengths.
TEST_P(SpeculativeEngine, GreedyEqualsGreedyWithoutSpeculationInAMixedBatch) {
  const std::vector<SamplingParams> sampling = {greedy(32), greedy(17), greedy(25)};
  for (auto mode : {OracleModel::Mode::kRealHead, OracleModel::Mode::kWrongByHash}) {
    OracleModel m(model(), mode);
    for (size_t p = 0; p < 3; ++p) m.learn(reference(p));
    for (int32_t k : {1, 2, 3}) {
      SCOPED_TRACE(::testing::Message() << "K=" << k << " mode " << static_cast<int>(mode));
      const EngineConfig ec = mode == OracleModel::Mode::kRealHead ? config(k) : eager(config(k));
      const RunResult r = run(m, GetParam(), ec, fixture_.prompts, sampling);
      for (size_t p = 0; p < 3; ++p) {
        const std::vector<int32_t> want(fixture_.greedy[p].begin(),
                                        fixture_.greedy[p].begin() + sampling[p].max_new_tokens);
        EXPECT_EQ(r.tokens[p], want) << "prompt " << p;
      }
      if (mode == OracleModel::Mode::kWrongByHash) {  // accepted lengths vary: some accepted, some rejected
        EXPECT_GT(r.stats.num_accepted_tokens, 0);
        EXPECT_LT(r.stats.num_accepted_tokens, r.stats.num_draft_tokens);
      }
    }
  }
}

// Drafts fully accepted, fully rejected, and rejected at every third position (so each draft position is where the
// first rejection falls in some step): the same tokens, and the counters say what happened.
TEST_P(SpeculativeEngine, StateRollbackUnderChosenDrafts) {
  using Mode = OracleModel::Mode;
  for (Mode mode : {Mode::kAlwaysRight, Mode::kAlwaysWrong, Mode::kWrongEveryThird}) {
    OracleModel m(model(), mode);
    for (size_t p = 0; p < 3; ++p) m.learn(reference(p));
    for (int32_t k : {1, 2, 3}) {
      SCOPED_TRACE(::testing::Message() << "K=" << k << " mode " << static_cast<int>(mode));
      const RunResult r = run(m, GetParam(), eager(config(k)), fixture_.prompts, {greedy(32), greedy(32), greedy(32)});
      for (size_t p = 0; p < 3; ++p) EXPECT_EQ(r.tokens[p], fixture_.greedy[p]) << "prompt " << p;
      const SpeculativeStats& s = r.stats;
      ASSERT_GT(s.num_draft_tokens, 0);
      if (mode == Mode::kAlwaysRight) {
        EXPECT_EQ(s.num_accepted_tokens, s.num_draft_tokens);
        // Each sequence: 31 tokens after the first, at most K + 1 per verify step.
        EXPECT_LE(s.num_drafts, 3 * ((31 + k) / (k + 1)) + 3);
      }
      if (mode == Mode::kAlwaysWrong) {
        EXPECT_EQ(s.num_accepted_tokens, 0);
      }
      if (mode == Mode::kWrongEveryThird) {
        EXPECT_GT(s.num_accepted_tokens, 0);
        EXPECT_LT(s.num_accepted_tokens, s.num_draft_tokens);
        // Every draft position was accepted somewhere, and the first more often than the last.
        for (int32_t j = 0; j < k && k < 3; ++j) {
          EXPECT_GT(s.accepted_per_position[static_cast<size_t>(j)], 0) << j;
        }
      }
    }
  }
}

// Sequences that finish inside an accepted run: a stop token the reference generates at position 5, and a
// max_tokens that ends between drafts; the output stops exactly where it does without speculation.
TEST_P(SpeculativeEngine, FinishingInsideAnAcceptedRun) {
  OracleModel m(model(), OracleModel::Mode::kAlwaysRight);
  for (size_t p = 0; p < 3; ++p) m.learn(reference(p));
  for (int32_t k : {2, 3}) {
    SCOPED_TRACE(::testing::Message() << "K=" << k);
    SamplingParams stop = greedy(32);
    stop.stop_token_ids = {fixture_.greedy[1][5]};
    const std::vector<SamplingParams> sampling = {greedy(6), stop, greedy(11)};
    const RunResult with = run(m, GetParam(), eager(config(k)), fixture_.prompts, sampling);
    const RunResult without = run(model(), GetParam(), config(0), fixture_.prompts, sampling);
    EXPECT_EQ(with.tokens, without.tokens);
    EXPECT_EQ(with.tokens[0].size(), 6u);
    EXPECT_EQ(with.tokens[2].size(), 11u);
    EXPECT_EQ(with.tokens[1].back(), fixture_.greedy[1][5]);
    EXPECT_LE(with.tokens[1].size(), 6u);
  }
}

// A KV pool too small for the batch: sequences are preempted in the middle of speculative runs (their drafts and
// spare slots dropped, recomputed on readmission) and still emit the reference tokens.
TEST_P(SpeculativeEngine, PreemptionInTheMiddleOfSpeculativeRuns) {
  OracleModel m(model(), OracleModel::Mode::kWrongEveryThird);
  for (size_t p = 0; p < 3; ++p) m.learn(reference(p));
  for (int32_t k : {1, 3}) {
    SCOPED_TRACE(::testing::Message() << "K=" << k);
    // 128-token sequences need 8 blocks; the three together reach 6 + 6 + 6 blocks of 16 tokens.
    const RunResult r =
        run(m, GetParam(), eager(config(k, 3, 10)), fixture_.prompts, {greedy(32), greedy(32), greedy(32)});
    EXPECT_GT(r.preemptions, 0);
    for (size_t p = 0; p < 3; ++p) EXPECT_EQ(r.tokens[p], fixture_.greedy[p]) << "prompt " << p;
  }
}

// Sampling (temperature 0.8, top-k 4): the second generated token (the first one a verify step emits) has the same
// distribution over 1,500 seeds with and without speculation (two-sample chi-square at 0.001), with drafts that are
// accepted and rejected; a seed gives the same tokens on every run, with the real head drafting.
TEST_P(SpeculativeEngine, SamplingKeepsTheTargetDistribution) {
  const int64_t n = 1500;
  std::vector<std::vector<int32_t>> prompts(static_cast<size_t>(n), fixture_.prompts[0]);
  std::vector<SamplingParams> sampling(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    SamplingParams& s = sampling[static_cast<size_t>(i)];
    s.temperature = 0.8f;
    s.top_k = 4;
    s.seed = static_cast<uint64_t>(1000 + i);
    s.max_new_tokens = 3;
    s.ignore_eos = true;
  }
  const int32_t batch = 64;
  // The random head's top 4 rarely meets the target's: the oracle drafts the greedy continuation instead (its q
  // almost all on that token), which the target accepts with probability p(token).
  OracleModel oracle(model(), OracleModel::Mode::kAlwaysRight);
  oracle.learn(reference(0));
  const RunResult with = run(oracle, GetParam(), eager(config(2, batch)), prompts, sampling);
  const RunResult without = run(model(), GetParam(), config(0, batch), prompts, sampling);
  EXPECT_GT(with.stats.num_accepted_tokens, 0);
  EXPECT_LT(with.stats.num_accepted_tokens, with.stats.num_draft_tokens);
  const int64_t V = model().config().vocab_size;
  std::vector<int64_t> a(static_cast<size_t>(V), 0), b(static_cast<size_t>(V), 0);
  for (int64_t i = 0; i < n; ++i) {
    ++a[static_cast<size_t>(with.tokens[static_cast<size_t>(i)][1])];
    ++b[static_cast<size_t>(without.tokens[static_cast<size_t>(i)][1])];
  }
  // Two-sample chi-square over tokens seen at least 5 times in the pooled counts (the rest pooled into one bin).
  double x2 = 0.0;
  int df = -1;
  int64_t rest_a = 0, rest_b = 0;
  for (int64_t v = 0; v < V; ++v) {
    const int64_t t = a[static_cast<size_t>(v)] + b[static_cast<size_t>(v)];
    if (t == 0) continue;
    if (t < 10) {
      rest_a += a[static_cast<size_t>(v)], rest_b += b[static_cast<size_t>(v)];
      continue;
    }
    const double d = static_cast<double>(a[static_cast<size_t>(v)] - b[static_cast<size_t>(v)]);
    x2 += d * d / static_cast<double>(t);
    ++df;
  }
  if (rest_a + rest_b > 0) {
    const double d = static_cast<double>(rest_a - rest_b);
    x2 += d * d / static_cast<double>(rest_a + rest_b);
    ++df;
  }
  ASSERT_GE(df, 2) << "the second token should take several values";
  EXPECT_LT(x2, chi_square_critical_001(df)) << "chi-square " << x2 << " with " << df << " df";
  // The same seeds again: the same tokens.
  const std::vector<std::vector<int32_t>> few(prompts.begin(), prompts.begin() + 8);
  const std::vector<SamplingParams> few_s(sampling.begin(), sampling.begin() + 8);
  EXPECT_EQ(run(model(), GetParam(), config(2, 8), few, few_s).tokens,
            run(model(), GetParam(), config(2, 8), few, few_s).tokens);
}

// What a demanding user combines with speculation: prompts longer than the token budget (the head's cache filled
// chunk by chunk), a model length that ends sequences mid-draft, a repetition penalty (each verify row's history
// holds the drafts before it), logprobs (the emitted tokens' own rows), and an abort between steps. Each run equals
// the same run without speculation.
TEST_P(SpeculativeEngine, ChunkedPrefillModelLengthPenaltiesLogprobsAndAbort) {
  OracleModel m(model(), OracleModel::Mode::kWrongByHash);
  for (size_t p = 0; p < 3; ++p) m.learn(reference(p));
  for (int32_t k : {1, 3}) {
    SCOPED_TRACE(::testing::Message() << "K=" << k);
    {  // a 16-token budget: the 37- and 53-token prompts prefill in chunks beside the others' verify steps
      EngineConfig with = eager(config(k)), without = config(0);
      with.scheduler.max_num_batched_tokens = without.scheduler.max_num_batched_tokens = 16;
      const std::vector<SamplingParams> sp = {greedy(32), greedy(32), greedy(32)};
      EXPECT_EQ(run(m, GetParam(), with, fixture_.prompts, sp).tokens,
                run(model(), GetParam(), without, fixture_.prompts, sp).tokens);
    }
    {  // max_model_len 60: the 53-token prompt stops after 7 tokens, whatever its drafts
      EngineConfig with = eager(config(k)), without = config(0);
      with.cache.max_model_len = without.cache.max_model_len = 60;
      const std::vector<SamplingParams> sp = {greedy(32), greedy(32), greedy(32)};
      const RunResult a = run(m, GetParam(), with, fixture_.prompts, sp);
      EXPECT_EQ(a.tokens, run(model(), GetParam(), without, fixture_.prompts, sp).tokens);
      EXPECT_EQ(a.tokens[2].size(), 7u);
    }
    {  // a repetition penalty, greedy
      SamplingParams pen = greedy(32);
      pen.repetition_penalty = 1.5f;
      pen.frequency_penalty = 0.3f;
      const std::vector<SamplingParams> sp = {pen, pen, pen};
      EXPECT_EQ(run(m, GetParam(), eager(config(k)), fixture_.prompts, sp).tokens,
                run(model(), GetParam(), config(0), fixture_.prompts, sp).tokens);
    }
    {  // logprobs: the emitted tokens' log-probabilities and top 3, as without speculation
      SamplingParams lp = greedy(16);
      lp.logprobs = 3;
      std::vector<std::vector<TokenEvent>> evs(2);
      for (int32_t kk : {0, k}) {
        Engine e(kk == 0 ? static_cast<const Model&>(model()) : m, ops::Context{GetParam(), nullptr},
                 kk == 0 ? config(0) : eager(config(kk)));
        e.add_request(fixture_.prompts[1], lp);
        while (e.has_unfinished()) {
          for (TokenEvent& ev : e.step()) evs[kk == 0 ? 0 : 1].push_back(std::move(ev));
        }
      }
      ASSERT_EQ(evs[0].size(), evs[1].size());
      for (size_t i = 0; i < evs[0].size(); ++i) {
        EXPECT_EQ(evs[0][i].token, evs[1][i].token) << i;
        EXPECT_NEAR(evs[0][i].logprob, evs[1][i].logprob, 1e-4) << i;
        ASSERT_EQ(evs[0][i].top_logprobs.size(), 3u);
        ASSERT_EQ(evs[1][i].top_logprobs.size(), 3u);
        for (size_t j = 0; j < 3; ++j) {
          EXPECT_EQ(evs[0][i].top_logprobs[j].first, evs[1][i].top_logprobs[j].first) << i;
          EXPECT_NEAR(evs[0][i].top_logprobs[j].second, evs[1][i].top_logprobs[j].second, 1e-4) << i;
        }
      }
    }
    {  // an abort after three steps frees the sequence's slots (spare ones too); the others go on unchanged
      Engine e(m, ops::Context{GetParam(), nullptr}, eager(config(k)));
      std::vector<int32_t> ids;
      for (size_t p = 0; p < 3; ++p) ids.push_back(e.add_request(fixture_.prompts[p], greedy(32)));
      for (int s = 0; s < 3; ++s) e.step();
      EXPECT_TRUE(e.abort_request(ids[1]));
      while (e.has_unfinished()) e.step();
      EXPECT_EQ(e.num_free_slots(), e.num_total_slots());
      std::map<int32_t, std::vector<int32_t>> by_id;
      for (Sequence& sq : e.take_finished()) by_id[sq.id] = {sq.tokens.begin() + sq.prompt_len, sq.tokens.end()};
      EXPECT_EQ(by_id[ids[0]], fixture_.greedy[0]);
      EXPECT_EQ(by_id[ids[2]], fixture_.greedy[2]);
    }
  }
}

// Captured speculative steps (CUDA graphs, the default) against eager ones, with the real head: K = 1, 2, 3, each
// prompt alone and the three together with different max_tokens (so buckets carry pad sequences, and sequences
// leave the batch mid-run): the reference tokens, the same acceptance counts as the eager engine, and most steps
// replayed.
TEST_P(SpeculativeEngine, CapturedStepsEqualEagerSteps) {
  if (GetParam() != Device::kCuda) GTEST_SKIP() << "CUDA graphs";
  const std::vector<SamplingParams> sampling = {greedy(32), greedy(17), greedy(25)};
  for (int32_t k : {1, 2, 3}) {
    SCOPED_TRACE(::testing::Message() << "K=" << k);
    for (size_t p = 0; p < fixture_.prompts.size(); ++p) {
      const RunResult g = run(model(), GetParam(), config(k, 1), {fixture_.prompts[p]}, {greedy(32)});
      const RunResult e = run(model(), GetParam(), eager(config(k, 1)), {fixture_.prompts[p]}, {greedy(32)});
      EXPECT_EQ(g.tokens[0], fixture_.greedy[p]) << "prompt " << p;
      EXPECT_EQ(g.stats.summary(), e.stats.summary()) << "prompt " << p;
      EXPECT_GT(g.graph_steps, 0) << "prompt " << p;
      EXPECT_EQ(e.graph_steps, 0);
    }
    const RunResult g = run(model(), GetParam(), config(k), fixture_.prompts, sampling);
    const RunResult e = run(model(), GetParam(), eager(config(k)), fixture_.prompts, sampling);
    EXPECT_EQ(g.tokens, e.tokens);
    for (size_t p = 0; p < 3; ++p) {
      EXPECT_EQ(g.tokens[p], std::vector<int32_t>(fixture_.greedy[p].begin(),
                                                  fixture_.greedy[p].begin() + sampling[p].max_new_tokens));
    }
    EXPECT_EQ(g.stats.summary(), e.stats.summary());
    EXPECT_GT(g.graph_steps, 0);
  }
}

TEST_P(SpeculativeEngine, ModelWithoutAHeadIsAClearError) {
  const test::Fixture plain = test::load_fixture("all_kinds");
  const test::LoadedFixture l = test::load_model(plain.dir, ModelOptions{GetParam(), DType::kF32});
  EXPECT_TRUE(test::throws_error(
      [&] {
        Engine e(*l.model, ops::Context{GetParam(), nullptr}, config(2));
      },
      ErrorKind::kInvalidInput, "this model has none"));
}

CHIMERA_INSTANTIATE_BACKENDS(SpeculativeEngine);

}  // namespace
}  // namespace chimera
