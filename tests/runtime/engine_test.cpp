// The engine as a server drives it: requests join and leave between steps. The bundled tiny model (every layer
// kind) runs on each backend; a request's output in a busy engine must equal its output alone, whatever else
// joins, leaves or is aborted around it (the sampler depends only on (seed, step), the state only on the
// sequence's own tokens).
#include "runtime/engine.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>

#include "common/backend_param.h"
#include "common/compare.h"
#include "common/tolerances.h"
#include "core/error.h"
#include "io/model_config.h"
#include "io/safetensors.h"
#include "models/nemotron_h.h"
#include "runtime/model.h"

namespace chimera {
namespace {

class EngineTest : public test::BackendTest {
 protected:
  void SetUp() override {
    test::BackendTest::SetUp();
    if (IsSkipped()) return;
    const std::string dir = test::source_path("models/nemotron-h-tiny");
    config_ = load_model_config(dir);
    ckpt_ = std::make_unique<Checkpoint>(Checkpoint::open(dir));
    // fp32 on both backends: equal tokens across batch compositions and kernel paths need no bf16 near-ties.
    const ModelOptions mo{GetParam(), DType::kF32};
    model_ = std::make_unique<NemotronH>(NemotronH::load(config_, *ckpt_, mo));
  }

  EngineConfig small_config(int32_t seqs) const {
    EngineConfig ec;
    ec.cache.max_seqs = seqs;
    ec.cache.max_model_len = 96;
    ec.cache.block_size = 8;
    ec.scheduler.max_num_seqs = seqs;
    ec.scheduler.max_num_batched_tokens = 64;
    return ec;
  }

  static std::vector<int32_t> prompt(int32_t len, int32_t salt) {
    std::vector<int32_t> p(static_cast<size_t>(len));
    for (int32_t i = 0; i < len; ++i) p[static_cast<size_t>(i)] = (salt * 131 + i * 17 + 3) % 4000 + 5;
    return p;
  }

  static SamplingParams sampling(int32_t n, float temperature = 0.0f, uint64_t seed = 0) {
    SamplingParams sp;
    sp.max_new_tokens = n;
    sp.ignore_eos = true;
    sp.temperature = temperature;
    sp.top_k = temperature > 0 ? 50 : 0;
    sp.seed = seed;
    return sp;
  }

  // The generated tokens of one request run alone in a fresh engine.
  std::vector<int32_t> alone(const std::vector<int32_t>& p, const SamplingParams& sp) const {
    return generate_all(*model_, ops::Context{GetParam(), nullptr}, small_config(1), {p}, sp)[0];
  }

  static std::map<int32_t, Sequence> by_id(std::vector<Sequence> done) {
    std::map<int32_t, Sequence> m;
    for (Sequence& s : done) m[s.id] = std::move(s);
    return m;
  }
  static std::vector<int32_t> generated(const Sequence& s) {
    return std::vector<int32_t>(s.tokens.begin() + s.prompt_len, s.tokens.end());
  }

