// Tensor parallelism on the CPU backend (docs/architecture.md "Tensor parallelism"): N rank models, each holding
// its shard of the weights (ModelOptions::tp) and its own StateCache made from its rank-local config, run the same
// StepBatch in N threads over one dist::HostGroup. Against the unsharded model (TP = 1) they must give the same
// greedy tokens and logits within fp32 summation-order noise, and every rank the same logits bits, over a
// prefill step, a mixed step (a prompt chunk after a cached prefix, plus a decode row) and decode steps.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/backend_param.h"
#include "common/tolerances.h"
#include "core/error.h"
#include "dist/host_group.h"
#include "io/model_presets.h"
#include "models/model_fixtures.h"
#include "models/nemotron_h.h"
#include "models/tensor_parallel.h"
#include "runtime/state_cache.h"

namespace chimera {
namespace {

namespace fs = std::filesystem;

// One run of a model over N ranks (N = 1: the unsharded model, no communicator).
struct Ranks {
  std::vector<std::unique_ptr<NemotronH>> models;
  std::vector<std::unique_ptr<StateCache>> caches;
  std::unique_ptr<dist::HostGroup> group;

  void attach(int n, bool mtp) {
    if (n > 1) group = std::make_unique<dist::HostGroup>(n, std::chrono::seconds(30));
    CacheSizes sizes;
    sizes.max_seqs = 5;  // two sequences and three slots for a verify step's rows
    sizes.max_model_len = 64;
    sizes.block_size = 16;
    sizes.mtp = mtp;
    for (auto& m : models) {
      m->set_tensor_parallel_group(group.get());
      caches.push_back(std::make_unique<StateCache>(m->local_config(), sizes, Device::kCpu, DType::kF32));
    }
  }

