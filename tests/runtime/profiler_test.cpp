// The per-op profiler (runtime/profiler.h) behind `chimera bench --profile`: one body per backend.
//   * The bundled tiny model (every layer kind) runs one prefill step and one decode step through the Engine
//     with the profiler armed: every op kind that ran is reported with calls > 0, the mixers' calls equal the
//     layer pattern's counts, the per-op totals add up to the ops' sum, and sum <= span <= wall.
//   * An unarmed profiler records nothing; nested ops are timed but counted once in the sum.
// The CUDA instance (CUDA events on the stream) skips without a GPU.
#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "backends/device_api.h"
#include "common/compare.h"
#include "core/error.h"
#include "io/model_config.h"
#include "io/safetensors.h"
#include "models/nemotron_h.h"
#include "runtime/engine.h"
#include "runtime/profiler.h"

namespace chimera {
namespace {

class ProfilerTest : public ::testing::TestWithParam<Device> {
 protected:
  void SetUp() override {
    if (GetParam() == Device::kCuda && !device::cuda_available()) GTEST_SKIP() << device::describe_cuda();
  }
};

std::map<std::string, OpStat> by_op(const StepProfile& p) {
  std::map<std::string, OpStat> m;
  for (const OpStat& s : p.ops) {
    EXPECT_TRUE(m.emplace(s.op, s).second) << "op " << s.op << " reported twice";
  }
  return m;
}

// The invariants of any profile: rows sorted by total, calls > 0, times >= 0, the rows add up.
void expect_consistent(const StepProfile& p) {
  SCOPED_TRACE(p.name);
  int64_t calls = 0;
  double sum = 0;
  for (size_t i = 0; i < p.ops.size(); ++i) {
    const OpStat& s = p.ops[i];
    EXPECT_GT(s.calls, 0) << s.op;
    EXPECT_GE(s.total_ms, 0.0) << s.op;
    if (i > 0) {
      EXPECT_GE(p.ops[i - 1].total_ms, s.total_ms) << "rows not sorted at " << s.op;
    }
    calls += s.calls;
    sum += s.total_ms;
  }
  EXPECT_EQ(calls, p.calls);
  EXPECT_EQ(p.untimed_calls, 0);
  // No op nests another in the model, so the rows' sum is the ops' sum (up to rounding).
  EXPECT_NEAR(sum, p.ops_ms, 1e-9 + 1e-9 * sum);
  // The ops lie inside the span, the span inside the wall time (a little slack for the two clocks on CUDA).
  EXPECT_LE(p.ops_ms, p.span_ms * (1 + 1e-6) + 1e-3);
  EXPECT_LE(p.span_ms, p.wall_ms * (1 + 1e-6) + 1e-2);
  EXPECT_GT(p.wall_ms, 0.0);
  EXPECT_FALSE(format_profile(p).empty());
}

TEST_P(ProfilerTest, TinyModelPrefillAndDecodeStepsByOpKind) {
  const std::string dir = test::source_path("models/nemotron-h-tiny");
  const ModelConfig config = load_model_config(dir);
  const Checkpoint ckpt = Checkpoint::open(dir);
  const ModelOptions mo{GetParam(), GetParam() == Device::kCuda ? DType::kBF16 : DType::kF32};
  const NemotronH model = NemotronH::load(config, ckpt, mo);

  Profiler profiler(GetParam());
  EngineConfig ec;
  ec.cache.max_seqs = 2;
  ec.cache.max_model_len = 64;
  ec.scheduler.max_num_seqs = 2;
  ec.scheduler.max_num_batched_tokens = 64;
  ec.cuda_graphs = false;  // a replayed CUDA graph dispatches no op: profiled steps are eager
  Engine engine(model, ops::Context{GetParam(), nullptr, &profiler}, ec);
  SamplingParams sp;
  sp.max_new_tokens = 4;
  sp.ignore_eos = true;
  std::vector<int32_t> prompt(19);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>(3 + 7 * i) % 200;
  engine.add_request(prompt, sp);

  profiler.begin_step("prefill");
  EXPECT_TRUE(profiler.active());
  ASSERT_EQ(engine.step().size(), 1u);  // the whole prompt in one step, and its first token
  const StepProfile prefill = profiler.end_step();
  EXPECT_FALSE(profiler.active());

  profiler.begin_step("decode");
  ASSERT_EQ(engine.step().size(), 1u);
  const StepProfile decode = profiler.end_step();

  // An unarmed profiler records nothing: a step outside begin/end leaves the next profile empty.
  engine.step();
  profiler.begin_step("empty");
  const StepProfile empty = profiler.end_step();
  EXPECT_EQ(empty.calls, 0);
  EXPECT_TRUE(empty.ops.empty());

  expect_consistent(prefill);
  expect_consistent(decode);
  int64_t n_mamba = 0, n_attention = 0, n_moe = 0, n_mlp = 0;
  for (LayerKind k : config.layers) {
    n_mamba += k == LayerKind::kMamba;
    n_attention += k == LayerKind::kAttention;
    n_moe += k == LayerKind::kMoe;
    n_mlp += k == LayerKind::kMlp;
  }
  // Residual steps folded into the next layer's first dense op (not counting the last one, norm_f, which folds
  // into the lm_head when every row's logits are wanted: the decode step, not the 19-token prefill).
  int64_t n_folded = 0, n_moe_unfolded = 0;
  for (size_t i = 0; i + 1 < config.layers.size(); ++i) {
    const bool next_folds =
        config.layers[i + 1] == LayerKind::kMamba || config.layers[i + 1] == LayerKind::kAttention;
    n_folded += next_folds;
    n_moe_unfolded += config.layers[i] == LayerKind::kMoe && !next_folds;
  }
  const bool last_is_moe = config.layers.back() == LayerKind::kMoe;
  ASSERT_GT(n_mamba * n_attention * n_moe * n_mlp, 0) << "the tiny model should have every layer kind";

  const auto pre = by_op(prefill);
  const auto dec = by_op(decode);
  auto calls = [](const std::map<std::string, OpStat>& m, const std::string& op) -> int64_t {
    const auto it = m.find(op);
    return it == m.end() ? 0 : it->second.calls;
  };
  // One mixer op per layer of its kind; the prefill and decode Mamba paths are different ops.
  EXPECT_EQ(calls(pre, "causal_conv1d"), n_mamba);
  EXPECT_EQ(calls(pre, "ssd_chunk_scan"), n_mamba);
  EXPECT_EQ(calls(pre, "selective_state_update"), 0);
  // Decode: conv update + selective state update + gated norm, or on CUDA at small batch the fused op instead.
  const int64_t fused = calls(dec, "mamba_decode_update");
  EXPECT_TRUE(fused == 0 || fused == n_mamba) << fused;
  if (GetParam() == Device::kCpu) {
    EXPECT_EQ(fused, 0);
  }
  EXPECT_EQ(calls(dec, "causal_conv1d_update"), n_mamba - fused);
  EXPECT_EQ(calls(dec, "selective_state_update"), n_mamba - fused);
  EXPECT_EQ(calls(dec, "ssd_chunk_scan"), 0);
  for (const auto* m : {&pre, &dec}) {
    EXPECT_EQ(calls(*m, "attention"), n_attention);
    EXPECT_EQ(calls(*m, "moe_experts_shared"), n_moe);  // routed + shared expert in one op
    EXPECT_EQ(calls(*m, "moe_experts"), 0);
    // The router is one op from the layer's input (logits + top-k); the MoE layer's two outputs meet in the norm.
    EXPECT_EQ(calls(*m, "router_gate_topk"), n_moe);
    EXPECT_EQ(calls(*m, "router_topk"), 0);
    // One residual step per layer: folded into the next Mamba / attention layer's input projection, otherwise
    // one add + norm op (add2 after a MoE layer).
    const int64_t last_folded = m == &dec ? 1 : 0;
    EXPECT_EQ(calls(*m, "residual_norm_linear"), n_folded + last_folded);
    EXPECT_EQ(calls(*m, "add2_rms_norm"), n_moe_unfolded + (last_is_moe && last_folded == 0 ? 1 : 0));
    EXPECT_EQ(calls(*m, "add_rms_norm") + calls(*m, "add2_rms_norm") + calls(*m, "residual_norm_linear"),
              static_cast<int64_t>(config.layers.size()));
    EXPECT_EQ(calls(*m, "add"), 0);
    // In / out projections and the lm_head.
    EXPECT_GE(calls(*m, "linear") + calls(*m, "residual_norm_linear"), n_mamba + n_attention + 1);
    EXPECT_GE(calls(*m, "embedding"), 1);
  }
  std::printf("%s\n  %s\n%s\n  %s\n%s", GetParam() == Device::kCpu ? "[ CPU ]" : "[ CUDA ]", prefill.name.c_str(),
              format_profile(prefill, "    ").c_str(), decode.name.c_str(), format_profile(decode, "    ").c_str());
}

// Nested op brackets (not used by today's ops, allowed by the profiler): each op gets its row, only the outer
// one counts towards the sum. Uses the CPU clock.
TEST(Profiler, NestedOpsAreTimedButCountedOnceInTheSum) {
  Profiler p(Device::kCpu);
  p.begin_step("nested");
  {
    const ProfileScope outer(&p, "outer", nullptr);
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    const ProfileScope inner(&p, "inner", nullptr);
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  { const ProfileScope other(nullptr, "ignored: no profiler", nullptr); }
  const StepProfile s = p.end_step();
  const auto m = by_op(s);
  ASSERT_EQ(m.size(), 2u);
  EXPECT_EQ(m.at("outer").calls, 1);
  EXPECT_EQ(m.at("inner").calls, 1);
  EXPECT_GE(m.at("outer").total_ms, m.at("inner").total_ms);
  EXPECT_GE(m.at("inner").total_ms, 1.5);
  EXPECT_DOUBLE_EQ(s.ops_ms, m.at("outer").total_ms);
  EXPECT_EQ(s.ops.front().op, "outer");
  EXPECT_LE(s.span_ms, s.wall_ms);
}

TEST(Profiler, StepsMustBePaired) {
  Profiler p(Device::kCpu);
  EXPECT_THROW(p.end_step(), Error);
  p.begin_step("a");
  EXPECT_THROW(p.begin_step("b"), Error);
  EXPECT_NO_THROW(p.end_step());
}

std::string device_name(const ::testing::TestParamInfo<Device>& p) {
  return p.param == Device::kCpu ? "Cpu" : "Cuda";
}
INSTANTIATE_TEST_SUITE_P(, ProfilerTest, ::testing::Values(Device::kCpu, Device::kCuda), device_name);

}  // namespace
}  // namespace chimera
