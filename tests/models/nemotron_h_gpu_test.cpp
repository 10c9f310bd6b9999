// Issue 4, first part: the same model code on the GPU (weights uploaded at load, device activations and
// caches). On every transformers fixture:
//   * fp32 on CUDA: the greedy continuations equal transformers' and every logits row is within
//     kGpuModelLogitsRelToMax of the reference (whole-prompt prefill + decode, and 7-token chunked prefill);
//     a batch of prompts (chunked prefill mixed with decodes) equals each prompt run alone on CUDA.
//   * bf16 on CUDA: the fixture sequence is teacher-forced (prompt prefill, then the reference continuation fed
//     one decode step at a time); top-1 agreement with the fp32 transformers logits over all positions must be
//     >= 90 % and every logit finite; the measured agreement is printed.
//   * bf16 on CUDA against transformers run in bf16 on the GPU (logits_bf16_<p>.npy, made by
//     `scripts/make_fixtures.py --bf16-logits-only`): the same teacher-forced positions, top-1 agreement >=
//     kGpuBf16Top1Agreement (99 %) over the robust positions of every fixture and over the
//     decidable ones (super_like: its own measured bound, tolerances.h), and the p90 over positions of
//     max|logit - ref| / max|ref| <= kGpuBf16LogitsRelToMax. Skips (does not fail) when a fixture has no bf16 files.
//   * decode with programmatic dependent launch off and on (eager and CUDA graphs): the same tokens and logits.
// Every test skips cleanly without a GPU (or in a build without CUDA).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>

#include <gtest/gtest.h>

#include "backends/device_api.h"
#include "common/tolerances.h"
#include "core/error.h"
#include "io/npy.h"
#include "models/model_fixtures.h"
#include "models/nemotron_h.h"
#include "runtime/engine.h"

namespace chimera {
namespace {

using namespace chimera::test;  // the fixture helpers

class GpuParity : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (!device::cuda_available()) GTEST_SKIP() << device::describe_cuda();
  }
};

// Feeds `tokens` through the model directly: tokens[0, prompt_len) as one prefill step, then the rest one
// decode step at a time (teacher forcing through the decode kernels). Returns host fp32 logits, one row per
// token, row i = logits after token i.
std::vector<float> teacher_forced(const NemotronH& model, const std::vector<int32_t>& tokens, size_t prompt_len) {
  const ops::Context ctx{model.device(), nullptr};
  CacheSizes sizes;
  sizes.max_seqs = 1;
  sizes.max_model_len = static_cast<int32_t>(tokens.size());
  sizes.block_size = 16;
  StateCache cache(model.config(), sizes, model.device(), model.activation_dtype());
  const int32_t slot = cache.allocate_slot();
  std::vector<int32_t> blocks;
  EXPECT_TRUE(cache.reserve_blocks(blocks, static_cast<int32_t>(tokens.size())));
  std::vector<float> logits;
  size_t done = 0;
  while (done < tokens.size()) {
    const size_t n = done == 0 ? prompt_len : 1;
    StepBatch b;
    b.token_ids.assign(tokens.begin() + static_cast<std::ptrdiff_t>(done),
                       tokens.begin() + static_cast<std::ptrdiff_t>(done + n));
    b.cu_seqlens = {0, static_cast<int32_t>(n)};
    b.context_lens = {static_cast<int32_t>(done)};
    b.state_slots = {slot};
    b.block_tables = Tensor::from_i32({1, static_cast<int64_t>(blocks.size())}, blocks);
    b.num_prefill_seqs = done == 0 ? 1 : 0;
    for (size_t r = 0; r < n; ++r) b.logit_rows.push_back(static_cast<int32_t>(r));
    const Tensor out = model.forward(ctx, b, cache.state());
    EXPECT_EQ(out.device(), Device::kCpu);
    logits.insert(logits.end(), out.f32(), out.f32() + out.numel());
    done += n;
  }
  return logits;
}

