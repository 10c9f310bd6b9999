// The CPU backend on bf16 weights against transformers run in bf16 (the bf16 bar of tolerances.h, logits_bf16_<p>.npy made by
// `scripts/make_fixtures.py --bf16-logits-only` on the GPU). Each fixture's fp32 checkpoint is rewritten in bf16
// the way transformers' from_pretrained(dtype=bfloat16) rounds it (every tensor but the routers'
// e_score_correction_bias, which transformers keeps in fp32), then the CPU backend (fp32 math on those weights)
// runs prompt + reference continuation in one prefill, and its rows are measured exactly as the GPU test
// (nemotron_h_gpu_test.cpp) measures the CUDA bf16 engine: top-1 agreement over the decidable positions and the
// 90th percentile of max|logit - ref| / max|ref|. This separates what the bf16 weights do from what the GPU's
// bf16 activations do (scripts/bf16_divergence.py does the same split in transformers).
#include <algorithm>
#include <cmath>
#include <cstdio>

#include <gtest/gtest.h>

#include "backends/device_api.h"
#include "common/tolerances.h"
#include "core/error.h"
#include "io/io_test_util.h"
#include "io/npy.h"
#include "models/model_fixtures.h"

namespace chimera {
namespace {

using namespace chimera::test;  // the fixture helpers

// `src` with every float tensor rounded to bf16 except the correction biases, written to `dir` with config.json.
void write_bf16_checkpoint(const fs::path& src, const fs::path& dir) {
  const Checkpoint ckpt = Checkpoint::open(src);
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const std::string& name : ckpt.names()) {
    const Tensor t = ckpt.tensor(name);
    const bool keep = name.ends_with("e_score_correction_bias") || !dtype_is_float(t.dtype());
    tensors.emplace_back(name, keep ? t : device::to_device(t, Device::kCpu, DType::kBF16));
  }
  write_safetensors(dir / "model.safetensors", tensors);
  fs::copy_file(src / "config.json", dir / "config.json");
}

class CpuBf16Weights : public ::testing::TestWithParam<std::string> {};

TEST_P(CpuBf16Weights, MatchesTransformersBf16) {
  const Fixture f = load_fixture(GetParam());
  if (const std::string missing = missing_bf16_reference(f); !missing.empty()) {
    GTEST_SKIP() << f.name << " has no " << missing;
  }
  TempDir dir;
  write_bf16_checkpoint(f.dir, dir.path());
  LoadedFixture l = load_model(dir.path());
  const int64_t V = l.config.vocab_size;
  Bf16Tally tally;
  for (size_t p = 0; p < f.prompts.size(); ++p) {
    SCOPED_TRACE(fmt::format("{} prompt {}", f.name, p));
    Bf16Reference ref;
    ASSERT_NO_FATAL_FAILURE(load_bf16_reference(f, l.config, p, ref));
    // Teacher forcing as one prefill: fp32 math gives the same rows as prefill + decode (TransformersParity).
    const RunResult r = run_prompt(*l.model, ref.tokens, 1, 4096);
    ASSERT_GE(static_cast<int64_t>(r.logits.size()), ref.rows() * V);
    for (int64_t row = 0; row < ref.rows(); ++row) {
      const Top1Row c = compare_top1_row(r.logits.data() + row * V, ref.logits.f32() + row * V, V);
      const float rm = ref.router_margin[static_cast<size_t>(row)];
      tally.add(c, rm);
      if (c.decidable && c.top_got != c.top_ref) {
        std::printf("[ cpu bf16w ] %s prompt %zu row %lld: top-1 %lld, transformers bf16 %lld (margin %.2e of "
                    "max|logit|, router margin %.2e)\n",
                    f.name.c_str(), p, static_cast<long long>(row), static_cast<long long>(c.top_got),
                    static_cast<long long>(c.top_ref), c.margin / c.max_abs, static_cast<double>(rm));
      }
    }
  }
  const double p90 = tally.percentile(0.9);
  std::printf("[ cpu bf16w ] %s vs transformers bf16: top-1 %lld / %lld = %.2f %% of decidable positions, %lld / %lld "
              "= %.2f %% of robust ones (bar %.0f %%), max|logit - ref| / max|ref| p90 %.3e (bound %.2g), max %.3e\n",
              f.name.c_str(), static_cast<long long>(tally.agree_decidable), static_cast<long long>(tally.decidable),
              100.0 * tally.rate_decidable(), static_cast<long long>(tally.agree_robust),
              static_cast<long long>(tally.robust), 100.0 * tally.rate_robust(), 100.0 * kCpuBf16WeightsTop1Agreement,
              p90, kCpuBf16WeightsLogitsRelToMax, tally.percentile(1.0));
  ASSERT_GT(tally.robust, 100);  // the measure means something only over many positions
  EXPECT_GE(tally.rate_decidable(), kCpuBf16WeightsTop1Agreement);
  EXPECT_GE(tally.rate_robust(), kCpuBf16WeightsTop1Agreement);
  EXPECT_LE(p90, kCpuBf16WeightsLogitsRelToMax);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CpuBf16Weights, ::testing::ValuesIn(fixture_names()),
                         [](const auto& param_info) { return param_info.param; });

}  // namespace
}  // namespace chimera
