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
  ASSERT_EQ(a.seqs.size(), 2u);  // budget 10: all 7 of seq 0, a 3-token chunk of seq 1
  EXPECT_EQ(a.seqs[0].seq_id, 0);
  EXPECT_EQ(a.seqs[0].num_tokens, 7);
  EXPECT_EQ(a.seqs[1].seq_id, 1);
  EXPECT_EQ(a.seqs[1].num_tokens, 3);
  EXPECT_EQ(sched.num_waiting(), 1u);  // only two slots
  EXPECT_EQ(cache.free_slots(), 0);

  // The model would run here; emulate its update.
  sched.get(0).num_computed = 7;
  sched.get(0).tokens.push_back(9);
  sched.get(1).num_computed = 3;

  SchedulerOutput b = sched.schedule();
  ASSERT_EQ(b.seqs.size(), 2u);
  EXPECT_EQ(b.seqs[0].seq_id, 0);  // the decode first
  EXPECT_EQ(b.seqs[0].num_tokens, 1);
  EXPECT_EQ(b.seqs[1].seq_id, 1);
  EXPECT_EQ(b.seqs[1].num_tokens, 3);  // rest of its prompt

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
  ASSERT_EQ(c.seqs.size(), 2u);
  EXPECT_EQ(c.seqs[0].seq_id, 1);
  EXPECT_EQ(c.seqs[0].num_tokens, 1);
  EXPECT_EQ(c.seqs[1].seq_id, 2);
  EXPECT_EQ(sched.get(2).slot, slot0);  // the freed slot is reused
}

// Emulates the model's update for the sequences of one step: their tokens are computed, and those that reached
// their end generate one token.
void run_step(Scheduler& sched, const SchedulerOutput& out) {
  for (const ScheduledSeq& p : out.seqs) {
    Sequence& s = sched.get(p.seq_id);
    s.num_computed += p.num_tokens;
    s.num_computed_max = std::max(s.num_computed_max, s.num_computed);
    if (s.num_pending() == 0) s.tokens.push_back(7);
  }
}

TEST(Scheduler, PreemptsTheMostRecentlyAdmittedWhenBlocksRunOut) {
  // 3 slots but 4 blocks of 4 tokens: 3 sequences of 4-token prompts take one block each. Their 5th token needs
  // a second block each: seq 0 takes the free one, seq 1 gets the block of seq 2, the youngest, preempted.
  StateCache cache(tiny_config(), CacheSizes{.max_seqs = 3, .max_model_len = 16, .block_size = 4, .num_blocks = 4});
  Scheduler sched(SchedulerConfig{.max_num_seqs = 3, .max_num_batched_tokens = 64}, cache);
  for (int32_t id = 0; id < 3; ++id) sched.add(make_seq(id, 4));
  SchedulerOutput a = sched.schedule();
  ASSERT_EQ(a.seqs.size(), 3u);
  EXPECT_EQ(cache.free_blocks(), 1);
  run_step(sched, a);  // each has 5 tokens now, 4 computed

  SchedulerOutput b = sched.schedule();
  EXPECT_EQ(b.preempted, (std::vector<int32_t>{2}));
  ASSERT_EQ(b.seqs.size(), 2u);
  EXPECT_EQ(b.seqs[0].seq_id, 0);
  EXPECT_EQ(b.seqs[1].seq_id, 1);
  EXPECT_EQ(sched.num_running(), 2u);
  EXPECT_EQ(sched.num_waiting(), 1u);
  EXPECT_EQ(sched.num_preemptions(), 1);
  // The preempted keeps its generated token, loses its cached state, and waits (not readmitted: no block).
  EXPECT_EQ(sched.get(2).num_computed, 0);
  EXPECT_EQ(sched.get(2).num_computed_max, 4);
  EXPECT_EQ(sched.get(2).tokens.size(), 5u);
  EXPECT_EQ(sched.get(2).slot, -1);
  EXPECT_TRUE(sched.get(2).blocks.empty());
  EXPECT_EQ(cache.free_slots(), 1);
  EXPECT_EQ(cache.free_blocks(), 0);
  run_step(sched, b);

  // When seq 0 finishes, seq 2 is readmitted and recomputes its 5 tokens (prompt + generated) in one step.
  sched.get(0).finish = FinishReason::kLength;
  EXPECT_EQ(sched.collect_finished().size(), 1u);
  SchedulerOutput c = sched.schedule();
  ASSERT_EQ(c.seqs.size(), 2u);
  EXPECT_EQ(c.seqs[0].seq_id, 1);
  EXPECT_EQ(c.seqs[0].num_tokens, 1);
  EXPECT_EQ(c.seqs[1].seq_id, 2);
  EXPECT_EQ(c.seqs[1].num_tokens, 5);
  EXPECT_TRUE(c.preempted.empty());
  run_step(sched, c);
  EXPECT_EQ(sched.get(2).tokens.size(), 6u);  // it generated its second token

  for (int32_t id : {1, 2}) sched.get(id).finish = FinishReason::kLength;
  EXPECT_EQ(sched.collect_finished().size(), 2u);
  EXPECT_EQ(cache.free_blocks(), 4);
  EXPECT_EQ(cache.free_slots(), 3);
}

