// The scheduler is plain data in, plain data out: tested here without any model or tensor math.
#include "runtime/scheduler.h"

#include <gtest/gtest.h>

#include "core/error.h"

namespace chimera {
namespace {

ModelConfig tiny_config() {
  ModelConfig c;
  c.hidden_size = 8;
  c.layers = {LayerKind::kMamba, LayerKind::kAttention};
  c.mamba_num_heads = 2;
  c.mamba_head_dim = 2;
  c.ssm_state_size = 2;
  c.n_groups = 1;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 1;
  c.head_dim = 4;
  return c;
}

Sequence make_seq(int32_t id, int32_t prompt_len) {
  Sequence s;
  s.id = id;
  s.tokens.assign(static_cast<size_t>(prompt_len), 5);
  s.prompt_len = prompt_len;
  return s;
}

TEST(Scheduler, PrefillsThenDecodesWithinBudget) {
  StateCache cache(tiny_config(), CacheSizes{.max_seqs = 2, .max_model_len = 64, .block_size = 4});
  Scheduler sched(SchedulerConfig{.max_num_seqs = 2, .max_num_batched_tokens = 10}, cache);
  sched.add(make_seq(0, 7));
  sched.add(make_seq(1, 6));
  sched.add(make_seq(2, 3));

  SchedulerOutput a = sched.schedule();
  ASSERT_EQ(a.prefill.size(), 2u);  // budget 10: all 7 of seq 0, a 3-token chunk of seq 1
  EXPECT_EQ(a.prefill[0].seq_id, 0);
  EXPECT_EQ(a.prefill[0].num_tokens, 7);
  EXPECT_EQ(a.prefill[1].seq_id, 1);
  EXPECT_EQ(a.prefill[1].num_tokens, 3);
  EXPECT_TRUE(a.decode.empty());
  EXPECT_EQ(sched.num_waiting(), 1u);  // only two slots
  EXPECT_EQ(cache.free_slots(), 0);

  // The model would run here; emulate its update.
  sched.get(0).num_computed = 7;
  sched.get(0).tokens.push_back(9);
  sched.get(1).num_computed = 3;

  SchedulerOutput b = sched.schedule();
  ASSERT_EQ(b.decode.size(), 1u);
  EXPECT_EQ(b.decode[0].seq_id, 0);
  ASSERT_EQ(b.prefill.size(), 1u);
  EXPECT_EQ(b.prefill[0].seq_id, 1);
  EXPECT_EQ(b.prefill[0].num_tokens, 3);  // rest of its prompt

  // Finishing sequence 0 frees its slot and blocks for the waiting one.
  const int32_t blocks_before = cache.free_blocks();
  const int32_t slot0 = sched.get(0).slot;
  sched.get(0).finish = FinishReason::kStop;
  auto done = sched.collect_finished();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].id, 0);
  EXPECT_EQ(done[0].slot, -1);  // no longer owns it
  EXPECT_EQ(cache.free_slots(), 1);
  EXPECT_GT(cache.free_blocks(), blocks_before);
  sched.get(1).num_computed = 6;
  sched.get(1).tokens.push_back(9);
  SchedulerOutput c = sched.schedule();
  ASSERT_EQ(c.decode.size(), 1u);
  ASSERT_EQ(c.prefill.size(), 1u);
  EXPECT_EQ(c.prefill[0].seq_id, 2);
  EXPECT_EQ(sched.get(2).slot, slot0);  // the freed slot is reused
}

TEST(Scheduler, RejectsPromptsLongerThanTheModelLength) {
  StateCache cache(tiny_config(), CacheSizes{.max_seqs = 1, .max_model_len = 8, .block_size = 4});
  Scheduler sched(SchedulerConfig{}, cache);
  EXPECT_THROW(sched.add(make_seq(0, 9)), Error);
  EXPECT_THROW(sched.add(make_seq(1, 0)), Error);
}

TEST(StateCache, SlotsAreZeroedOnAllocation) {
  StateCache cache(tiny_config(), CacheSizes{.max_seqs = 2, .max_model_len = 16, .block_size = 4});
  const int32_t s = cache.allocate_slot();
  ASSERT_GE(s, 0);
  Tensor ssm = cache.state().ssm[0].select(s);
  ssm.fill_f32(3.0f);
  cache.release_slot(s);
  const int32_t again = cache.allocate_slot();
  ASSERT_EQ(again, s);
  for (int64_t i = 0; i < ssm.numel(); ++i) ASSERT_EQ(ssm.f32()[i], 0.0f);
  EXPECT_THROW(cache.release_slot(5), Error);
}

TEST(StateCache, BlocksAreBoundedPerSequenceAndPool) {
  StateCache cache(tiny_config(), CacheSizes{.max_seqs = 2, .max_model_len = 8, .block_size = 4});
  EXPECT_EQ(cache.free_blocks(), 4);
  std::vector<int32_t> a;
  EXPECT_TRUE(cache.reserve_blocks(a, 5));
  EXPECT_EQ(a.size(), 2u);
  EXPECT_FALSE(cache.reserve_blocks(a, 9));  // beyond max_model_len
  EXPECT_EQ(a.size(), 2u);
  cache.release_blocks(a);
  EXPECT_EQ(cache.free_blocks(), 4);
}

}  // namespace
}  // namespace chimera
