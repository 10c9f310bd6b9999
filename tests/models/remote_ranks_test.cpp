// Tensor-parallel ranks in other processes (models/remote_ranks.h): the step message round-trips, and an Engine on
// node 0 over a dist::HostGroup, its other rank in a second process, gives the bits of the in-process
// TensorParallelModel (HostGroup) while prefix caching zeroes and copies Mamba slots between steps (the state
// operations that must reach the other process's caches). Each node is a forked child that _exits with its verdict.
#include "models/remote_ranks.h"

#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "common/free_port.h"
#include "core/error.h"
#include "io/model_presets.h"
#include "models/tensor_parallel_model.h"
#include "runtime/engine.h"

namespace chimera {
namespace {

using Tokens = std::vector<int32_t>;

TEST(RemoteRanks, StepMessageRoundTrips) {
  RemoteStep step;
  step.call = RemoteCall::kMtpForward;
  step.ops = {{StateOp::kZeroSlot, 3, 0}, {StateOp::kCopySlot, 1, 5}};
  StepBatch& b = step.batch;
  b.token_ids = {7, 8, 9, 10};
  b.cu_seqlens = {0, 3, 4};
  b.context_lens = {0, 12};
  b.state_slots = {2, 0};
  b.block_tables = Tensor::from_i32({2, 3}, std::vector<int32_t>{1, 2, 3, 4, 5, 6});
  b.num_prefill_seqs = 1;
  b.mamba_checkpoints = {{0, 2, 9}};
  b.logit_rows = {2, 3};
  step.hidden = Tensor::from_f32({2, 2}, std::vector<float>{0.5f, -1.0f, 3.25f, 0.0f});
  step.block = 1;
  step.want_mtp_hidden = true;
  ModelState layout;
  layout.conv = {Tensor::zeros(DType::kF32, {4, 6, 3}), Tensor()};
  layout.ssm = {Tensor::zeros(DType::kBF16, {4, 2, 2, 8}), Tensor()};
  layout.kv = {ops::KvCacheView{}, ops::KvCacheView{Tensor::zeros(DType::kF32, {5, 8, 1, 4}),
                                                    Tensor::zeros(DType::kF32, {5, 8, 1, 4}), 1.0f, 1.0f}};
  const RemoteStep got = decode_remote_step(encode_remote_step(step, &layout));
  EXPECT_EQ(got.call, RemoteCall::kMtpForward);
  ASSERT_EQ(got.ops.size(), 2u);
  EXPECT_EQ(got.ops[1].kind, StateOp::kCopySlot);
  EXPECT_EQ(got.ops[1].dst, 1);
  EXPECT_EQ(got.ops[1].src, 5);
  EXPECT_EQ(got.batch.token_ids, b.token_ids);
  EXPECT_EQ(got.batch.cu_seqlens, b.cu_seqlens);
  EXPECT_EQ(got.batch.context_lens, b.context_lens);
  EXPECT_EQ(got.batch.state_slots, b.state_slots);
  ASSERT_EQ(got.batch.block_tables.shape(), b.block_tables.shape());
  EXPECT_EQ(std::memcmp(got.batch.block_tables.data(), b.block_tables.data(), 6 * sizeof(int32_t)), 0);
  EXPECT_EQ(got.batch.num_prefill_seqs, 1);
  ASSERT_EQ(got.batch.mamba_checkpoints.size(), 1u);
  EXPECT_EQ(got.batch.mamba_checkpoints[0].slot, 9);
  EXPECT_EQ(got.batch.logit_rows, b.logit_rows);
  ASSERT_EQ(got.hidden.shape(), step.hidden.shape());
  EXPECT_EQ(std::memcmp(got.hidden.data(), step.hidden.data(), 4 * sizeof(float)), 0);
  EXPECT_EQ(got.block, 1);
  EXPECT_TRUE(got.want_mtp_hidden);
  ASSERT_TRUE(got.has_layout);
  EXPECT_EQ(got.layout.conv[0].shape(), layout.conv[0].shape());
  EXPECT_EQ(got.layout.ssm[0].dtype(), DType::kBF16);
  EXPECT_FALSE(got.layout.conv[1]);
  EXPECT_FALSE(got.layout.kv[0].k);
  EXPECT_EQ(got.layout.kv[1].v.shape(), layout.kv[1].k.shape());
  // Without a layout (every step after the first), and cut short.
  const std::vector<std::byte> plain = encode_remote_step(step, nullptr);
  EXPECT_FALSE(decode_remote_step(plain).has_layout);
  EXPECT_THROW(decode_remote_step(std::span<const std::byte>(plain).first(plain.size() - 1)), Error);
}

Tokens random_tokens(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> d(1, 255);
  Tokens t(n);
  for (auto& v : t) v = d(rng);
  return t;
}

struct WavesResult {
  std::vector<Tokens> tokens;
  std::vector<std::vector<float>> logits;
  int64_t restores = 0;
};

// Two waves on one engine with prefix caching: the second's prompts share the first's (restores copy Mamba
// checkpoints into fresh slots), with more sequences than slots (slots are zeroed again and reused).
WavesResult run_waves(const Model& model) {
  EngineConfig ec;
  ec.cache.max_seqs = 2;
  ec.cache.max_model_len = 256;
  ec.cache.block_size = 8;
  ec.cache.prefix_caching = true;
  ec.cache.checkpoint_interval = 16;
  ec.cache.checkpoint_slots = 16;
  ec.scheduler.max_num_seqs = 2;
  ec.scheduler.max_num_batched_tokens = 24;
  Engine engine(model, ops::Context{Device::kCpu, nullptr}, ec);
  const Tokens shared = random_tokens(40, 1);
  std::vector<std::vector<Tokens>> waves = {{shared}, {}};
  for (uint64_t s = 0; s < 3; ++s) {
    Tokens p = shared;
    const Tokens tail = random_tokens(5 + 3 * s, 10 + s);
    p.insert(p.end(), tail.begin(), tail.end());
    waves[1].push_back(p);
  }
  std::map<int32_t, std::vector<float>> rows;
  engine.on_logits = [&rows](int32_t id, std::span<const float> row) {
    rows[id].insert(rows[id].end(), row.begin(), row.end());
  };
  SamplingParams sp;
  sp.max_new_tokens = 6;
  sp.ignore_eos = true;
  WavesResult r;
  for (const auto& wave : waves) {
    std::vector<int32_t> ids;
    for (const Tokens& p : wave) ids.push_back(engine.add_request(p, sp));
    while (engine.has_unfinished()) engine.step();
    std::map<int32_t, Tokens> by_id;
    for (Sequence& s : engine.take_finished()) by_id[s.id] = Tokens(s.tokens.begin() + s.prompt_len, s.tokens.end());
    for (int32_t id : ids) {
      r.tokens.push_back(by_id[id]);
      r.logits.push_back(rows[id]);
    }
  }
  engine.on_logits = nullptr;
  r.restores = engine.prefix_cache_stats().restores;
  return r;
}

TEST(RemoteRanks, EngineOverTwoProcessesGivesTheBitsOfThreads) {
  ModelConfig c = model_preset("tiny");
  const ModelOptions cpu{Device::kCpu, DType::kF32};
  auto make = [&](const ModelOptions& o) { return NemotronH::synthetic(c, o, 3); };
  WavesResult ref;
  {
    const auto threads = TensorParallelModel::create(2, cpu, make);
    ref = run_waves(*threads);
  }
  ASSERT_GT(ref.restores, 0);  // the run copies Mamba state between steps
  const int port = test::free_port();
  std::vector<pid_t> pids;
  for (int node = 0; node < 2; ++node) {
    const pid_t pid = ::fork();
    if (pid != 0) {
      pids.push_back(pid);
      continue;
    }
    ::alarm(60);  // a hung child dies instead of hanging the test
    int status = 0;
    try {
      std::vector<NemotronH> ranks = TensorParallelModel::make_ranks(2, node, 1, cpu, make);
      auto group = std::make_unique<dist::HostGroup>(2, 2, node, "127.0.0.1", port, std::chrono::seconds(20));
      if (node == 1) {
        run_remote_ranks(*group, ranks, ops::Context{Device::kCpu, nullptr});
      } else {
        WavesResult got;
        {
          TensorParallelModel model(std::move(ranks), std::move(group));
          got = run_waves(model);
        }
        if (got.tokens != ref.tokens) status = 3;
        if (got.logits != ref.logits) status = 4;  // bit-exact: the same sums in the same order
        if (got.restores != ref.restores) status = 5;
      }
    } catch (const std::exception& e) {
      fmt::print(stderr, "node {}: {}\n", node, e.what());
      status = 2;
    }
    ::_exit(status);
  }
  for (int node = 0; node < 2; ++node) {
    int status = 0;
    ::waitpid(pids[static_cast<size_t>(node)], &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "node " << node << " status " << status << " (3: tokens differ, 4: logits differ, 5: restores differ)";
  }
}

}  // namespace
}  // namespace chimera