TEST(Scheduler, TheYoungestPreemptsItselfWhenNothingYoungerHoldsBlocks) {
  // Seq 0 (5 tokens) and seq 1 (8 tokens) hold all 4 blocks; seq 1's 9th token needs a third block and it is
  // the youngest: it gives way, seq 0 goes on.
  StateCache cache(tiny_config(), CacheSizes{.max_seqs = 2, .max_model_len = 16, .block_size = 4, .num_blocks = 4});
  Scheduler sched(SchedulerConfig{.max_num_seqs = 2, .max_num_batched_tokens = 64}, cache);
  sched.add(make_seq(0, 5));
  sched.add(make_seq(1, 8));
  run_step(sched, sched.schedule());
  EXPECT_EQ(cache.free_blocks(), 0);
  const SchedulerOutput b = sched.schedule();
  EXPECT_EQ(b.preempted, (std::vector<int32_t>{1}));
  ASSERT_EQ(b.seqs.size(), 1u);
  EXPECT_EQ(b.seqs[0].seq_id, 0);
  EXPECT_EQ(cache.free_blocks(), 2);
  EXPECT_EQ(sched.num_waiting(), 1u);  // readmission needs 3 blocks for 9 tokens
}

TEST(Scheduler, BoundedWaitingQueueRefusesWithOverloaded) {
  StateCache cache(tiny_config(), CacheSizes{.max_seqs = 1, .max_model_len = 16, .block_size = 4});
  Scheduler sched(SchedulerConfig{.max_num_seqs = 1, .max_num_batched_tokens = 64, .max_waiting = 2}, cache);
  sched.add(make_seq(0, 3));
  sched.add(make_seq(1, 3));
  try {
    sched.add(make_seq(2, 3));
    ADD_FAILURE() << "a third waiting request was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kOverloaded);
  }
  sched.schedule();  // seq 0 admitted: room for one more
  EXPECT_NO_THROW(sched.add(make_seq(3, 3)));
  EXPECT_THROW(sched.add(make_seq(4, 3)), Error);
  EXPECT_THROW(Scheduler(SchedulerConfig{.max_waiting = -1}, cache), Error);
}

TEST(StateCache, RejectsAPoolSmallerThanOneSequence) {
  EXPECT_THROW(StateCache(tiny_config(), CacheSizes{.max_seqs = 2, .max_model_len = 16, .block_size = 4,
                                                    .num_blocks = 3}),
               Error);
  EXPECT_NO_THROW(StateCache(tiny_config(), CacheSizes{.max_seqs = 2, .max_model_len = 16, .block_size = 4,
                                                       .num_blocks = 4}));
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