TEST_P(GpuParity, Fp32GreedyAndLogitsMatchTransformers) {
  const Fixture f = load_fixture(GetParam());
  LoadedFixture l = load_model(f.dir, ModelOptions{Device::kCuda, DType::kF32});
  ASSERT_EQ(l.model->activation_dtype(), DType::kF32);
  const int64_t V = l.config.vocab_size;
  double worst = 0.0;
  for (size_t p = 0; p < f.prompts.size(); ++p) {
    SCOPED_TRACE(fmt::format("{} prompt {} ({} tokens)", f.name, p, f.prompts[p].size()));
    const Tensor ref = read_npy(f.dir / fmt::format("logits_{}.npy", p));
    const auto n_new = static_cast<int32_t>(f.greedy[p].size());
    RunResult r = run_prompt(*l.model, f.prompts[p], n_new, 4096);
    EXPECT_EQ(r.tokens, f.greedy[p]);
    const int64_t rows = static_cast<int64_t>(f.prompts[p].size()) + n_new - 1;
    EXPECT_TRUE(logits_match(r.logits, ref, rows, V, kGpuModelLogitsRelToMax, &worst));
    // Chunked prefill (7 tokens per step): every chunk resumes from the device state the previous one left.
    RunResult c = run_prompt(*l.model, f.prompts[p], 8, 7);
    EXPECT_TRUE(std::equal(c.tokens.begin(), c.tokens.end(), f.greedy[p].begin()));
    EXPECT_TRUE(logits_match(c.logits, ref, static_cast<int64_t>(f.prompts[p].size()) + 7, V,
                             kGpuModelLogitsRelToMax, &worst));
  }
  std::printf("[ gpu fp32 ] %s: worst max|logit - ref| / max|ref| = %.2e (bound %.0e)\n", f.name.c_str(), worst,
              kGpuModelLogitsRelToMax);
}

TEST_P(GpuParity, Fp32BatchOfPromptsEqualsEachAlone) {
  const Fixture f = load_fixture(GetParam());
  LoadedFixture l = load_model(f.dir, ModelOptions{Device::kCuda, DType::kF32});
  const int64_t V = l.config.vocab_size;
  const std::vector<int32_t> n_new = finish_apart(f);
  const std::vector<RunResult> batch = run_batch(*l.model, f.prompts, n_new);
  ASSERT_EQ(batch.size(), f.prompts.size());
  for (size_t p = 0; p < f.prompts.size(); ++p) {
    SCOPED_TRACE(fmt::format("{} prompt {}", f.name, p));
    RunResult alone = run_prompt(*l.model, f.prompts[p], n_new[p], 4096);
    const std::vector<int32_t>& gen = batch[p].tokens;
    EXPECT_EQ(gen, alone.tokens);
    const int64_t rows = static_cast<int64_t>(f.prompts[p].size()) + static_cast<int64_t>(gen.size()) - 1;
    ASSERT_EQ(static_cast<int64_t>(alone.logits.size()), rows * V);
    const Tensor alone_t = Tensor::from_f32({rows, V}, alone.logits);
    EXPECT_TRUE(logits_match(batch[p].logits, alone_t, rows, V, kGpuModelLogitsRelToMax));
  }
}

TEST_P(GpuParity, Bf16TeacherForcedTop1AgreesWithTransformers) {
  const Fixture f = load_fixture(GetParam());
  LoadedFixture l = load_model(f.dir, ModelOptions{Device::kCuda, DType::kBF16});
  ASSERT_EQ(l.model->activation_dtype(), DType::kBF16);
  const int64_t V = l.config.vocab_size;
  int64_t agree = 0, total = 0;
  for (size_t p = 0; p < f.prompts.size(); ++p) {
    SCOPED_TRACE(fmt::format("{} prompt {}", f.name, p));
    const Tensor ref = read_npy(f.dir / fmt::format("logits_{}.npy", p));
    std::vector<int32_t> all = f.prompts[p];
    all.insert(all.end(), f.greedy[p].begin(), f.greedy[p].end() - 1);
    const std::vector<float> got = teacher_forced(*l.model, all, f.prompts[p].size());
    const auto rows = static_cast<int64_t>(all.size());
    ASSERT_EQ(static_cast<int64_t>(got.size()), rows * V);
    // The fixture holds one row more (after the last greedy token, never fed here).
    ASSERT_GE(ref.dim(0), rows);
    int64_t non_finite = 0;
    for (float v : got) non_finite += std::isfinite(v) ? 0 : 1;
    EXPECT_EQ(non_finite, 0);
    for (int64_t r = 0; r < rows; ++r) {
      const float* g = got.data() + r * V;
      const float* w = ref.f32() + r * V;
      agree += std::max_element(g, g + V) - g == std::max_element(w, w + V) - w;
      ++total;
    }
    // Free-running bf16 generation through the engine also runs (prefill + decode) and stays finite.
    RunResult gen = run_prompt(*l.model, f.prompts[p], 8, 4096);
    EXPECT_EQ(gen.tokens.size(), 8u);
    for (float v : gen.logits) ASSERT_TRUE(std::isfinite(v));
  }
  const double rate = static_cast<double>(agree) / static_cast<double>(total);
  std::printf("[ gpu bf16 ] %s: teacher-forced top-1 agreement with fp32 transformers %lld / %lld = %.2f %%\n",
              f.name.c_str(), static_cast<long long>(agree), static_cast<long long>(total), 100.0 * rate);
  EXPECT_GE(rate, 0.90);
}

