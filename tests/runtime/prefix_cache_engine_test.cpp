// Prefix caching in the engine (runtime/prefix_cache.h, Scheduler, Engine) on the fixture models: every workload gives
// exactly the greedy tokens it gives with the cache off, and the hit accounting is exact where the workload fixes
// it. Checkpoints every 32 tokens, KV blocks of 16, so prefixes of every length around the spacing are cheap.
//
// What differs: the scan restarts its chunk grid at a checkpoint's cut, other batch shapes pick other kernels' tiles,
// and a checkpoint taken in a decode step was reached through the single-token kernels, so the cached run's
// arithmetic differs from the uncached one's in rounding only. One request at a time (max_num_seqs 1) runs in every
// dtype, CUDA bf16 included (tokens equal, logits within the dtype's bound); where sequences share steps (batches,
// preemption) the workloads run in fp32 on the CPU and CUDA, where greedy tokens of the fixtures are robust to it.
#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "backends/device_api.h"
#include "common/backend_param.h"
#include "models/model_fixtures.h"
#include "runtime/engine.h"

namespace chimera {
namespace {

using test::BackendTest;
using Tokens = std::vector<int32_t>;

constexpr int32_t kInterval = 32;
constexpr int32_t kBlock = 16;

Tokens random_tokens(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> d(1, 255);  // the fixtures' vocabulary is 256
  Tokens t(n);
  for (auto& v : t) v = d(rng);
  return t;
}

Tokens cat(Tokens a, const Tokens& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

Tokens head(const Tokens& t, size_t n) {
  return Tokens(t.begin(), t.begin() + static_cast<ptrdiff_t>(n));
}

SamplingParams greedy(int32_t max_tokens) {
  SamplingParams p;
  p.max_new_tokens = max_tokens;
  p.ignore_eos = true;
  return p;
}

EngineConfig config(bool caching, int32_t max_seqs = 1, int32_t budget = kInterval) {
  EngineConfig ec;
  ec.cache.max_seqs = max_seqs;
  ec.cache.max_model_len = 384;
  ec.cache.block_size = kBlock;
  ec.cache.prefix_caching = caching;
  ec.cache.checkpoint_interval = kInterval;
  ec.cache.checkpoint_slots = 64;
  ec.scheduler.max_num_seqs = max_seqs;
  ec.scheduler.max_num_batched_tokens = budget;
  return ec;
}

// Runs the requests of each wave together, a wave after the previous one finished, on one engine.
struct WorkloadResult {
  std::vector<Tokens> tokens;      // generated, per request in order
  std::vector<std::vector<float>> logits;  // per request, the rows it sampled from, back to back
  std::vector<int64_t> wave_hits;  // prefix-cache hit tokens added by each wave
  PrefixCacheStats stats;
  int64_t preemptions = 0;
};
WorkloadResult run_waves(Engine& engine, const std::vector<std::vector<Tokens>>& waves, const SamplingParams& sp) {
  WorkloadResult r;
  std::map<int32_t, std::vector<float>> rows;
  engine.on_logits = [&rows](int32_t id, std::span<const float> row) {
    rows[id].insert(rows[id].end(), row.begin(), row.end());
  };
  for (const std::vector<Tokens>& wave : waves) {
    const int64_t hits_before = engine.prefix_cache_stats().hits;
    std::vector<int32_t> ids;
    for (const Tokens& p : wave) ids.push_back(engine.add_request(p, sp));
    while (engine.has_unfinished()) {
      for (const TokenEvent& ev : engine.step()) EXPECT_NE(ev.finish, FinishReason::kError) << ev.error;
    }
    std::map<int32_t, Tokens> by_id;
    for (Sequence& s : engine.take_finished()) by_id[s.id] = Tokens(s.tokens.begin() + s.prompt_len, s.tokens.end());
    for (int32_t id : ids) {
      r.tokens.push_back(by_id[id]);
      r.logits.push_back(rows[id]);
    }
    r.wave_hits.push_back(engine.prefix_cache_stats().hits - hits_before);
  }
  engine.on_logits = nullptr;  // it points at `rows`
  r.stats = engine.prefix_cache_stats();
  r.preemptions = engine.num_preemptions();
  return r;
}

// The rows one request sampled from with the cache and without: their largest difference at most `tol` of their largest
// magnitude (logits catch a wrong state that greedy tokens happen to survive).
void expect_logits_close(const std::vector<float>& cached, const std::vector<float>& plain, float tol,
                         const std::string& what) {
  EXPECT_EQ(cached.size(), plain.size()) << what;
  float worst = 0, scale = 0;
  for (size_t k = 0; k < std::min(cached.size(), plain.size()); ++k) {
    worst = std::max(worst, std::abs(cached[k] - plain[k]));
    scale = std::max(scale, std::abs(plain[k]));
  }
  EXPECT_LE(worst, tol * scale) << what << ": max |cached - uncached| " << worst << " of " << scale;
}

class PrefixCacheEngine : public BackendTest {
 protected:
  void SetUp() override {
    BackendTest::SetUp();
    if (IsSkipped()) return;
  }
  // The dtypes this backend runs: fp32 on the CPU; bf16 and fp32 on CUDA.
  std::vector<DType> dtypes() const {
    return on_cuda() ? std::vector<DType>{DType::kBF16, DType::kF32} : std::vector<DType>{DType::kF32};
  }
  const test::LoadedFixture& model(const std::string& name, DType dtype) {
    const std::string key = name + std::string(dtype_name(dtype));
    auto it = models_.find(key);
    if (it == models_.end()) {
      it = models_.emplace(key, test::load_model(test::load_fixture(name).dir, ModelOptions{GetParam(), dtype})).first;
    }
    return it->second;
  }
  // The workload with the cache on and off: the same tokens; returns the cached run.
  WorkloadResult compare(const std::string& fixture, DType dtype, const std::vector<std::vector<Tokens>>& waves,
                         EngineConfig on, const SamplingParams& sp = greedy(12)) {
    SCOPED_TRACE(::testing::Message() << fixture << " " << dtype_name(dtype));
    const NemotronH& m = *model(fixture, dtype).model;
    EngineConfig off = on;
    off.cache.prefix_caching = false;
    Engine cached(m, ops::Context{GetParam(), nullptr}, on);
    Engine plain(m, ops::Context{GetParam(), nullptr}, off);
    const WorkloadResult a = run_waves(cached, waves, sp);
    const WorkloadResult b = run_waves(plain, waves, sp);
    EXPECT_EQ(a.tokens, b.tokens);
    // The logits too, so a wrong state that greedy tokens happen to survive still shows: fp32 differs from the
    // uncached run by rounding (other chunk boundaries), bf16 by a few of its steps.
    const float tol = dtype == DType::kF32 ? 1e-4f : 5e-2f;
    for (size_t i = 0; i < a.logits.size() && a.tokens == b.tokens; ++i) {
      expect_logits_close(a.logits[i], b.logits[i], tol, "request " + std::to_string(i));
    }
    EXPECT_EQ(b.stats.queries, 0);
    EXPECT_EQ(b.stats.hits, 0);
    return a;
  }
  std::map<std::string, test::LoadedFixture> models_;
};

const std::vector<std::string> kFixtures = {"all_kinds", "super_like", "legacy_dense", "mtp"};

// The same prompt twice: the second restores the largest checkpoint short of its last token.
TEST_P(PrefixCacheEngine, SamePromptTwice) {
  const Tokens p = random_tokens(100, 1);
  for (const std::string& f : kFixtures) {
    for (DType dt : dtypes()) {
      const WorkloadResult r = compare(f, dt, {{p}, {p}}, config(true));
      EXPECT_EQ(r.wave_hits, (std::vector<int64_t>{0, 96}));
      EXPECT_EQ(r.stats.queries, 200);
      EXPECT_EQ(r.stats.restores, 1);
    }
  }
}

// A prompt one token past a checkpoint: the restored sequence has one token left, so its first step is a decode
// (the single-token kernels; on CUDA a graph replay) straight from the checkpoint.
TEST_P(PrefixCacheEngine, RestoredWithOneTokenLeftDecodesAtOnce) {
  const Tokens p = random_tokens(97, 9);
  for (DType dt : dtypes()) {
    const WorkloadResult r = compare("all_kinds", dt, {{p}, {p}, {cat(head(p, 96), {7})}}, config(true));
    EXPECT_EQ(r.wave_hits, (std::vector<int64_t>{0, 96, 96}));
  }
}

// Prompts sharing the first L tokens of one long prompt, for L around every multiple of the spacing and of the block
// size: each restores the last checkpoint at or below its shared full blocks, never from nothing when the shared part
// ends inside a block or between checkpoints.
TEST_P(PrefixCacheEngine, SharedPrefixesOfEveryLengthAroundTheSpacing) {
  const Tokens base = random_tokens(200, 2);
  std::vector<std::vector<Tokens>> waves = {{head(base, 150)}};
  std::vector<int64_t> want = {0};
  // The first request's checkpoints: every 32 tokens and its prompt's last block boundary.
  std::set<int32_t> checkpoints = {32, 64, 96, 128, 144};
  const std::vector<int32_t> lengths = {0,  1,  15, 16, 17, 31, 32,  33,  47,  48,
                                        63, 64, 65, 95, 96, 97, 127, 128, 129, 150};
  for (size_t i = 0; i < lengths.size(); ++i) {
    const int32_t L = lengths[i];
    waves.push_back({cat(head(base, static_cast<size_t>(L)), random_tokens(30, 100 + i))});
    // Blocks match while all their tokens are shared; a request restores the last checkpoint at or below them and
    // leaves one where its matched blocks end (where it parts from `base`).
    const int32_t matched = L / kBlock * kBlock;
    const auto at = checkpoints.upper_bound(matched);
    want.push_back(at == checkpoints.begin() ? 0 : *std::prev(at));
    if (matched > 0) checkpoints.insert(matched);
  }
  // Room for every block and checkpoint of the run (the waves leave about 80 checkpoints), so that LRU eviction plays
  // no part here.
  EngineConfig ec = config(true);
  ec.cache.checkpoint_slots = 256;
  ec.cache.num_blocks = 512;
  for (DType dt : dtypes()) {
    const WorkloadResult r = compare("all_kinds", dt, waves, ec);
    // Each later prompt also leaves checkpoints past L; none of them shares more with the next than `base` does.
    EXPECT_EQ(r.wave_hits, want);
  }
}

// A shared system prompt with different user turns, sent together: the first to be admitted computes the prefix,
// the others restore it once its checkpoint exists (chunks of 32 tokens, two sequences' worth a step).
TEST_P(PrefixCacheEngine, SharedSystemPromptWithDifferentUserTurns) {
  const Tokens system = random_tokens(70, 3);
  std::vector<Tokens> wave;
  for (int i = 0; i < 5; ++i) wave.push_back(cat(system, random_tokens(5 + 9 * static_cast<size_t>(i), 200 + i)));
  for (const std::string& f : kFixtures) {
    const WorkloadResult seq = compare(f, dtypes().front(), {{wave[0]}, {wave[1]}, {wave[2]}}, config(true));
    EXPECT_EQ(seq.wave_hits, (std::vector<int64_t>{0, 64, 64}));
    const WorkloadResult r = compare(f, DType::kF32, {wave}, config(true, 4, 2 * kInterval));
    EXPECT_GT(r.stats.hits, 0);
  }
}

// A conversation re-sent turn after turn (prompt = the previous prompt, its answer and a new user message): the
// checkpoints taken while decoding the answer serve the next turn.
TEST_P(PrefixCacheEngine, MultiTurnConversationResentTurnAfterTurn) {
  for (const std::string& f : kFixtures) {
    const NemotronH& m = *model(f, DType::kF32).model;
    std::vector<Tokens> outputs[2];
    std::vector<std::vector<float>> logits[2];
    int64_t hits = 0;
    for (bool caching : {true, false}) {
      Engine engine(m, ops::Context{GetParam(), nullptr}, config(caching));
      Tokens conversation = random_tokens(40, 4);
      for (int turn = 0; turn < 4; ++turn) {
        conversation = cat(conversation, random_tokens(20, 300 + static_cast<uint64_t>(turn)));
        const WorkloadResult r = run_waves(engine, {{conversation}}, greedy(24));
        outputs[caching ? 0 : 1].push_back(r.tokens[0]);
        logits[caching ? 0 : 1].push_back(r.logits[0]);
        conversation = cat(conversation, r.tokens[0]);
        if (caching) hits = r.stats.hits;
      }
    }
    EXPECT_EQ(outputs[0], outputs[1]) << f;
    for (size_t t = 0; t < logits[0].size() && outputs[0] == outputs[1]; ++t) {
      expect_logits_close(logits[0][t], logits[1][t], 1e-4f, f + " turn " + std::to_string(t));
    }
    // Turn t restores a checkpoint inside the previous turn's answer (decoded, at a multiple of 32): 64, 96, 160.
    EXPECT_EQ(hits, 64 + 96 + 160) << f;
  }
}

// A prompt leaves a checkpoint at its last block boundary besides the spacing's: resending it, or extending it as
// the next turn of a chat does, resumes within a block of its end, whether that boundary falls inside a chunk, at a
// chunk's end (budget 40: chunks [0, 40), [40, 80)) or in a step shared with other sequences.
TEST_P(PrefixCacheEngine, PromptsResumeAtTheirLastBlock) {
  const Tokens p = random_tokens(90, 10);  // 80 is its last block boundary, not a multiple of 32
  const std::vector<std::vector<Tokens>> waves = {{p}, {p}, {cat(p, random_tokens(25, 1000))}};
  for (int32_t budget : {kInterval, 40, 200}) {
    SCOPED_TRACE(::testing::Message() << "budget " << budget);
    for (DType dt : dtypes()) {
      const WorkloadResult r = compare("all_kinds", dt, waves, config(true, 1, budget));
      EXPECT_EQ(r.wave_hits, (std::vector<int64_t>{0, 80, 80}));
    }
  }
  // Three prompts in one step, each cut at its spacing and its own last block (pieces of 32/32/16/10, 32/16/2 and
  // 16/4 rows run in waves), then each resent.
  const std::vector<Tokens> three = {random_tokens(90, 11), random_tokens(50, 12), random_tokens(20, 13)};
  const WorkloadResult r = compare("all_kinds", DType::kF32, {three, three}, config(true, 4, 400));
  EXPECT_EQ(r.wave_hits, (std::vector<int64_t>{0, 80 + 48 + 16}));
}

// A shared system prompt that ends between checkpoints: the first request to find its KV blocks with no checkpoint
// at their end leaves one there, and every later one resumes at the system prompt's last block.
TEST_P(PrefixCacheEngine, APromptLeavesACheckpointWhereItPartsFromAnEarlierOne) {
  const Tokens system = random_tokens(50, 14);  // blocks to 48; the first request's checkpoints: 32, 64, 80
  const std::vector<std::vector<Tokens>> waves = {{cat(system, random_tokens(40, 1400))},
                                                  {cat(system, random_tokens(30, 1401))},
                                                  {cat(system, random_tokens(20, 1402))}};
  for (DType dt : dtypes()) {
    const WorkloadResult r = compare("all_kinds", dt, waves, config(true));
    EXPECT_EQ(r.wave_hits, (std::vector<int64_t>{0, 32, 48}));
  }
}

// A pool of one sequence's KV blocks and two checkpoints: later prompts evict earlier prefixes, the outputs never
// change, and a prompt whose prefix was evicted computes it again.
TEST_P(PrefixCacheEngine, EvictionUnderATinyBudget) {
  EngineConfig ec = config(true);
  ec.cache.num_blocks = ec.cache.max_model_len / kBlock;
  ec.cache.checkpoint_slots = 2;
  std::vector<std::vector<Tokens>> waves;
  std::vector<Tokens> prompts;
  for (int i = 0; i < 4; ++i) prompts.push_back(random_tokens(100, 400 + static_cast<uint64_t>(i)));
  for (const Tokens& p : prompts) waves.push_back({p});
  waves.push_back({prompts[3]});  // the last one's prefix survives (its 96 is among the two newest checkpoints)
  waves.push_back({prompts[0]});  // the first one's is long gone
  for (DType dt : dtypes()) {
    const WorkloadResult r = compare("all_kinds", dt, waves, ec);
    EXPECT_EQ(r.wave_hits, (std::vector<int64_t>{0, 0, 0, 0, 96, 0}));
  }
}

// Sequences sharing a cached prefix in a pool too small for all of them: preemption frees a sequence's references
// while others still read the shared blocks, and the preempted one comes back on the cached prefix.
TEST_P(PrefixCacheEngine, PreemptionWhileACachedPrefixIsInUse) {
  const Tokens system = random_tokens(64, 5);
  std::vector<Tokens> wave;
  for (int i = 0; i < 4; ++i) wave.push_back(cat(system, random_tokens(20, 500 + static_cast<uint64_t>(i))));
  EngineConfig ec = config(true, 4, 2 * kInterval);
  ec.cache.num_blocks = ec.cache.max_model_len / kBlock;  // 24 blocks; four sequences of ~150 tokens need more
  const WorkloadResult r = compare("all_kinds", DType::kF32, {{system}, wave}, ec, greedy(64));
  EXPECT_GT(r.preemptions, 0);
  EXPECT_GE(r.wave_hits[1], 4 * 64);  // every admission of the second wave restored at least the system prompt
}

// Speculative decoding with the MTP head and prefix caching together: the greedy tokens of either alone.
TEST_P(PrefixCacheEngine, WithMtpSpeculativeDecoding) {
  const Tokens system = random_tokens(70, 6);
  std::vector<std::vector<Tokens>> waves = {{cat(system, random_tokens(9, 600))},
                                            {cat(system, random_tokens(13, 601))},
                                            {cat(system, random_tokens(30, 602))}};
  for (int32_t k : {1, 3}) {
    EngineConfig ec = config(true);
    ec.speculative = SpeculativeConfig{"mtp", k};
    const WorkloadResult r = compare("mtp", DType::kF32, waves, ec, greedy(40));
    EXPECT_EQ(r.wave_hits, (std::vector<int64_t>{0, 64, 64}));
  }
}

// Step budgets below and above the spacing: chunks end on every checkpoint boundary either way.
TEST_P(PrefixCacheEngine, ChunkedPrefillOfAnyBudget) {
  const Tokens base = random_tokens(150, 7);
  const std::vector<std::vector<Tokens>> waves = {{base}, {cat(head(base, 120), random_tokens(7, 700))}};
  for (int32_t budget : {20, 48, 100, 400}) {
    SCOPED_TRACE(::testing::Message() << "budget " << budget);
    const WorkloadResult r = compare("all_kinds", DType::kF32, waves, config(true, 1, budget));
    EXPECT_EQ(r.wave_hits, (std::vector<int64_t>{0, 96}));
  }
}

// A request asking for prompt logprobs computes its whole prompt (its rows are the answer) and is not counted.
TEST_P(PrefixCacheEngine, PromptLogprobsBypassTheCache) {
  const NemotronH& m = *model("all_kinds", DType::kF32).model;
  Engine engine(m, ops::Context{GetParam(), nullptr}, config(true));
  const Tokens p = random_tokens(80, 8);
  run_waves(engine, {{p}}, greedy(4));
  SamplingParams sp = greedy(4);
  sp.prompt_logprobs = 0;
  engine.add_request(p, sp);
  std::vector<PromptLogprob> got;
  while (engine.has_unfinished()) {
    for (TokenEvent& ev : engine.step()) {
      if (!ev.prompt_logprobs.empty()) got = std::move(ev.prompt_logprobs);
    }
  }
  EXPECT_EQ(got.size(), p.size() - 1);
  EXPECT_EQ(engine.prefix_cache_stats().queries, 80);
  EXPECT_EQ(engine.prefix_cache_stats().hits, 0);
}

CHIMERA_INSTANTIATE_BACKENDS(PrefixCacheEngine);

}  // namespace
}  // namespace chimera