  ModelConfig config_;
  std::unique_ptr<Checkpoint> ckpt_;
  std::unique_ptr<NemotronH> model_;
};

// last_step() says what each step computed: a 150-token prompt in chunks of 64 (the budget), then one-token
// decodes, a second request's chunk riding with the first one's decode.
TEST_P(EngineTest, LastStepCountsPrefillAndDecodeTokens) {
  EngineConfig ec = small_config(2);
  ec.cache.max_model_len = 256;
  ec.cuda_graphs = false;
  Engine engine(*model_, ctx(), ec);
  EXPECT_EQ(engine.last_step().prefill_tokens, 0);
  engine.add_request(prompt(150, 1), sampling(3));
  std::vector<std::pair<int32_t, int32_t>> steps;
  for (int i = 0; i < 4; ++i) {
    if (i == 3) engine.add_request(prompt(10, 2), sampling(1));
    engine.step();
    steps.emplace_back(engine.last_step().prefill_tokens, engine.last_step().decode_tokens);
    EXPECT_FALSE(engine.last_step().graph);
  }
  const std::vector<std::pair<int32_t, int32_t>> want{{64, 0}, {64, 0}, {22, 0}, {10, 1}};
  EXPECT_EQ(steps, want);
}

TEST_P(EngineTest, AbortFreesSlotAndBlocksAtOnceAndLeavesOthersUnchanged) {
  Engine engine(*model_, ctx(), small_config(2));
  EXPECT_EQ(engine.num_total_slots(), 2);
  EXPECT_EQ(engine.num_total_blocks(), 2 * 12);  // 96 tokens / 8 per block, per slot
  EXPECT_EQ(engine.kv_cache_usage(), 0.0);

  const auto p0 = prompt(21, 0), p1 = prompt(13, 1), p2 = prompt(9, 2);
  const int32_t a = engine.add_request(p0, sampling(12));
  const int32_t b = engine.add_request(p1, sampling(12));
  const int32_t c = engine.add_request(p2, sampling(12));
  EXPECT_EQ(engine.num_waiting(), 3);
  engine.step();  // a and b admitted (two slots), c waits
  engine.step();
  EXPECT_EQ(engine.num_running(), 2);
  EXPECT_EQ(engine.num_waiting(), 1);
  EXPECT_EQ(engine.num_free_slots(), 0);
  const int32_t used_before = engine.num_total_blocks() - engine.num_free_blocks();
  EXPECT_GT(engine.kv_cache_usage(), 0.0);

  // Abort the running b: its slot and its 2 blocks (13 + 2 tokens) come back before any further step.
  EXPECT_TRUE(engine.abort_request(b));
  EXPECT_EQ(engine.num_running(), 1);
  EXPECT_EQ(engine.num_free_slots(), 1);
  EXPECT_EQ(engine.num_total_blocks() - engine.num_free_blocks(), used_before - 2);
  // Twice, or an id never issued: no-ops.
  EXPECT_FALSE(engine.abort_request(b));
  EXPECT_FALSE(engine.abort_request(1000));
  EXPECT_FALSE(engine.abort_request(-1));

  // c takes b's slot (reused, so it must start from zero state); a new request d waits and is aborted there.
  const auto p3 = prompt(17, 3);
  const int32_t d = engine.add_request(p3, sampling(5));
  engine.step();
  EXPECT_EQ(engine.num_running(), 2);
  EXPECT_EQ(engine.num_waiting(), 1);
  EXPECT_TRUE(engine.abort_request(d));
  EXPECT_EQ(engine.num_waiting(), 0);

  while (engine.has_unfinished()) engine.step();
  EXPECT_FALSE(engine.abort_request(a));  // finished
  std::map<int32_t, Sequence> done = by_id(engine.take_finished());
  ASSERT_EQ(done.size(), 4u);
  EXPECT_EQ(done[b].finish, FinishReason::kAbort);
  EXPECT_EQ(done[b].num_generated(), 2);  // the tokens it had when aborted
  EXPECT_EQ(done[d].finish, FinishReason::kAbort);
  EXPECT_EQ(done[d].num_generated(), 0);
  EXPECT_EQ(done[a].finish, FinishReason::kLength);
  EXPECT_EQ(done[c].finish, FinishReason::kLength);
  EXPECT_EQ(generated(done[a]), alone(p0, sampling(12)));
  EXPECT_EQ(generated(done[c]), alone(p2, sampling(12)));
  // Everything returned to the pools.
  EXPECT_EQ(engine.num_free_slots(), 2);
  EXPECT_EQ(engine.num_free_blocks(), engine.num_total_blocks());
  EXPECT_EQ(engine.kv_cache_usage(), 0.0);
  EXPECT_TRUE(engine.take_finished().empty());
}

TEST_P(EngineTest, AbortMidPrefillReleasesTheChunkedSequence) {
  EngineConfig ec = small_config(2);
  ec.scheduler.max_num_batched_tokens = 8;  // a 30-token prompt prefills over 4 steps
  Engine engine(*model_, ctx(), ec);
  const int32_t a = engine.add_request(prompt(30, 4), sampling(3));
  engine.step();
  EXPECT_EQ(engine.num_running(), 1);
  EXPECT_EQ(engine.num_free_blocks(), engine.num_total_blocks() - 1);
  EXPECT_TRUE(engine.abort_request(a));
  EXPECT_FALSE(engine.has_unfinished());
  EXPECT_EQ(engine.num_free_blocks(), engine.num_total_blocks());
  EXPECT_TRUE(engine.step().empty());
  const std::vector<Sequence> done = engine.take_finished();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].finish, FinishReason::kAbort);
  EXPECT_EQ(done[0].num_generated(), 0);
}