// Two batch runs of the same prompts (b against a, prompt by prompt): the same tokens, and logits within the
// graph-vs-eager bound of activation dtype dt (the same kernels, at most their split plans differ).
void expect_same_runs(const BatchRun& a, const BatchRun& b, int64_t V, DType dt) {
  ASSERT_EQ(b.results.size(), a.results.size());
  for (size_t p = 0; p < a.results.size(); ++p) {
    SCOPED_TRACE(fmt::format("prompt {}", p));
    const RunResult& x = a.results[p];
    const RunResult& y = b.results[p];
    EXPECT_EQ(y.tokens, x.tokens);
    const int64_t rows = static_cast<int64_t>(x.logits.size()) / V;
    ASSERT_GT(rows, 0);
    ASSERT_EQ(y.logits.size(), x.logits.size());
    const Tensor ref = Tensor::from_f32({rows, V}, x.logits);
    EXPECT_TRUE(logits_match(y.logits, ref, rows, V,
                             dt == DType::kF32 ? kGpuModelLogitsRelToMax : kGpuBf16GraphVsEagerRelToMax));
  }
}

// CUDA-graph decode gives the same tokens as eager decode, and the same logits within the GPU model bound
// (graph-captured attention plans its KV splits for the longest context, eager for this step's: the sums
// differ in order only). fp32 and bf16; the graphs must actually have been used (batch sizes 3, 2, 1: buckets 4
// with a pad row, 2, 1).
TEST_P(GpuParity, CudaGraphDecodeEqualsEager) {
  const Fixture f = load_fixture(GetParam());
  const std::vector<int32_t> n_new = finish_apart(std::vector<int32_t>(f.prompts.size(), 24));
  for (DType dt : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(fmt::format("{} {}", f.name, dtype_name(dt)));
    LoadedFixture l = load_model(f.dir, ModelOptions{Device::kCuda, dt});
    const int64_t V = l.config.vocab_size;
    const BatchRun eager = run_batch_with(*l.model, f.prompts, n_new, BatchOptions{.cuda_graphs = false});
    const BatchRun graphed = run_batch_with(*l.model, f.prompts, n_new, BatchOptions{.cuda_graphs = true});
    EXPECT_TRUE(eager.graph_sizes.empty());
    EXPECT_EQ(eager.graph_steps, 0);
    EXPECT_EQ(graphed.graph_sizes, (std::vector<int32_t>{1, 2, 4}));  // captured at start-up for max_num_seqs 4
    EXPECT_GT(graphed.graph_steps, 0) << "the decode steps did not run as CUDA graphs";
    expect_same_runs(eager, graphed, V, dt);
  }
}

// Programmatic dependent launch (src/backends/cuda/launch.cuh) changes only when kernels may start, never what
// they compute: decode with PDL off and on, eager and as CUDA graphs (captured under each setting), gives the
// same tokens and logits within the graph-vs-eager bound (the same kernels and split plans, so in practice
// identical). A kernel that read its predecessor's output before pdl_wait() would break this.
TEST_P(GpuParity, PdlOnEqualsPdlOff) {
  const Fixture f = load_fixture(GetParam());
  const std::vector<int32_t> n_new = finish_apart(std::vector<int32_t>(f.prompts.size(), 24));
  for (DType dt : {DType::kF32, DType::kBF16}) {
    LoadedFixture l = load_model(f.dir, ModelOptions{Device::kCuda, dt});
    const int64_t V = l.config.vocab_size;
    for (bool graphs : {false, true}) {
      SCOPED_TRACE(fmt::format("{} {} {}", f.name, dtype_name(dt), graphs ? "graphs" : "eager"));
      ops::KernelConfig no_pdl;
      no_pdl.pdl = false;
      const BatchRun off =
          run_batch_with(*l.model, f.prompts, n_new, BatchOptions{.cuda_graphs = graphs, .kernels = no_pdl});
      const BatchRun on = run_batch_with(*l.model, f.prompts, n_new, BatchOptions{.cuda_graphs = graphs});
      EXPECT_EQ(on.graph_sizes, off.graph_sizes);
      if (graphs) {
        EXPECT_GT(on.graph_steps, 0) << "the decode steps did not run as CUDA graphs";
        EXPECT_EQ(on.graph_steps, off.graph_steps);
      }
      expect_same_runs(off, on, V, dt);
    }
  }
}

