// StepBatch carries any number of new tokens per sequence: a step that mixes a fresh prompt, sequences with
// context carrying 3 new tokens (the multi-token kernels) and sequences with context carrying 1 (the
// single-token kernels) gives, row for row, the logits of feeding the same tokens one at a time, and leaves the
// same state behind. The bundled tiny model (Mamba, attention, MoE and MLP layers) on each backend.
#include "runtime/batch.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>

#include "common/backend_param.h"
#include "common/compare.h"
#include "common/tolerances.h"
#include "io/model_config.h"
#include "io/safetensors.h"
#include "models/nemotron_h.h"
#include "runtime/state_cache.h"

namespace chimera {
namespace {

struct SeqState {
  int32_t slot = -1;
  std::vector<int32_t> blocks;
  int32_t context = 0;
};

// One sequence's part of a step: its new tokens.
struct Part {
  SeqState* seq;
  std::vector<int32_t> tokens;
};

class StepBatchTest : public test::BackendTest {
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

  std::unique_ptr<StateCache> make_cache() const {
    return std::make_unique<StateCache>(config_, CacheSizes{.max_seqs = 4, .max_model_len = 64, .block_size = 4},
                                        GetParam(), model_->activation_dtype());
  }

  // Runs one step over `parts`, the first `num_multi` through the multi-token kernels; every row's logits
  // (host fp32, [rows, vocab]) in packed order. Advances each sequence's context.
  Tensor run(StateCache& cache, const std::vector<Part>& parts, int32_t num_multi) const {
    StepBatch b;
    b.num_prefill_seqs = num_multi;
    b.block_tables = Tensor::zeros(DType::kI32, {static_cast<int64_t>(parts.size()), cache.blocks_per_seq()});
    for (size_t i = 0; i < parts.size(); ++i) {
      SeqState& s = *parts[i].seq;
      const int32_t n = static_cast<int32_t>(parts[i].tokens.size());
      EXPECT_TRUE(cache.reserve_blocks(s.blocks, s.context + n));
      b.token_ids.insert(b.token_ids.end(), parts[i].tokens.begin(), parts[i].tokens.end());
      b.cu_seqlens.push_back(b.num_tokens());
      b.context_lens.push_back(s.context);
      b.state_slots.push_back(s.slot);
      std::copy(s.blocks.begin(), s.blocks.end(), b.block_tables.i32() + static_cast<int64_t>(i) * cache.blocks_per_seq());
      s.context += n;
    }
    for (int32_t r = 0; r < b.num_tokens(); ++r) b.logit_rows.push_back(r);
    return device::to_host_f32(model_->forward(ctx(), b, cache.state()));
  }

  // Feeds tokens one at a time (a fresh sequence's first token through the multi-token kernels, as the engine
  // routes it); the logits rows in order.
  std::vector<float> one_at_a_time(StateCache& cache, SeqState& s, const std::vector<int32_t>& tokens) const {
    std::vector<float> rows;
    for (int32_t t : tokens) {
      const Tensor l = run(cache, {Part{&s, {t}}}, s.context == 0 ? 1 : 0);
      rows.insert(rows.end(), l.f32(), l.f32() + l.numel());
    }
    return rows;
  }

  static std::vector<int32_t> tokens(int32_t len, int32_t salt) {
    std::vector<int32_t> t(static_cast<size_t>(len));
    for (int32_t i = 0; i < len; ++i) t[static_cast<size_t>(i)] = (salt * 389 + i * 23 + 11) % 4000 + 3;
    return t;
  }

  // max |got - want| over rows [row0, row0 + n) of `got` against `want`, relative to max |want|.
  double rel_err(const Tensor& got, int64_t row0, const std::vector<float>& want) const {
    const int64_t V = config_.vocab_size;
    EXPECT_EQ(want.size() % static_cast<size_t>(V), 0u);
    double worst = 0, scale = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      worst = std::max(worst, static_cast<double>(std::abs(got.f32()[row0 * V + static_cast<int64_t>(i)] - want[i])));
      scale = std::max(scale, static_cast<double>(std::abs(want[i])));
    }
    return worst / scale;
  }
  double bound() const { return on_cuda() ? test::kGpuModelLogitsRelToMax : test::kModelLogitsRelToMax; }