// Runs the prompts in one engine of `ec`; returns each prompt's generated tokens and its reported logits rows.
struct PoolRun {
  std::vector<std::vector<int32_t>> tokens;
  std::vector<std::vector<float>> logits;
  int64_t preemptions = 0;
};

TEST_P(EngineTest, ASmallKvPoolPreemptsAndGivesTheSameOutputs) {
  std::vector<std::vector<int32_t>> prompts;
  for (int32_t p = 0; p < 5; ++p) prompts.push_back(prompt(9 + 6 * p, 10 + p));
  auto run = [&](int32_t num_blocks, int32_t batched_tokens, float temperature) {
    EngineConfig ec = small_config(4);
    ec.cache.num_blocks = num_blocks;
    ec.scheduler.max_num_batched_tokens = batched_tokens;
    Engine engine(*model_, ctx(), ec);
    PoolRun r;
    std::map<int32_t, std::vector<float>> rows;
    engine.on_logits = [&](int32_t id, std::span<const float> row) {
      rows[id].insert(rows[id].end(), row.begin(), row.end());
    };
    std::vector<int32_t> ids;
    for (size_t p = 0; p < prompts.size(); ++p) {
      ids.push_back(engine.add_request(prompts[p], sampling(40 - 3 * static_cast<int32_t>(p), temperature,
                                                            1234 + p)));
    }
    while (engine.has_unfinished()) engine.step();
    std::map<int32_t, Sequence> done = by_id(engine.take_finished());
    for (int32_t id : ids) {
      EXPECT_EQ(done[id].finish, FinishReason::kLength);
      r.tokens.push_back(generated(done[id]));
      r.logits.push_back(rows[id]);
    }
    EXPECT_EQ(engine.num_free_blocks(), engine.num_total_blocks());
    EXPECT_EQ(engine.num_free_slots(), engine.num_total_slots());
    r.preemptions = engine.num_preemptions();
    return r;
  };
  const int64_t V = config_.vocab_size;
  for (const float temperature : {0.0f, 0.8f}) {
    const PoolRun big = run(0, 64, temperature);  // 4 x 12 blocks: never short
    EXPECT_EQ(big.preemptions, 0);
    // 13 blocks of 8 tokens hold one 96-token sequence: five sequences of 49 to 61 tokens, four at a time,
    // preempt each other (with 16-token steps the recompute itself is chunked).
    for (const int32_t batched : {64, 16}) {
      const PoolRun small = run(13, batched, temperature);
      EXPECT_GE(small.preemptions, 2) << "the pool was not small enough to preempt";
      for (size_t p = 0; p < prompts.size(); ++p) {
        EXPECT_EQ(small.tokens[p], big.tokens[p]) << "prompt " << p << " temperature " << temperature;
        // One logits row per generated token, each reported once, close to the unconstrained run's (a
        // recomputed token goes through the prefill kernels instead of the decode kernels: rounding differs).
        ASSERT_EQ(small.logits[p].size(), big.logits[p].size());
        ASSERT_EQ(small.logits[p].size(), small.tokens[p].size() * static_cast<size_t>(V));
        double worst = 0, scale = 0;
        for (size_t i = 0; i < big.logits[p].size(); ++i) {
          worst = std::max(worst, static_cast<double>(std::abs(small.logits[p][i] - big.logits[p][i])));
          scale = std::max(scale, static_cast<double>(std::abs(big.logits[p][i])));
        }
        EXPECT_LE(worst, (on_cuda() ? test::kGpuModelLogitsRelToMax : test::kModelLogitsRelToMax) * scale)
            << "prompt " << p;
      }
    }
  }
}

TEST_P(EngineTest, BoundedWaitingQueueRefusesWithOverloadedAndAcceptsAgainLater) {
  EngineConfig ec = small_config(1);
  ec.scheduler.max_waiting = 2;
  Engine engine(*model_, ctx(), ec);
  engine.add_request(prompt(5, 0), sampling(3));
  engine.add_request(prompt(5, 1), sampling(3));
  try {
    engine.add_request(prompt(5, 2), sampling(3));
    ADD_FAILURE() << "a third waiting request was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kOverloaded);
  }
  engine.step();  // one admitted
  EXPECT_EQ(engine.num_waiting(), 1);
  const int32_t c = engine.add_request(prompt(5, 3), sampling(3));
  while (engine.has_unfinished()) engine.step();
  EXPECT_EQ(by_id(engine.take_finished()).size(), 3u);
  EXPECT_EQ(c, 2);  // a refused request spends no id
}