  // Every rank's forward of `b` on its own thread; rank 0's logits (after checking every rank has the same bits).
  std::vector<float> step(const StepBatch& b, Tensor* hidden = nullptr, int mtp_block = -1,
                          const Tensor* mtp_in = nullptr) {
    const size_t n = models.size();
    std::vector<Tensor> logits(n), hiddens(n);
    std::vector<std::string> errors(n);
    std::vector<std::thread> threads;
    for (size_t r = 0; r < n; ++r) {
      threads.emplace_back([&, r] {
        try {
          const ops::Context ctx{Device::kCpu, nullptr};
          ModelState& state = caches[r]->state();
          if (mtp_block >= 0) {
            logits[r] = models[r]->mtp_forward_device(ctx, b, *mtp_in, state, mtp_block);
          } else if (hidden) {
            logits[r] = models[r]->forward_device(ctx, b, state, hiddens[r]);
          } else {
            logits[r] = models[r]->forward(ctx, b, state);
          }
        } catch (const Error& e) {
          errors[r] = e.what();
          if (group) group->abort(static_cast<int>(r), e.what());
        }
      });
    }
    for (std::thread& t : threads) t.join();
    for (size_t r = 0; r < n; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
    if (!errors[0].empty()) return {};
    const int64_t V = models[0]->config().vocab_size;
    EXPECT_EQ(logits[0].shape(), (Shape{static_cast<int64_t>(b.logit_rows.size()), V}));
    for (size_t r = 1; r < n; ++r) {
      EXPECT_EQ(std::memcmp(logits[r].f32(), logits[0].f32(), logits[0].nbytes()), 0) << "rank " << r << " differs";
    }
    if (hidden) *hidden = hiddens[0];
    return std::vector<float>(logits[0].f32(), logits[0].f32() + logits[0].numel());
  }

  // A slot without blocks in every rank's cache (a speculative verify row's), the same id on every rank.
  int32_t spare() {
    std::vector<int32_t> ids;
    for (auto& c : caches) ids.push_back(c->allocate_slot());
    for (int32_t id : ids) EXPECT_EQ(id, ids[0]);
    return ids[0];
  }

  // Slot s and its blocks in every rank's cache (the same ids: the caches are filled in the same order).
  int32_t slot(std::vector<int32_t>& blocks, int32_t tokens) {
    int32_t id = -1;
    for (size_t r = 0; r < caches.size(); ++r) {
      std::vector<int32_t> bl;
      const int32_t s = caches[r]->allocate_slot();
      EXPECT_TRUE(caches[r]->reserve_blocks(bl, tokens));
      if (r == 0) {
        id = s;
        blocks = bl;
      }
      EXPECT_EQ(s, id);
      EXPECT_EQ(bl, blocks);
    }
    return id;
  }
};

struct Seq {
  std::vector<int32_t> tokens;
  int32_t slot = -1;
  std::vector<int32_t> blocks;
  int32_t cached = 0;
};

// A step over (sequence, new tokens) parts, the first num_prefill of them multi-token; logits for `rows`
// (empty: every row).
StepBatch batch(const std::vector<std::pair<Seq*, std::vector<int32_t>>>& parts, int32_t num_prefill,
                std::vector<int32_t> rows) {
  StepBatch b;
  std::vector<int32_t> table;
  const int32_t width = 4;
  for (const auto& [s, toks] : parts) {
    b.token_ids.insert(b.token_ids.end(), toks.begin(), toks.end());
    b.cu_seqlens.push_back(b.cu_seqlens.back() + static_cast<int32_t>(toks.size()));
    b.context_lens.push_back(s->cached);
    b.state_slots.push_back(s->slot);
    std::vector<int32_t> row = s->blocks;
    row.resize(width, 0);
    table.insert(table.end(), row.begin(), row.end());
  }
  b.block_tables = Tensor::from_i32({static_cast<int64_t>(parts.size()), width}, table);
  b.num_prefill_seqs = num_prefill;
  if (rows.empty()) {
    for (int32_t r = 0; r < b.num_tokens(); ++r) b.logit_rows.push_back(r);
  } else {
    b.logit_rows = std::move(rows);
  }
  return b;
}

int32_t argmax(const std::vector<float>& logits, size_t row, int64_t V) {
  const float* p = logits.data() + row * static_cast<size_t>(V);
  return static_cast<int32_t>(std::max_element(p, p + V) - p);
}

// Every step's logits and the greedy tokens of two sequences: step 0 prefills A whole and B's first 6 tokens
// (every row's logits: the lm_head with norm_f folded in), step 1 runs B's remaining prompt after its cached
// prefix and A's first decode token (selected rows), then `decode_steps` decode steps of both, then a verify step.
struct Trace {
  std::vector<std::vector<float>> logits;
  std::vector<int32_t> tokens;
};
Trace run(Ranks& ranks, int decode_steps) {
  const int64_t V = ranks.models[0]->config().vocab_size;
  Seq a, b;
  a.tokens = {1, 17, 30, 42, 7, 99, 100, 5, 64};
  b.tokens = {1, 200, 3, 150, 8, 77, 21, 9, 250, 11, 40, 2, 128};
  for (int32_t& t : a.tokens) t %= static_cast<int32_t>(V);
  for (int32_t& t : b.tokens) t %= static_cast<int32_t>(V);
  a.slot = ranks.slot(a.blocks, 48);
  b.slot = ranks.slot(b.blocks, 48);
  Trace tr;
  const std::vector<int32_t> b0(b.tokens.begin(), b.tokens.begin() + 6), b1(b.tokens.begin() + 6, b.tokens.end());
  tr.logits.push_back(ranks.step(batch({{&a, a.tokens}, {&b, b0}}, 2, {})));
  if (tr.logits.back().empty()) return tr;
  int32_t next_a = argmax(tr.logits.back(), a.tokens.size() - 1, V);
  a.cached = static_cast<int32_t>(a.tokens.size());
  b.cached = 6;
  tr.tokens.push_back(next_a);
  const auto nb1 = static_cast<int32_t>(b1.size());
  tr.logits.push_back(ranks.step(batch({{&b, b1}, {&a, {next_a}}}, 1, {nb1 - 1, nb1})));
  if (tr.logits.back().empty()) return tr;
  int32_t next_b = argmax(tr.logits.back(), 0, V);
  next_a = argmax(tr.logits.back(), 1, V);
  a.cached += 1;
  b.cached = static_cast<int32_t>(b.tokens.size());
  for (int s = 0; s < decode_steps; ++s) {
    tr.tokens.push_back(next_a);
    tr.tokens.push_back(next_b);
    tr.logits.push_back(ranks.step(batch({{&a, {next_a}}, {&b, {next_b}}}, 0, {})));
    if (tr.logits.back().empty()) return tr;
    next_a = argmax(tr.logits.back(), 0, V);
    next_b = argmax(tr.logits.back(), 1, V);
    a.cached += 1;
    b.cached += 1;
  }
  tr.tokens.push_back(next_a);
  tr.tokens.push_back(next_b);
  // A speculative verify step (StepBatch::num_spec_seqs): A's next token and two drafts, its Mamba layers stepping
  // token by token out of place into three spare slots (the gated norm of each row on its own), and B's decode.
  StepBatch v = batch({{&a, {next_a, 5, 9}}, {&b, {next_b}}}, 1, {});
  v.num_spec_seqs = 1;
  for (int k = 0; k < 3; ++k) v.spec_slots.push_back(ranks.spare());
  tr.logits.push_back(ranks.step(v));
  return tr;
}

// Per row: max |got - ref| <= rel * max |ref|.
void expect_close(const std::vector<float>& got, const std::vector<float>& ref, int64_t V, const std::string& what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  double worst = 0.0;
  for (size_t r = 0; r * static_cast<size_t>(V) < ref.size(); ++r) {
    double max_ref = 0.0, max_err = 0.0;
    for (int64_t v = 0; v < V; ++v) {
      const size_t i = r * static_cast<size_t>(V) + static_cast<size_t>(v);
      max_ref = std::max(max_ref, std::fabs(static_cast<double>(ref[i])));
      max_err = std::max(max_err, std::fabs(static_cast<double>(got[i]) - ref[i]));
    }
    worst = std::max(worst, max_err / std::max(max_ref, 1e-30));
  }
  EXPECT_LE(worst, test::kTensorParallelLogitsRelToMax) << what << ": worst row's max|TP - TP1| / max|TP1|";
}

// The ranks' models of `make(options)` for tp.size = n (ep: the routed experts split by expert).
template <typename Make>
Ranks make_ranks(int n, bool mtp, Make make, bool ep = false) {
  Ranks ranks;
  for (int r = 0; r < n; ++r) {
    ModelOptions o;
    o.tp = {r, n, ep};
    ranks.models.push_back(std::make_unique<NemotronH>(make(o)));
  }
  ranks.attach(n, mtp);
  return ranks;
}

// A config splits over n ranks, or the reason it does not.
std::string unsplittable(const ModelConfig& c, int n, bool ep = false) {
  try {
    rank_config(c, {0, n, ep});
    return "";
  } catch (const Error& e) {
    return e.what();
  }
}

// ep: the routed experts split by expert (expert parallel) instead of by their intermediate dimension.
template <typename Make>
void compare_tp(const ModelConfig& c, int n, Make make, bool ep = false) {
  const std::string why = unsplittable(c, n, ep);
  if (!why.empty()) GTEST_SKIP() << "does not split over " << n << " ranks: " << why;
  Ranks one = make_ranks(1, false, make);
  Ranks many;
  try {
    many = make_ranks(n, false, make, ep);
  } catch (const Error& e) {
    // A quantized layout whose blocks a cut would split (NVFP4's 16 columns) is refused at load.
    if (e.kind() == ErrorKind::kInvalidInput && std::string(e.what()).find("tensor parallelism:") == 0) {
      GTEST_SKIP() << e.what();
    }
    throw;
  }
  const Trace ref = run(one, 4), got = run(many, 4);
  ASSERT_EQ(got.logits.size(), ref.logits.size());
  EXPECT_EQ(got.tokens, ref.tokens) << "greedy tokens, TP=" << n << " vs TP=1";
  for (size_t s = 0; s < ref.logits.size(); ++s) {
    expect_close(got.logits[s], ref.logits[s], c.vocab_size, "step " + std::to_string(s));
  }
}

// ---- the transformers fixtures ----
struct FixtureTp {
  std::string fixture;
  int size;
  bool ep = false;  // expert parallel
};
std::string tp_name(const FixtureTp& p) {
  std::string n = p.fixture;
  std::replace(n.begin(), n.end(), '-', '_');
  return n + (p.ep ? "_ep" : "_tp") + std::to_string(p.size);
}
class TensorParallelFixture : public ::testing::TestWithParam<FixtureTp> {};

TEST_P(TensorParallelFixture, SameTokensAndLogitsAsOneRank) {
  const test::Fixture f = test::load_fixture(GetParam().fixture);
  const ModelConfig c = load_model_config(f.dir);
  const Checkpoint ck = Checkpoint::open(f.dir);
  compare_tp(
      c, GetParam().size, [&](const ModelOptions& o) { return NemotronH::load(c, ck, o); }, GetParam().ep);
}

std::vector<FixtureTp> fixture_params() {
  std::vector<FixtureTp> p;
  for (const std::string& name : test::fixture_names()) {
    for (int n : {2, 4}) {
      p.push_back({name, n});
      p.push_back({name, n, /*ep=*/true});
    }
  }
  return p;
}
INSTANTIATE_TEST_SUITE_P(Fixtures, TensorParallelFixture, ::testing::ValuesIn(fixture_params()),
                         [](const ::testing::TestParamInfo<FixtureTp>& i) { return tp_name(i.param); });

// ---- ModelOpt-quantized checkpoints (FP8, NVFP4, mixed): their stored bytes and scales sliced ----
class TensorParallelQuantized : public ::testing::TestWithParam<FixtureTp> {};

TEST_P(TensorParallelQuantized, SameTokensAndLogitsAsOneRank) {
  const fs::path dir = fs::path(test::source_path("tests/fixtures/quant/models")) / GetParam().fixture;
  const ModelConfig c = load_model_config(dir);
  const Checkpoint ck = Checkpoint::open(dir);
  compare_tp(
      c, GetParam().size, [&](const ModelOptions& o) { return NemotronH::load(c, ck, o); }, GetParam().ep);
}

std::vector<FixtureTp> quant_params() {
  std::vector<FixtureTp> p;
  for (const char* name : {"all_kinds-fp8", "all_kinds-nvfp4", "all_kinds-mixed", "super_like-fp8", "super_like-nvfp4",
                           "super_like-mixed"}) {
    for (int n : {2, 4}) p.push_back({name, n});
    p.push_back({name, 2, /*ep=*/true});  // the per-expert scales cut with their experts
  }
  return p;
}
INSTANTIATE_TEST_SUITE_P(Fixtures, TensorParallelQuantized, ::testing::ValuesIn(quant_params()),
                         [](const ::testing::TestParamInfo<FixtureTp>& i) { return tp_name(i.param); });

// ---- synthetic models: the tiny preset (latent MoE; at TP = 4 replicated KV heads and a gated norm group spread
// over two ranks) and the same with one Mamba group (every rank's norm spans all of them at any TP) ----
class TensorParallelSynthetic : public ::testing::TestWithParam<int> {};

TEST_P(TensorParallelSynthetic, TinyPreset) {
  const ModelConfig c = model_preset("tiny");
  compare_tp(c, GetParam(), [&](const ModelOptions& o) { return NemotronH::synthetic(c, o, 5); });
}

TEST_P(TensorParallelSynthetic, OneMambaGroup) {
  ModelConfig c = model_preset("tiny");
  c.n_groups = 1;
  compare_tp(c, GetParam(), [&](const ModelOptions& o) { return NemotronH::synthetic(c, o, 6); });
}

TEST_P(TensorParallelSynthetic, Fp8WeightOnlyQuantizedAtLoad) {
  // Quantized before it is cut (per-tensor scale of the whole weight, replicated): the ranks hold exact slices.
  const ModelConfig c = model_preset("tiny");
  compare_tp(c, GetParam(), [&](ModelOptions o) {
    o.quantize = ops::WeightFormat::kFp8;
    o.weight_only = true;
    return NemotronH::synthetic(c, o, 7);
  });
}

TEST_P(TensorParallelSynthetic, Nvfp4QuantizedAtLoad) {
  // NVFP4 (weight-only): the packed bytes and 16-column block scales cut with their columns; the tiny preset's cuts
  // all fall on block boundaries at 2 and 4 ranks.
  const ModelConfig c = model_preset("tiny");
  compare_tp(c, GetParam(), [&](ModelOptions o) {
    o.quantize = ops::WeightFormat::kNvfp4;
    return NemotronH::synthetic(c, o, 8);
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, TensorParallelSynthetic, ::testing::Values(2, 4));

// Expert parallelism on the tiny preset (LatentMoE: the rank's experts' part of the sum is completed in the latent
// space) and FP8 weights (per-expert scales cut with their experts).
class ExpertParallelSynthetic : public ::testing::TestWithParam<int> {};

TEST_P(ExpertParallelSynthetic, TinyPreset) {
  const ModelConfig c = model_preset("tiny");
  compare_tp(
      c, GetParam(), [&](const ModelOptions& o) { return NemotronH::synthetic(c, o, 5); }, /*ep=*/true);
}

TEST_P(ExpertParallelSynthetic, Fp8WeightOnlyQuantizedAtLoad) {
  const ModelConfig c = model_preset("tiny");
  compare_tp(
      c, GetParam(),
      [&](ModelOptions o) {
        o.quantize = ops::WeightFormat::kFp8;
        o.weight_only = true;
        return NemotronH::synthetic(c, o, 7);
      },
      /*ep=*/true);
}

TEST_P(ExpertParallelSynthetic, RanksHoldTheirExpertsWhole) {
  const ModelConfig c = model_preset("tiny");
  const int n = GetParam();
  ModelOptions whole;
  const NemotronH one = NemotronH::synthetic(c, whole, 9);
  for (int r = 0; r < n; ++r) {
    ModelOptions o;
    o.tp = {r, n, /*expert_parallel=*/true};
    const NemotronH rank = NemotronH::synthetic(c, o, 9);
    for (size_t i = 0; i < c.layers.size(); ++i) {
      if (c.layers[i] != LayerKind::kMoe) continue;
      const ops::ExpertWeights& full = one.weights().layers[i].moe.experts_up;
      const ops::ExpertWeights& mine = rank.weights().layers[i].moe.experts_up;
      const int64_t E = full.num_experts(), per = E / n;
      ASSERT_EQ(mine.num_experts(), per) << "layer " << i << " rank " << r;
      ASSERT_EQ(mine.out_features(), full.out_features()) << "whole experts: the intermediate is not cut";
      for (int64_t e = 0; e < per; ++e) {
        const Tensor a = mine.weight.select(e), b = full.weight.select(r * per + e);
        EXPECT_EQ(std::memcmp(a.data(), b.data(), a.nbytes()), 0) << "layer " << i << " rank " << r << " expert " << e;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, ExpertParallelSynthetic, ::testing::Values(2, 4));

// The MTP head (sharded like the backbone, embeddings and lm_head vocabulary-parallel): the fixture's backbone
// over a sequence, then the head over the same rows, TP = 2 against TP = 1.
TEST(TensorParallel, MtpHeadMatchesOneRank) {
  const test::Fixture f = test::load_fixture("mtp");
  const ModelConfig c = load_model_config(f.dir);
  const Checkpoint ck = Checkpoint::open(f.dir);
  const auto make = [&](const ModelOptions& o) { return NemotronH::load(c, ck, o); };
  std::vector<std::vector<float>> out[2];
  const int sizes[2] = {1, 2};
  for (int i = 0; i < 2; ++i) {
    Ranks ranks = make_ranks(sizes[i], true, make);
    ASSERT_EQ(ranks.models[0]->mtp_blocks(), 1);
    Seq s;
    s.tokens = f.prompts[0];
    s.slot = ranks.slot(s.blocks, 48);
    Tensor hidden;
    out[i].push_back(ranks.step(batch({{&s, s.tokens}}, 1, {}), &hidden));
    // Row r of the head: the token after row r (teacher-forced from the prompt), the backbone's hidden at row r.
    std::vector<int32_t> next(s.tokens.begin() + 1, s.tokens.end());
    next.push_back(f.greedy[0][0]);
    out[i].push_back(ranks.step(batch({{&s, next}}, 1, {}), nullptr, 0, &hidden));
  }
  for (size_t k = 0; k < 2; ++k) expect_close(out[1][k], out[0][k], c.vocab_size, k == 0 ? "backbone" : "MTP head");
}

// A rank's weights are exactly its slices of the unsharded model's (synthetic: made whole, then cut).
TEST(TensorParallel, SyntheticShardsAreSlicesOfTheWholeWeights) {
  const ModelConfig c = model_preset("tiny");
  const NemotronH whole = NemotronH::synthetic(c, {}, 3);
  ModelOptions o;
  o.tp = {1, 2};
  const NemotronH r1 = NemotronH::synthetic(c, o, 3);
  const auto& W = whole.weights();
  const auto& R = r1.weights();
  // lm_head: rows [V/2, V).
  const Tensor& lw = W.lm_head.weight;
  const Tensor& lr = R.lm_head.weight;
  ASSERT_EQ(lr.shape(), (Shape{c.vocab_size / 2, c.hidden_size}));
  EXPECT_EQ(std::memcmp(lr.data(), lw.rows(c.vocab_size / 2, c.vocab_size).data(), lr.nbytes()), 0);
  // The first Mamba layer's A_log: heads [H/2, H); its in_proj's dt rows are the last H/2 of the rank's rows.
  const auto& mw = W.layers[0].mamba;
  const auto& mr = R.layers[0].mamba;
  ASSERT_EQ(mr.ssm.A_log.numel(), c.mamba_num_heads / 2);
  EXPECT_EQ(std::memcmp(mr.ssm.A_log.data(), mw.ssm.A_log.rows(c.mamba_num_heads / 2, c.mamba_num_heads).data(),
                        mr.ssm.A_log.nbytes()),
            0);
  const ModelConfig lc = r1.local_config();
  EXPECT_EQ(mr.in_proj.weight.dim(0), lc.in_proj_dim());
  const int64_t H = c.mamba_num_heads;
  const Tensor dt_whole = mw.in_proj.weight.rows(c.in_proj_dim() - H / 2, c.in_proj_dim());
  const Tensor dt_rank = mr.in_proj.weight.rows(lc.in_proj_dim() - H / 2, lc.in_proj_dim());
  EXPECT_EQ(std::memcmp(dt_rank.data(), dt_whole.data(), dt_rank.nbytes()), 0);
}

TEST(TensorParallel, RankConfigDividesHeadsAndReplicatesWhatRanksOutnumber) {
  const ModelConfig c = model_preset("tiny");  // Qh 4, KVh 2, H 8, G 2, V 4096
  const ModelConfig two = rank_config(c, {1, 2}), four = rank_config(c, {3, 4});
  EXPECT_EQ(two.num_attention_heads, 2);
  EXPECT_EQ(two.num_key_value_heads, 1);
  EXPECT_EQ(two.mamba_num_heads, 4);
  EXPECT_EQ(two.n_groups, 1);
  EXPECT_EQ(two.vocab_size, 2048);
  EXPECT_EQ(four.num_attention_heads, 1);
  EXPECT_EQ(four.num_key_value_heads, 1);  // replicated
  EXPECT_EQ(four.n_groups, 1);             // replicated
  EXPECT_EQ(four.mamba_num_heads, 2);
  EXPECT_EQ(four.moe_intermediate_size, c.moe_intermediate_size / 4);
  EXPECT_EQ(four.hidden_size, c.hidden_size);
  EXPECT_EQ(four.n_routed_experts, c.n_routed_experts);
  // Rank 3 of 4 holds heads 6, 7 of group 1: in_proj rows z, x of its heads, B / C of group 1, dt of its heads.
  const MambaShard ms = mamba_shard(c, {3, 4});
  const int64_t P = c.mamba_head_dim, N = c.ssm_state_size, Di = c.mamba_inner();
  EXPECT_EQ(ms.heads, (std::pair<int64_t, int64_t>{6, 8}));
  EXPECT_EQ(ms.in_proj[2], (std::pair<int64_t, int64_t>{2 * Di + N, 2 * Di + 2 * N}));
  EXPECT_EQ(ms.in_proj[0], (std::pair<int64_t, int64_t>{6 * P, 8 * P}));
}

TEST(TensorParallel, SizesThatDoNotSplitNameTheField) {
  const ModelConfig c = model_preset("tiny");
  auto message = [&](ModelConfig cfg, int n) {
    try {
      NemotronH::synthetic(cfg, ModelOptions{.tp = {0, n}}, 0);
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidInput);
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message(c, 3).find("vocab_size = 4096 is not divisible"), std::string::npos) << message(c, 3);
  ModelConfig heads = c;
  heads.vocab_size = 4098;  // divisible by 3
  EXPECT_NE(message(heads, 3).find("num_attention_heads"), std::string::npos) << message(heads, 3);
  ModelConfig kv = c;
  kv.num_key_value_heads = 3;
  kv.num_attention_heads = 6;
  EXPECT_NE(message(kv, 2).find("num_key_value_heads = 3"), std::string::npos) << message(kv, 2);
  // A forward without a communicator is a clear error, not a wrong answer.
  ModelOptions o;
  o.tp = {0, 2};
  const NemotronH m = NemotronH::synthetic(c, o, 0);
  StateCache cache(m.local_config(), CacheSizes{}, Device::kCpu, DType::kF32);
  Seq s;
  s.slot = cache.allocate_slot();
  ASSERT_TRUE(cache.reserve_blocks(s.blocks, 8));
  EXPECT_TRUE(test::throws_error([&] { m.forward(ops::Context{}, batch({{&s, {1, 2, 3}}}, 1, {}), cache.state()); },
                                 ErrorKind::kRuntime, "no communicator"));
}

// A rank that never joins ends the others' forward within the group's timeout, naming it.
TEST(TensorParallel, MissingRankTimesOut) {
  const ModelConfig c = model_preset("tiny");
  ModelOptions o;
  o.tp = {0, 2};
  NemotronH m = NemotronH::synthetic(c, o, 0);
  dist::HostGroup group(2, std::chrono::milliseconds(300));
  m.set_tensor_parallel_group(&group);
  StateCache cache(m.local_config(), CacheSizes{}, Device::kCpu, DType::kF32);
  Seq s;
  s.slot = cache.allocate_slot();
  ASSERT_TRUE(cache.reserve_blocks(s.blocks, 8));
  EXPECT_TRUE(test::throws_error([&] { m.forward(ops::Context{}, batch({{&s, {1, 2, 3}}}, 1, {}), cache.state()); },
                                 ErrorKind::kRuntime, "rank(s) 1 of 2 did not arrive within 300 ms"));
}

// --moe-split auto: by expert where the intermediate split leaves expert slices narrower than
// kMinExpertSliceColumns, or where only the experts divide; never for a model without routed experts.
TEST(ExpertParallelRule, SplitsByExpertWhereTheSlicesWouldBeNarrow) {
  const ModelConfig nano = model_preset("nemotron-3-nano-30b-a3b");   // 128 experts, 1856 columns
  const ModelConfig super = model_preset("nemotron-3-super-120b-a12b");  // 512 experts, 2688 columns
  EXPECT_FALSE(expert_parallel_by_rule(nano, 1));
  EXPECT_FALSE(expert_parallel_by_rule(nano, 2));  // 928 columns a rank
  EXPECT_TRUE(expert_parallel_by_rule(nano, 4));   // 464
  EXPECT_FALSE(expert_parallel_by_rule(super, 2));  // 1344
  EXPECT_TRUE(expert_parallel_by_rule(super, 4));   // 672
  ModelConfig c = nano;
  c.moe_intermediate_size = 1850;  // does not divide by 4, the 128 experts do
  EXPECT_TRUE(expert_parallel_by_rule(c, 4));
  c.n_routed_experts = 6;  // neither divides by 4: the intermediate split's own error names the field
  EXPECT_FALSE(expert_parallel_by_rule(c, 4));
  EXPECT_FALSE(expert_parallel_by_rule(model_preset("nemotron-h-8b"), 4));  // no routed experts
}

}  // namespace
}  // namespace chimera