// Sampling on the GPU (only token ids come back) picks what the host sampler picks from the same logits:
// greedy, and seeded temperature / top-k / top-p sampling (the same counter-based uniform on both sides).
TEST_P(GpuParity, DeviceSamplingEqualsHostSampling) {
  const Fixture f = load_fixture(GetParam());
  LoadedFixture l = load_model(f.dir, ModelOptions{Device::kCuda, DType::kF32});
  const std::vector<int32_t> n_new = finish_apart(std::vector<int32_t>(f.prompts.size(), 16));
  SamplingParams sampled;
  sampled.temperature = 0.8f;
  sampled.top_k = 20;
  sampled.top_p = 0.9f;
  sampled.seed = 1234;
  for (const SamplingParams& sp : {SamplingParams{}, sampled}) {
    SCOPED_TRACE(fmt::format("temperature {}", sp.temperature));
    const BatchRun host = run_batch_with(*l.model, f.prompts, n_new, BatchOptions{.keep_logits = true, .sampling = sp});
    const BatchRun dev = run_batch_with(*l.model, f.prompts, n_new, BatchOptions{.keep_logits = false, .sampling = sp});
    for (size_t p = 0; p < f.prompts.size(); ++p) EXPECT_EQ(dev.results[p].tokens, host.results[p].tokens);
  }
}

// Against transformers' own bf16 run: the 99 % top-1 bar and a stated logit error bound.
TEST_P(GpuParity, Bf16TeacherForcedMatchesTransformersBf16) {
  const Fixture f = load_fixture(GetParam());
  if (const std::string missing = missing_bf16_reference(f); !missing.empty()) {
    GTEST_SKIP() << f.name << " has no " << missing
                 << " (make them with scripts/make_fixtures.py --bf16-logits-only on the GPU machine)";
  }
  LoadedFixture l = load_model(f.dir, ModelOptions{Device::kCuda, DType::kBF16});
  const int64_t V = l.config.vocab_size;
  // Top-1 over every position (printed) and over the decidable ones (asserted): where the reference's own
  // top-2 margin exceeds kGpuBf16TieMargin of its largest |logit|, i.e. more than about two bf16 steps at the
  // top logit's magnitude. Below that both runs' rounding noise decides the order (the bf16 reference logits
  // even tie exactly at some positions), so no bf16 implementation can be required to reproduce it.
  // The robust positions (also no router near-tie there, tolerances.h) are held to the bar on every fixture.
  Bf16Tally tally;
  for (size_t p = 0; p < f.prompts.size(); ++p) {
    SCOPED_TRACE(fmt::format("{} prompt {}", f.name, p));
    Bf16Reference ref;
    ASSERT_NO_FATAL_FAILURE(load_bf16_reference(f, l.config, p, ref));
    const std::vector<float> got = teacher_forced(*l.model, ref.tokens, f.prompts[p].size());
    ASSERT_EQ(static_cast<int64_t>(got.size()), ref.rows() * V);
    for (int64_t r = 0; r < ref.rows(); ++r) {
      const float* g = got.data() + r * V;
      ASSERT_TRUE(std::all_of(g, g + V, [](float v) { return std::isfinite(v); })) << "row " << r;
      const Top1Row c = compare_top1_row(g, ref.logits.f32() + r * V, V);
      const float rm = ref.router_margin[static_cast<size_t>(r)];
      tally.add(c, rm);
      if (c.top_got != c.top_ref) {
        std::printf("[ gpu bf16 ] %s prompt %zu row %lld: chimera top-1 %lld, transformers %lld; reference top-2 "
                    "margin %.4f = %.2e of max|logit|%s, router margin %.2e\n",
                    f.name.c_str(), p, static_cast<long long>(r), static_cast<long long>(c.top_got),
                    static_cast<long long>(c.top_ref), c.margin, c.margin / c.max_abs,
                    c.decidable ? " (decidable)" : " (near-tie)", static_cast<double>(rm));
      }
    }
  }
  std::printf("[ gpu bf16 ] %s vs transformers bf16: top-1 %lld / %lld = %.2f %% of all positions, %lld / %lld = "
              "%.2f %% of decidable ones, %lld / %lld = %.2f %% of robust ones (bar %.0f %%); max|logit - ref| / "
              "max|ref| per position: median %.3e, p90 %.3e, max %.3e (bound on p90 %.2g)\n",
              f.name.c_str(), static_cast<long long>(tally.agree), static_cast<long long>(tally.total),
              100.0 * Bf16Tally::rate(tally.agree, tally.total), static_cast<long long>(tally.agree_decidable),
              static_cast<long long>(tally.decidable), 100.0 * tally.rate_decidable(),
              static_cast<long long>(tally.agree_robust), static_cast<long long>(tally.robust),
              100.0 * tally.rate_robust(), 100.0 * kGpuBf16Top1Agreement, tally.percentile(0.5),
              tally.percentile(0.9), tally.percentile(1.0), kGpuBf16LogitsRelToMax);
  ASSERT_GT(tally.robust, 100);  // the measure means something only over many positions
  EXPECT_GE(tally.rate_robust(), kGpuBf16Top1Agreement);
  const bool super_like = f.name == "super_like";  // below the bar over all decidable positions: see tolerances.h
  EXPECT_GE(tally.rate_decidable(), super_like ? kGpuBf16Top1AgreementSuperLike : kGpuBf16Top1Agreement);
  EXPECT_LE(tally.percentile(0.9), super_like ? kGpuBf16LogitsRelToMaxSuperLike : kGpuBf16LogitsRelToMax);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, GpuParity, ::testing::ValuesIn(fixture_names()),
                         [](const auto& param_info) { return param_info.param; });

