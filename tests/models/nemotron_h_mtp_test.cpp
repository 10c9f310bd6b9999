// The MTP head (mtp.*) against its PyTorch reference (scripts/make_mtp_fixture.py: transformers' NemotronHBlock
// sublayers behind an eh_proj over concat[enorm(e_{t+1}), hnorm(h_t)]), on the CPU and on CUDA in fp32:
//   * the head over a whole sequence in one step (its prefill, as the engine runs it after the prompt) and the
//     head one position at a time behind the backbone's decode steps (its KV cache read back), both teacher-forced
//     on prompt + greedy, every row within the fixtures' fp32 logits bound;
//   * loading: the head's tensors are checked like the backbone's, a Mamba sublayer in the head's pattern and a
//     state without the head's caches are clear errors.
#include <algorithm>
#include <cstdio>

#include <gtest/gtest.h>

#include "backends/device_api.h"
#include "common/backend_param.h"
#include "common/tolerances.h"
#include "core/error.h"
#include "io/npy.h"
#include "models/model_fixtures.h"
#include "models/nemotron_h.h"
#include "runtime/state_cache.h"

namespace chimera {
namespace {

using namespace chimera::test;  // the fixture helpers

constexpr const char* kFixture = "mtp";

class MtpHead : public BackendTest {
 protected:
  double bound() const { return on_cuda() ? kGpuModelLogitsRelToMax : kModelLogitsRelToMax; }
  LoadedFixture load(const Fixture& f) const { return load_model(f.dir, ModelOptions{GetParam(), DType::kF32}); }
};

// One sequence's caches for the backbone and the head (CacheSizes::mtp).
struct SeqCache {
  StateCache cache;
  int32_t slot = -1;
  std::vector<int32_t> blocks;
  SeqCache(const NemotronH& m, int32_t tokens) : cache(m.config(), sizes(tokens), m.device(), m.activation_dtype()) {
    slot = cache.allocate_slot();
    EXPECT_TRUE(cache.reserve_blocks(blocks, tokens));
  }
  static CacheSizes sizes(int32_t tokens) {
    CacheSizes s;
    s.max_seqs = 1;
    s.max_model_len = tokens;
    s.block_size = 16;
    s.mtp = true;
    return s;
  }
  // A step over `tokens` at positions [context, context + tokens.size()), logits for every row.
  StepBatch step(std::vector<int32_t> tokens, int32_t context) const {
    StepBatch b;
    const auto n = static_cast<int32_t>(tokens.size());
    b.token_ids = std::move(tokens);
    b.cu_seqlens = {0, n};
    b.context_lens = {context};
    b.state_slots = {slot};
    b.block_tables = Tensor::from_i32({1, static_cast<int64_t>(blocks.size())}, blocks);
    b.num_prefill_seqs = n == 1 && context > 0 ? 0 : 1;
    for (int32_t r = 0; r < n; ++r) b.logit_rows.push_back(r);
    return b;
  }
};

std::vector<float> host_rows(const Tensor& logits) {
  const Tensor h = logits.device() == Device::kCpu ? logits : device::to_host_f32(logits);
  return std::vector<float>(h.f32(), h.f32() + h.numel());
}

std::vector<int32_t> sequence(const Fixture& f, size_t p) {
  std::vector<int32_t> seq = f.prompts[p];
  seq.insert(seq.end(), f.greedy[p].begin(), f.greedy[p].end());
  return seq;
}

// The whole sequence through the backbone in one step, then the head over rows 0 .. L-2 in one step.
TEST_P(MtpHead, OneStepOverTheSequenceMatchesTheReference) {
  const Fixture f = load_fixture(kFixture);
  LoadedFixture l = load(f);
  ASSERT_EQ(l.model->mtp_blocks(), 1);
  const int64_t V = l.config.vocab_size;
  double worst = 0.0;
  for (size_t p = 0; p < f.prompts.size(); ++p) {
    SCOPED_TRACE(fmt::format("prompt {}", p));
    const std::vector<int32_t> seq = sequence(f, p);
    const auto L = static_cast<int32_t>(seq.size());
    SeqCache c(*l.model, L);
    Tensor hidden;
    const Tensor logits = l.model->forward_device(ctx(), c.step(seq, 0), c.cache.state(), hidden);
    EXPECT_TRUE(logits_match(host_rows(logits), read_npy(f.dir / fmt::format("logits_{}.npy", p)), L, V, bound()));
    ASSERT_EQ(hidden.shape(), (Shape{L, l.config.hidden_size}));
    Tensor mtp_hidden;
    const Tensor mtp = l.model->mtp_forward_device(ctx(), c.step({seq.begin() + 1, seq.end()}, 0),
                                                   hidden.rows(0, L - 1), c.cache.state(), 0, &mtp_hidden);
    EXPECT_EQ(mtp_hidden.shape(), (Shape{L - 1, l.config.hidden_size}));
    EXPECT_TRUE(
        logits_match(host_rows(mtp), read_npy(f.dir / fmt::format("mtp_logits_{}.npy", p)), L - 1, V, bound(), &worst));
  }
  std::printf("[ mtp ] one step: worst max|logit - ref| / max|ref| = %.2e (bound %.0e)\n", worst, bound());
}

// The prompt as one prefill (the head over its rows but the last), then one token at a time: each backbone decode
// step at position t gives h_t, and the head's decode step at t - 1 (h_{t-1}, token t) reads its own KV cache.
TEST_P(MtpHead, DecodeStepsBehindTheBackboneMatchTheReference) {
  const Fixture f = load_fixture(kFixture);
  LoadedFixture l = load(f);
  const int64_t V = l.config.vocab_size;
  double worst = 0.0;
  for (size_t p = 0; p < f.prompts.size(); ++p) {
    SCOPED_TRACE(fmt::format("prompt {}", p));
    const std::vector<int32_t> seq = sequence(f, p);
    const auto L = static_cast<int32_t>(seq.size()), n = static_cast<int32_t>(f.prompts[p].size());
    SeqCache c(*l.model, L);
    Tensor hidden;
    l.model->forward_device(ctx(), c.step({seq.begin(), seq.begin() + n}, 0), c.cache.state(), hidden);
    std::vector<float> got;
    if (n > 1) {
      const Tensor mtp = l.model->mtp_forward_device(ctx(), c.step({seq.begin() + 1, seq.begin() + n}, 0),
                                                     hidden.rows(0, n - 1), c.cache.state(), 0);
      got = host_rows(mtp);
    }
    Tensor last = hidden.rows(n - 1, n);  // h_{t-1} for the next head step
    for (int32_t t = n; t < L; ++t) {
      Tensor h;
      l.model->forward_device(ctx(), c.step({seq[static_cast<size_t>(t)]}, t), c.cache.state(), h);
      const Tensor mtp =
          l.model->mtp_forward_device(ctx(), c.step({seq[static_cast<size_t>(t)]}, t - 1), last, c.cache.state(), 0);
      const std::vector<float> row = host_rows(mtp);
      got.insert(got.end(), row.begin(), row.end());
      last = h;
    }
    EXPECT_TRUE(logits_match(got, read_npy(f.dir / fmt::format("mtp_logits_{}.npy", p)), L - 1, V, bound(), &worst));
  }
  std::printf("[ mtp ] step by step: worst max|logit - ref| / max|ref| = %.2e (bound %.0e)\n", worst, bound());
}

TEST_P(MtpHead, AStateWithoutTheHeadsCachesIsAnError) {
  const Fixture f = load_fixture(kFixture);
  LoadedFixture l = load(f);
  CacheSizes s = SeqCache::sizes(16);
  s.mtp = false;
  StateCache cache(l.config, s, GetParam(), l.model->activation_dtype());
  const int32_t slot = cache.allocate_slot();
  std::vector<int32_t> blocks;
  ASSERT_TRUE(cache.reserve_blocks(blocks, 4));
  StepBatch b;
  b.token_ids = {5, 6, 7};
  b.cu_seqlens = {0, 3};
  b.context_lens = {0};
  b.state_slots = {slot};
  b.block_tables = Tensor::from_i32({1, static_cast<int64_t>(blocks.size())}, blocks);
  b.num_prefill_seqs = 1;
  b.logit_rows = {2};
  Tensor hidden;
  l.model->forward_device(ctx(), b, cache.state(), hidden);
  EXPECT_TRUE(throws_error([&] { l.model->mtp_forward_device(ctx(), b, hidden, cache.state(), 0); },
                           ErrorKind::kRuntime, "the state has no MTP caches"));
  EXPECT_TRUE(throws_error([&] { l.model->mtp_forward_device(ctx(), b, hidden, cache.state(), 1); },
                           ErrorKind::kRuntime, "block 1 of a head with 1 block(s)"));
}

CHIMERA_INSTANTIATE_BACKENDS(MtpHead);

// ---- loading ----------------------------------------------------------------------------------------------

class MtpCheckpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    src_ = fs::path(test::source_path("tests/fixtures/models")) / kFixture;
    dir_ = fs::temp_directory_path() /
           ("chimera_mtpckpt_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    fs::copy_file(src_ / "config.json", dir_ / "config.json");
    const Checkpoint ck = Checkpoint::open(src_);
    for (const auto& n : ck.names()) tensors_.emplace_back(n, ck.tensor(n).clone());
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Writes tensors_ (and `config`, when set, over config.json) and loads; returns the error ("" if it loaded).
  std::string load_error(int* blocks = nullptr) {
    write_safetensors(dir_ / "model.safetensors", tensors_);
    try {
      const ModelConfig c = load_model_config(dir_);
      const Checkpoint ck = Checkpoint::open(dir_);
      const NemotronH m = NemotronH::load(c, ck);
      if (blocks) *blocks = m.mtp_blocks();
    } catch (const Error& e) {
      EXPECT_EQ(e.exit_code(), 2) << e.what();
      return e.what();
    }
    return "";
  }
  void erase_mtp(const std::string& name) {
    tensors_.erase(std::remove_if(tensors_.begin(), tensors_.end(), [&](const auto& t) { return t.first == name; }),
                   tensors_.end());
  }
  void rewrite_config(const std::string& from, const std::string& to) {
    std::ifstream in(dir_ / "config.json");
    std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const size_t at = s.find(from);
    ASSERT_NE(at, std::string::npos) << from;
    s.replace(at, from.size(), to);
    std::ofstream(dir_ / "config.json") << s;
  }

  fs::path src_, dir_;
  std::vector<std::pair<std::string, Tensor>> tensors_;
};

TEST_F(MtpCheckpoint, AMisShapedHeadTensorIsNamed) {
  for (auto& [n, t] : tensors_) {
    if (n == "mtp.layers.0.eh_proj.weight") t = Tensor::zeros(DType::kF32, {t.dim(0), t.dim(1) - 1});
  }
  const std::string msg = load_error();
  EXPECT_NE(msg.find("mtp.layers.0.eh_proj.weight"), std::string::npos) << msg;
  EXPECT_NE(msg.find("expected"), std::string::npos) << msg;
}

TEST_F(MtpCheckpoint, AMissingHeadTensorIsNamed) {
  erase_mtp("mtp.layers.1.final_layernorm.weight");
  const std::string msg = load_error();
  EXPECT_NE(msg.find("missing"), std::string::npos) << msg;
  EXPECT_NE(msg.find("mtp.layers.1.final_layernorm.weight"), std::string::npos) << msg;
}

TEST_F(MtpCheckpoint, AnUnexpectedHeadTensorIsNamed) {
  tensors_.emplace_back("mtp.layers.2.norm.weight", Tensor::zeros(DType::kF32, {64}));
  const std::string msg = load_error();
  EXPECT_NE(msg.find("unexpected"), std::string::npos) << msg;
  EXPECT_NE(msg.find("mtp.layers.2.norm.weight"), std::string::npos) << msg;
}

// A backbone saved without its head (as transformers' save_pretrained writes it) loads, with no head.
TEST_F(MtpCheckpoint, ACheckpointWithoutHeadTensorsHasNoHead) {
  tensors_.erase(
      std::remove_if(tensors_.begin(), tensors_.end(), [](const auto& t) { return t.first.rfind("mtp.", 0) == 0; }),
      tensors_.end());
  int blocks = -1;
  EXPECT_EQ(load_error(&blocks), "");
  EXPECT_EQ(blocks, 0);
}

TEST_F(MtpCheckpoint, AMambaSublayerInTheHeadIsRejected) {
  rewrite_config("\"mtp_layers_block_type\": [\n    \"full_attention\"",
                 "\"mtp_layers_block_type\": [\n    \"linear_attention\"");
  const std::string msg = load_error();
  EXPECT_NE(msg.find("Mamba sublayer"), std::string::npos) << msg;
}

}  // namespace
}  // namespace chimera