// The engine needs nothing of a model beyond runtime/model.h: a wrapper that only forwards (and counts steps)
// runs the same requests to the same tokens.
class CountingModel : public Model {
 public:
  explicit CountingModel(const Model& inner) : inner_(inner) {}
  const ModelConfig& config() const override { return inner_.config(); }
  Device device() const override { return inner_.device(); }
  DType activation_dtype() const override { return inner_.activation_dtype(); }
  Tensor forward(const ops::Context& ctx, const StepBatch& b, ModelState& state) const override {
    ++steps;
    return inner_.forward(ctx, b, state);
  }
  Tensor forward_device(const ops::Context& ctx, const StepBatch& b, ModelState& state) const override {
    ++steps;
    return inner_.forward_device(ctx, b, state);
  }
  mutable int steps = 0;

 private:
  const Model& inner_;
};

TEST_P(EngineTest, RunsAnyModelThroughTheModelInterface) {
  const CountingModel counting(*model_);
  const std::vector<std::vector<int32_t>> prompts = {prompt(7, 1), prompt(12, 2)};
  EngineConfig ec = small_config(2);
  ec.cuda_graphs = false;  // every step calls the model
  const auto got = generate_all(counting, ctx(), ec, prompts, sampling(6));
  EXPECT_EQ(got, generate_all(*model_, ctx(), ec, prompts, sampling(6)));
  EXPECT_EQ(counting.steps, 6);  // one prefill step with both prompts, then 5 decode steps
}

// Reference prompt logprobs: the raw log-softmax (in double) of the logits rows that on_logits reports with
// return_prompt_logits, row i scoring prompt token i + 1; top ids by descending logit, ties to the lower id.
struct RefPromptLogprob {
  double logprob;
  int32_t rank;
  std::vector<int32_t> top;
};
std::vector<RefPromptLogprob> reference_prompt_logprobs(const std::vector<float>& rows, const std::vector<int32_t>& p,
                                                        int64_t V, int32_t k) {
  std::vector<RefPromptLogprob> out;
  for (size_t i = 0; i + 1 < p.size(); ++i) {
    const float* row = rows.data() + static_cast<int64_t>(i) * V;
    double mx = row[0], sum = 0;
    for (int64_t v = 0; v < V; ++v) mx = std::max(mx, static_cast<double>(row[v]));
    for (int64_t v = 0; v < V; ++v) sum += std::exp(row[v] - mx);
    const float l = row[p[i + 1]];
    RefPromptLogprob r{l - mx - std::log(sum), 1, {}};
    for (int64_t v = 0; v < V; ++v) r.rank += row[v] > l ? 1 : 0;
    std::vector<int32_t> ids(static_cast<size_t>(V));
    for (int64_t v = 0; v < V; ++v) ids[static_cast<size_t>(v)] = static_cast<int32_t>(v);
    std::stable_sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) { return row[a] > row[b]; });
    r.top.assign(ids.begin(), ids.begin() + k);
    out.push_back(std::move(r));
  }
  return out;
}