// The device caches: Mamba state and KV pools on the GPU in the requested dtypes, slots zeroed on allocation.
TEST(GpuStateCache, LivesOnTheDeviceInTheActivationDtype) {
  if (!device::cuda_available()) GTEST_SKIP() << device::describe_cuda();
  const ModelConfig config = load_model_config(source_path("models/nemotron-h-tiny"));
  CacheSizes sizes;
  sizes.max_seqs = 2;
  sizes.max_model_len = 64;
  StateCache cache(config, sizes, Device::kCuda, DType::kBF16);
  bool mamba = false, attention = false;
  for (size_t i = 0; i < config.layers.size(); ++i) {
    if (const Tensor& c = cache.state().conv[i]) {
      mamba = true;
      EXPECT_EQ(c.device(), Device::kCuda);
      EXPECT_EQ(c.dtype(), DType::kBF16);
      EXPECT_EQ(cache.state().ssm[i].dtype(), DType::kF32);
    }
    if (const Tensor& k = cache.state().kv[i].k) {
      attention = true;
      EXPECT_EQ(k.device(), Device::kCuda);
      EXPECT_EQ(k.dtype(), DType::kBF16);
    }
  }
  EXPECT_TRUE(mamba);
  EXPECT_TRUE(attention);
  // Dirty a slot's SSM state, release the slot, allocate it again: it must come back zeroed.
  const int32_t slot = cache.allocate_slot();
  for (const Tensor& ssm : cache.state().ssm) {
    if (!ssm) continue;
    const Tensor s = ssm.select(slot);
    device::copy(s, Tensor::from_f32(s.shape(), std::vector<float>(static_cast<size_t>(s.numel()), 1.0f)));
  }
  cache.release_slot(slot);
  EXPECT_EQ(cache.allocate_slot(), slot);
  for (size_t i = 0; i < config.layers.size(); ++i) {
    if (!cache.state().ssm[i]) continue;
    const Tensor h = device::to_host_f32(cache.state().ssm[i].select(slot));
    for (int64_t j = 0; j < h.numel(); ++j) ASSERT_EQ(h.f32()[j], 0.0f) << "layer " << i << " element " << j;
  }
}

}  // namespace
}  // namespace chimera
