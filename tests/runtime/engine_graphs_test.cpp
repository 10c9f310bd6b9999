// CUDA graphs of the engine (EngineConfig::cuda_graphs): captured when the engine is built, one per padded
// batch-size bucket, and replayed for decode-only steps of any size up to the largest bucket with pad rows. The
// bundled tiny model (every layer kind) on each backend: the CPU instance has no graphs and checks that the same
// body gives the same results there; the CUDA instances (fp32, and bf16 for the tensor-core attention decode)
// skip without a GPU.
#include "runtime/engine.h"

#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <tuple>

#include <fmt/core.h>

#include "backends/device_api.h"
#include "models/model_fixtures.h"
#include "runtime/cache_sizing.h"

namespace chimera {
namespace {

using Param = std::tuple<Device, DType>;

class EngineGraphs : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override {
    if (device() == Device::kCuda && !device::cuda_available()) GTEST_SKIP() << device::describe_cuda();
    const std::string dir = test::source_path("models/nemotron-h-tiny");
    config_ = load_model_config(dir);
    ckpt_ = std::make_unique<Checkpoint>(Checkpoint::open(dir));
    model_ = std::make_unique<NemotronH>(NemotronH::load(config_, *ckpt_, ModelOptions{device(), dtype()}));
  }
  Device device() const { return std::get<0>(GetParam()); }
  DType dtype() const { return std::get<1>(GetParam()); }
  bool on_cuda() const { return device() == Device::kCuda; }

  // Buckets 1, 2, 4, 8, 16, 20: up to 7 pad rows (a batch of 9 replays 16).
  static constexpr int32_t kMaxSeqs = 20;
  static EngineConfig config(bool graphs) {
    EngineConfig ec;
    ec.cache.max_seqs = kMaxSeqs;
    ec.cache.max_model_len = 96;
    ec.cache.block_size = 8;
    ec.scheduler.max_num_seqs = kMaxSeqs;
    ec.scheduler.max_num_batched_tokens = 64;
    ec.cuda_graphs = graphs;
    return ec;
  }

  struct Run {
    std::vector<std::vector<int32_t>> tokens;  // per request, generated
    std::vector<std::vector<float>> logits;    // per request, one row per generated token (keep_logits)
    int64_t graph_steps = 0;
    std::vector<int32_t> graph_sizes;
  };
  // n greedy requests of different prompt lengths and different max_tokens: they finish at different steps, so
  // the decode batch shrinks through sizes that are no bucket. keep_logits: the rows come to the host (and are
  // sampled there); otherwise the GPU samples them.
  Run run(int32_t n, bool graphs, bool keep_logits) const {
    Engine engine(*model_, ops::Context{device(), nullptr}, config(graphs));
    Run r;
    r.tokens.resize(static_cast<size_t>(n));
    r.logits.resize(static_cast<size_t>(n));
    if (keep_logits) {
      engine.on_logits = [&](int32_t id, std::span<const float> row) {
        auto& out = r.logits[static_cast<size_t>(id)];
        out.insert(out.end(), row.begin(), row.end());
      };
    }
    for (int32_t i = 0; i < n; ++i) {
      const int32_t len = 5 + (i * 7) % 19;
      std::vector<int32_t> prompt;
      for (int32_t t = 0; t < len; ++t) prompt.push_back((i * 131 + t * 17 + 3) % 4000 + 5);
      SamplingParams sp;
      sp.max_new_tokens = 3 + (i * 5) % 13;
      sp.ignore_eos = true;
      EXPECT_EQ(engine.add_request(prompt, sp), i);  // ids are 0, 1, ...
    }
    while (engine.has_unfinished()) engine.step();
    for (Sequence& s : engine.take_finished()) {
      r.tokens[static_cast<size_t>(s.id)].assign(s.tokens.begin() + s.prompt_len, s.tokens.end());
    }
    r.graph_steps = engine.num_graph_steps();
    r.graph_sizes = engine.graph_batch_sizes();
    return r;
  }