TEST_P(EngineTest, PromptLogprobsAreTheLogSoftmaxOfThePromptRowsOverEveryPrefillChunk) {
  const int64_t V = config_.vocab_size;
  const std::vector<int32_t> p = prompt(41, 7);  // three 16-token prefill chunks (16 + 16 + 9)
  const int32_t k = 3;
  // The reference: every prompt row of one request alone, as `chimera generate --logits-out` writes them.
  EngineConfig ref_cfg = small_config(1);
  ref_cfg.return_prompt_logits = true;
  Engine ref(*model_, ctx(), ref_cfg);
  std::vector<float> rows;
  ref.on_logits = [&](int32_t, std::span<const float> row) { rows.insert(rows.end(), row.begin(), row.end()); };
  ref.add_request(p, sampling(2));
  while (ref.has_unfinished()) ref.step();
  ASSERT_EQ(rows.size(), (p.size() + 1) * static_cast<size_t>(V));  // 41 prompt rows, then the second token's
  const std::vector<RefPromptLogprob> want = reference_prompt_logprobs(rows, p, V, k);

  // The engine under test: prompt logprobs for one request only, chunked prefill, another request beside it.
  EngineConfig cfg = small_config(2);
  cfg.scheduler.max_num_batched_tokens = 16;
  Engine engine(*model_, ctx(), cfg);
  int32_t logits_rows = 0;
  engine.on_logits = [&](int32_t, std::span<const float>) { ++logits_rows; };
  SamplingParams sp = sampling(3);
  sp.prompt_logprobs = k;
  const int32_t other = engine.add_request(prompt(20, 8), sampling(3));
  const int32_t id = engine.add_request(p, sp);
  std::vector<TokenEvent> first;
  std::map<int32_t, int32_t> events_of;
  while (engine.has_unfinished()) {
    for (TokenEvent& ev : engine.step()) {
      if (events_of[ev.seq_id]++ == 0) {
        first.push_back(std::move(ev));
      } else {
        EXPECT_TRUE(ev.prompt_logprobs.empty()) << "prompt logprobs come with the first event only";
      }
    }
  }
  // Rows computed only for prompt logprobs do not reach on_logits: one row per generated token of each.
  EXPECT_EQ(logits_rows, 6);
  ASSERT_EQ(first.size(), 2u);
  for (const TokenEvent& ev : first) {
    if (ev.seq_id == other) {
      EXPECT_TRUE(ev.prompt_logprobs.empty());
    }
  }
  const TokenEvent& ev = first[0].seq_id == id ? first[0] : first[1];
  ASSERT_EQ(ev.prompt_logprobs.size(), p.size() - 1);
  // Chunked and batched beside another sequence, the logits differ from the reference's by rounding only
  // (kModelLogitsRelToMax of the largest logit); a log-softmax value moves by at most twice the largest logit
  // change (|d lse| <= max |d l|).
  double scale = 0;
  for (float v : rows) scale = std::max(scale, static_cast<double>(std::abs(v)));
  const double tol = 2 * (on_cuda() ? test::kGpuModelLogitsRelToMax : test::kModelLogitsRelToMax) * scale;
  for (size_t i = 0; i + 1 < p.size(); ++i) {
    const PromptLogprob& got = ev.prompt_logprobs[i];
    EXPECT_EQ(got.token, p[i + 1]) << "position " << i + 1;
    EXPECT_NEAR(got.logprob, want[i].logprob, tol) << "position " << i + 1;
    EXPECT_LT(got.logprob, 0.0f);
    EXPECT_EQ(got.rank, want[i].rank) << "position " << i + 1;
    ASSERT_EQ(got.top.size(), static_cast<size_t>(k));
    for (int32_t j = 0; j < k; ++j) {
      EXPECT_EQ(got.top[j].first, want[i].top[j]) << "position " << i + 1 << " top " << j;
      if (got.top[j].first == p[i + 1]) {
        EXPECT_FLOAT_EQ(got.top[j].second, got.logprob);
      }
    }
    for (int32_t j = 1; j < k; ++j) EXPECT_GE(got.top[j - 1].second, got.top[j].second);
  }
}

TEST_P(EngineTest, PromptLogprobsWithNoNewTokensAndOfAOneTokenPrompt) {
  Engine engine(*model_, ctx(), small_config(2));
  SamplingParams sp = sampling(0);
  sp.prompt_logprobs = 0;
  const int32_t a = engine.add_request(prompt(5, 3), sp);
  const int32_t b = engine.add_request(prompt(1, 4), sp);
  std::map<int32_t, std::vector<TokenEvent>> evs;
  while (engine.has_unfinished()) {
    for (TokenEvent& ev : engine.step()) evs[ev.seq_id].push_back(std::move(ev));
  }
  ASSERT_EQ(evs[a].size(), 1u);
  EXPECT_EQ(evs[a][0].token, -1);
  EXPECT_EQ(evs[a][0].finish, FinishReason::kLength);
  ASSERT_EQ(evs[a][0].prompt_logprobs.size(), 4u);
  for (const PromptLogprob& lp : evs[a][0].prompt_logprobs) EXPECT_TRUE(lp.top.empty());
  ASSERT_EQ(evs[b].size(), 1u);
  EXPECT_TRUE(evs[b][0].prompt_logprobs.empty());
  SamplingParams bad = sampling(1);
  bad.prompt_logprobs = 21;
  EXPECT_THROW(engine.add_request(prompt(3, 1), bad), Error);
}

CHIMERA_INSTANTIATE_BACKENDS(EngineTest);

}  // namespace
}  // namespace chimera
