// Deterministic output: the same batch run twice, each time in a fresh engine (fresh caches, CUDA graphs captured
// anew, a fresh model load), gives the same logits bit for bit. The batch mixes prompts of different lengths, so the
// engine's steps mix prefill chunks with decodes (model_fixtures.h, run_batch_with), and runs greedy and seeded
// sampling. Kernel choices come from shapes only (the plan of docs/kernel_plan.md, no timing at run time) and every
// reduction has a fixed order, so nothing may differ. CPU (f32) and CUDA (f32 and bf16, with CUDA graphs; skipped
// without a GPU), on every bundled fixture model.
#include <cstring>
#include <string>
#include <tuple>

#include <fmt/core.h>
#include <gtest/gtest.h>

#include "backends/device_api.h"
#include "models/model_fixtures.h"

namespace chimera {
namespace {

using test::BatchOptions;
using test::BatchRun;
using test::load_fixture;
using test::load_model;

using Param = std::tuple<std::string, Device, DType>;

class Determinism : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override {
    if (std::get<1>(GetParam()) == Device::kCuda && !device::cuda_available()) {
      GTEST_SKIP() << device::describe_cuda();
    }
  }
  // One run in a fresh model and engine.
  BatchRun run_once(const test::Fixture& f, const std::vector<int32_t>& n_new, const SamplingParams& sampling) const {
    const auto [name, dev, dt] = GetParam();
    const test::LoadedFixture l = load_model(f.dir, ModelOptions{dev, dt});
    return test::run_batch_with(*l.model, f.prompts, n_new,
                                BatchOptions{.cuda_graphs = true, .keep_logits = true, .sampling = sampling});
  }
};

TEST_P(Determinism, SameBatchTwiceGivesTheSameLogitBits) {
  const auto [name, dev, dt] = GetParam();
  const test::Fixture f = load_fixture(name);
  ASSERT_GE(f.prompts.size(), 2u) << name;
  // Different continuation lengths: sequences finish at different steps, so the decode batch size changes.
  const auto longest = static_cast<int32_t>(5 * f.prompts.size() + 3);  // finish_apart: 5 fewer per prompt
  const std::vector<int32_t> n_new = test::finish_apart(std::vector<int32_t>(f.prompts.size(), longest));
  SamplingParams seeded;
  seeded.temperature = 0.8f;
  seeded.top_k = 20;
  seeded.top_p = 0.9f;
  seeded.seed = 1234;
  for (const SamplingParams& sp : {SamplingParams{}, seeded}) {
    SCOPED_TRACE(sp.temperature == 0.0f ? "greedy" : "seeded sampling");
    const BatchRun a = run_once(f, n_new, sp), b = run_once(f, n_new, sp);
    ASSERT_EQ(a.results.size(), b.results.size());
    EXPECT_EQ(a.graph_sizes, b.graph_sizes);
    for (size_t p = 0; p < a.results.size(); ++p) {
      SCOPED_TRACE(fmt::format("prompt {}", p));
      EXPECT_EQ(a.results[p].tokens, b.results[p].tokens);
      ASSERT_EQ(a.results[p].logits.size(), b.results[p].logits.size());
      ASSERT_FALSE(a.results[p].logits.empty());
      size_t first_diff = a.results[p].logits.size();
      for (size_t i = 0; i < a.results[p].logits.size(); ++i) {
        if (std::memcmp(&a.results[p].logits[i], &b.results[p].logits[i], sizeof(float)) != 0) {
          first_diff = i;
          break;
        }
      }
      EXPECT_EQ(first_diff, a.results[p].logits.size())
          << "logit " << first_diff << " differs: " << a.results[p].logits[first_diff] << " vs "
          << b.results[p].logits[first_diff];
    }
  }
}

std::vector<Param> params() {
  std::vector<Param> out;
  for (const std::string& name : test::fixture_names()) {
    out.emplace_back(name, Device::kCpu, DType::kF32);
    out.emplace_back(name, Device::kCuda, DType::kF32);
    out.emplace_back(name, Device::kCuda, DType::kBF16);
  }
  return out;
}

std::string param_name(const ::testing::TestParamInfo<Param>& info) {
  const std::string& name = std::get<0>(info.param);
  const Device dev = std::get<1>(info.param);
  const DType dt = std::get<2>(info.param);
  return name + (dev == Device::kCpu ? "_Cpu_" : "_Cuda_") + (dt == DType::kF32 ? "F32" : "BF16");
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Determinism, ::testing::ValuesIn(params()), param_name);

}  // namespace
}  // namespace chimera