  ModelConfig config_;
  std::unique_ptr<Checkpoint> ckpt_;
  std::unique_ptr<NemotronH> model_;
};

TEST_P(StepBatchTest, MixedOneAndThreeNewTokensEqualOneTokenAtATime) {
  // Sequences a, b, c have contexts of 13, 6 and 9 tokens (prefilled alike in both caches); d is fresh.
  const auto pa = tokens(13, 1), pb = tokens(6, 2), pc = tokens(9, 3);
  const auto na = tokens(3, 4), nb = tokens(1, 5), nc = tokens(3, 6), nd = tokens(5, 7);
  auto mixed_cache = make_cache(), ref_cache = make_cache();
  SeqState ma, mb, mc, md, ra, rb, rc, rd;
  for (SeqState* s : {&ma, &mb, &mc, &md}) s->slot = mixed_cache->allocate_slot();
  for (SeqState* s : {&ra, &rb, &rc, &rd}) s->slot = ref_cache->allocate_slot();
  run(*mixed_cache, {{&ma, pa}, {&mb, pb}, {&mc, pc}}, 3);
  run(*ref_cache, {{&ra, pa}, {&rb, pb}, {&rc, pc}}, 3);

  // One step: d's 5-token prompt, a and c with 3 new tokens each (multi-token kernels), b with 1 (single-token).
  const Tensor mixed = run(*mixed_cache, {{&md, nd}, {&ma, na}, {&mc, nc}, {&mb, nb}}, 3);
  ASSERT_EQ(mixed.dim(0), 5 + 3 + 3 + 1);
  const std::vector<float> want_d = one_at_a_time(*ref_cache, rd, nd);
  const std::vector<float> want_a = one_at_a_time(*ref_cache, ra, na);
  const std::vector<float> want_c = one_at_a_time(*ref_cache, rc, nc);
  const std::vector<float> want_b = one_at_a_time(*ref_cache, rb, nb);
  EXPECT_LE(rel_err(mixed, 0, want_d), bound());
  EXPECT_LE(rel_err(mixed, 5, want_a), bound());
  EXPECT_LE(rel_err(mixed, 8, want_c), bound());
  EXPECT_LE(rel_err(mixed, 11, want_b), bound());

  // The state each left behind (Mamba conv + SSM, KV) is the same: one more decode step of all four agrees.
  const std::vector<int32_t> next = {17, 29, 31, 37};
  const Tensor after = run(*mixed_cache, {{&ma, {next[0]}}, {&mb, {next[1]}}, {&mc, {next[2]}}, {&md, {next[3]}}}, 0);
  const Tensor ref_after = run(*ref_cache, {{&ra, {next[0]}}, {&rb, {next[1]}}, {&rc, {next[2]}}, {&rd, {next[3]}}}, 0);
  const std::vector<float> ref_rows(ref_after.f32(), ref_after.f32() + ref_after.numel());
  EXPECT_LE(rel_err(after, 0, ref_rows), bound());
}

TEST_P(StepBatchTest, SingleTokenGroupRejectsSeveralTokens) {
  auto cache = make_cache();
  SeqState s;
  s.slot = cache->allocate_slot();
  run(*cache, {{&s, tokens(4, 1)}}, 1);
  // Three new tokens in the single-token group: validate() refuses before any kernel runs.
  EXPECT_THROW(run(*cache, {{&s, tokens(3, 2)}}, 0), Error);
}

CHIMERA_INSTANTIATE_BACKENDS(StepBatchTest);

// A step of a prompt chunk (3 rows), two verify sequences of 3 and 2 rows, and a decode row.
StepBatch verify_batch() {
  StepBatch b;
  b.token_ids = {1, 2, 3, 10, 11, 12, 20, 21, 30};
  b.cu_seqlens = {0, 3, 6, 8, 9};
  b.context_lens = {0, 5, 7, 4};
  b.state_slots = {0, 1, 2, 3};
  b.spec_slots = {11, 12, 13, 21, 22};
  b.num_prefill_seqs = 3;
  b.num_spec_seqs = 2;
  b.block_tables = Tensor::zeros(DType::kI32, {4, 2});
  return b;
}

// Step j of the verify plan is row j of every verify sequence that long, longest first; each row reads the slot the
// row before it wrote (row 0: the sequence's own) and writes its own spec slot.
TEST(SpecPlan, StepMajorRowsWithTheirSlotsAndPositions) {
  const SpecPlan p = spec_plan(verify_batch());
  EXPECT_EQ(p.gather, (std::vector<int32_t>{3, 6, 4, 7, 5}));
  EXPECT_EQ(p.step_begin, (std::vector<size_t>{0, 2, 4, 5}));
  EXPECT_EQ(p.src, (std::vector<int32_t>{1, 2, 11, 21, 12}));
  EXPECT_EQ(p.dst, (std::vector<int32_t>{11, 21, 12, 22, 13}));
  EXPECT_EQ(p.pos, (std::vector<int32_t>{5, 7, 6, 8, 7}));
  // scatter inverts gather over the verify rows (rows 3..7, from the first one).
  ASSERT_EQ(p.scatter.size(), 5u);
  for (size_t k = 0; k < p.gather.size(); ++k) {
    EXPECT_EQ(p.scatter[static_cast<size_t>(p.gather[k] - 3)], static_cast<int32_t>(k));
  }
  EXPECT_TRUE(spec_plan(StepBatch{}).gather.empty());
}

// The attention sees each verify row as a one-token row at its position, on its sequence's table; the others as
// they are.
TEST(AttentionRows, VerifyRowsBecomeSingleTokenRows) {
  const AttentionRows a = attention_rows(verify_batch());
  EXPECT_EQ(a.cu_seqlens, (std::vector<int32_t>{0, 3, 4, 5, 6, 7, 8, 9}));
  EXPECT_EQ(a.context_lens, (std::vector<int32_t>{0, 5, 6, 7, 7, 8, 4}));
  EXPECT_EQ(a.table_rows, (std::vector<int32_t>{0, 1, 1, 1, 2, 2, 3}));
}

}  // namespace
}  // namespace chimera