  ModelConfig config_;
  std::unique_ptr<Checkpoint> ckpt_;
  std::unique_ptr<NemotronH> model_;
};

TEST_P(EngineGraphs, GraphsAreCapturedAtStartUpForEveryBucket) {
  const Engine engine(*model_, ops::Context{device(), nullptr}, config(true));
  if (!on_cuda()) {
    EXPECT_TRUE(engine.graph_batch_sizes().empty());
    EXPECT_EQ(engine.cache().sizes().num_pad, 0);
    EXPECT_EQ(format_graph_capture(engine), "");
    return;
  }
  EXPECT_EQ(engine.graph_batch_sizes(), cuda_graph_batch_sizes(kMaxSeqs));
  EXPECT_EQ(engine.graph_batch_sizes(), (std::vector<int32_t>{1, 2, 4, 8, 16, 20}));
  EXPECT_EQ(engine.cache().sizes().num_pad, 7);  // 16 - 8 - 1
  EXPECT_EQ(engine.num_total_slots(), kMaxSeqs);  // the scratch is not the sequences'
  EXPECT_EQ(engine.num_free_slots(), kMaxSeqs);
  EXPECT_EQ(engine.num_free_blocks(), engine.num_total_blocks());
  EXPECT_GT(engine.graph_capture_seconds(), 0.0);
  EXPECT_GT(engine.graph_pool_bytes(), 0u);
  EXPECT_EQ(engine.num_graph_steps(), 0);
  const std::string line = format_graph_capture(engine);
  EXPECT_NE(line.find("CUDA graphs: 6 decode batch sizes (1 to 20) captured in "), std::string::npos) << line;
  EXPECT_NE(line.find(" GiB"), std::string::npos) << line;

  const Engine eager(*model_, ops::Context{device(), nullptr}, config(false));
  EXPECT_TRUE(eager.graph_batch_sizes().empty());
  EXPECT_EQ(eager.cache().sizes().num_pad, 0);
  EXPECT_EQ(eager.graph_pool_bytes(), 0u);
}

// Batches of 3, 5 and 11 requests replay buckets 4, 8 and 16 with 1, 3 and 5 pad rows, then smaller ones as
// requests leave: the same greedy tokens as eager decode (with the rows on the host and sampled on the GPU), and
// the same logits within the graph-vs-eager bound (the captured attention plans its KV splits for the longest
// context, and a bucket's kernels may tile other than B rows' would).
TEST_P(EngineGraphs, PaddedBucketsGiveTheEagerTokensAndLogits) {
  const int64_t V = config_.vocab_size;
  const double bound = dtype() == DType::kF32 ? test::kGpuModelLogitsRelToMax : test::kGpuBf16GraphVsEagerRelToMax;
  for (int32_t n : {3, 5, 11}) {
    SCOPED_TRACE(fmt::format("{} requests", n));
    const Run eager = run(n, /*graphs=*/false, /*keep_logits=*/true);
    const Run graphed = run(n, /*graphs=*/true, /*keep_logits=*/true);
    const Run sampled_on_device = run(n, /*graphs=*/true, /*keep_logits=*/false);
    EXPECT_EQ(eager.graph_steps, 0);
    if (on_cuda()) {
      EXPECT_GT(graphed.graph_steps, 0) << "no decode step replayed a graph";
      EXPECT_EQ(sampled_on_device.graph_steps, graphed.graph_steps);
    }
    for (int32_t i = 0; i < n; ++i) {
      SCOPED_TRACE(fmt::format("request {}", i));
      const auto idx = static_cast<size_t>(i);
      EXPECT_EQ(eager.tokens[idx].size(), static_cast<size_t>(3 + (i * 5) % 13));
      EXPECT_EQ(graphed.tokens[idx], eager.tokens[idx]);
      EXPECT_EQ(sampled_on_device.tokens[idx], eager.tokens[idx]);
      const int64_t rows = static_cast<int64_t>(eager.logits[idx].size()) / V;
      ASSERT_EQ(rows, static_cast<int64_t>(eager.tokens[idx].size()));
      const Tensor ref = Tensor::from_f32({rows, V}, eager.logits[idx]);
      EXPECT_TRUE(test::logits_match(graphed.logits[idx], ref, rows, V, bound));
    }
  }
}

// Deterministic output with pad rows: two fresh engines (fresh caches and scratch, graphs captured anew) on the
// same batch of 5 (bucket 8, 3 pads, shrinking to buckets 4, 2, 1) give the same logits bit for bit.
TEST_P(EngineGraphs, TwoFreshEnginesGiveTheSameLogitBitsOnAPaddedBatch) {
  const Run a = run(5, /*graphs=*/true, /*keep_logits=*/true);
  const Run b = run(5, /*graphs=*/true, /*keep_logits=*/true);
  if (on_cuda()) {
    EXPECT_GT(a.graph_steps, 0);
  }
  EXPECT_EQ(a.graph_steps, b.graph_steps);
  EXPECT_EQ(a.graph_sizes, b.graph_sizes);
  for (size_t i = 0; i < a.tokens.size(); ++i) {
    SCOPED_TRACE(fmt::format("request {}", i));
    EXPECT_EQ(a.tokens[i], b.tokens[i]);
    ASSERT_EQ(a.logits[i].size(), b.logits[i].size());
    ASSERT_FALSE(a.logits[i].empty());
    EXPECT_EQ(std::memcmp(a.logits[i].data(), b.logits[i].data(), a.logits[i].size() * sizeof(float)), 0);
  }
}

std::string param_name(const ::testing::TestParamInfo<Param>& info) {
  return fmt::format("{}_{}", std::get<0>(info.param) == Device::kCpu ? "Cpu" : "Cuda",
                     std::get<1>(info.param) == DType::kF32 ? "F32" : "BF16");
}

INSTANTIATE_TEST_SUITE_P(, EngineGraphs,
                         ::testing::Values(Param{Device::kCpu, DType::kF32}, Param{Device::kCuda, DType::kF32},
                                           Param{Device::kCuda, DType::kBF16}),
                         param_name);

}  // namespace
}  // namespace chimera
