// The bundled default model (models/nemotron-h-kjv, trained by scripts/train_default_model.py on the King James
// Bible, with an MTP head), on the CPU and on CUDA in fp32:
//   * its tokenizer encodes the reference prompts as HF tokenizers did, and greedy decoding reproduces transformers'
//     32-token continuations (expected.json) token for token;
//   * greedy with speculative decoding (K = 1, 2, 3) emits the same tokens, alone and in a mixed batch, and the
//     trained head's drafts are accepted often (the head was trained, not a random one).
#include <fstream>
#include <map>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/backend_param.h"
#include "common/compare.h"
#include "io/model_config.h"
#include "io/safetensors.h"
#include "models/nemotron_h.h"
#include "runtime/engine.h"
#include "tokenizer/tokenizer.h"

namespace chimera {
namespace {

using test::BackendTest;

class DefaultModel : public BackendTest {
 protected:
  void SetUp() override {
    BackendTest::SetUp();
    if (IsSkipped()) return;
    dir_ = test::source_path("models/nemotron-h-kjv");
    std::ifstream in(dir_ + "/expected.json");
    const nlohmann::json j = nlohmann::json::parse(in);
    prompts_ = j.at("prompts").get<std::vector<std::vector<int32_t>>>();
    greedy_ = j.at("greedy").get<std::vector<std::vector<int32_t>>>();
    texts_ = j.at("texts").get<std::vector<std::string>>();
    prompt_texts_ = j.at("prompt_texts").get<std::vector<std::string>>();
    config_ = load_model_config(dir_);
    ckpt_ = std::make_unique<Checkpoint>(Checkpoint::open(dir_));
    model_ = std::make_unique<NemotronH>(NemotronH::load(config_, *ckpt_, ModelOptions{GetParam(), DType::kF32}));
  }

  struct Run {
    std::vector<std::vector<int32_t>> tokens;
    SpeculativeStats stats;
    int64_t graph_steps = 0;
  };
  Run run(int32_t k, const std::vector<std::vector<int32_t>>& prompts, const std::vector<int32_t>& max_tokens) const {
    EngineConfig ec;
    ec.cache.max_seqs = 4;
    ec.cache.max_model_len = 256;
    ec.scheduler.max_num_seqs = 4;
    if (k > 0) ec.speculative = SpeculativeConfig{"mtp", k};
    Engine engine(*model_, ops::Context{GetParam(), nullptr}, ec);
    std::vector<int32_t> ids;
    for (size_t i = 0; i < prompts.size(); ++i) {
      SamplingParams sp;
      sp.max_new_tokens = max_tokens[i];
      sp.ignore_eos = true;
      ids.push_back(engine.add_request(prompts[i], sp));
    }
    while (engine.has_unfinished()) engine.step();
    std::map<int32_t, std::vector<int32_t>> by_id;
    for (Sequence& s : engine.take_finished()) {
      by_id[s.id] = std::vector<int32_t>(s.tokens.begin() + s.prompt_len, s.tokens.end());
    }
    Run r;
    for (int32_t id : ids) r.tokens.push_back(by_id[id]);
    r.stats = engine.speculative_stats();
    r.graph_steps = engine.num_graph_steps();
    return r;
  }

  std::string dir_;
  std::vector<std::vector<int32_t>> prompts_, greedy_;
  std::vector<std::string> texts_, prompt_texts_;
  ModelConfig config_;
  std::unique_ptr<Checkpoint> ckpt_;
  std::unique_ptr<NemotronH> model_;
};

TEST_P(DefaultModel, GreedyMatchesTransformers) {
  ASSERT_GT(model_->mtp_blocks(), 0) << "the default model has an MTP head";
  const Tokenizer tok = Tokenizer::load(dir_ + "/tokenizer.json");
  for (size_t p = 0; p < prompts_.size(); ++p) {
    SCOPED_TRACE(texts_[p]);
    EXPECT_EQ(tok.encode(prompt_texts_[p], /*add_special_tokens=*/true), prompts_[p]);  // HF's encoding, with <s>
  }
  const Run r = run(0, prompts_, std::vector<int32_t>(prompts_.size(), 32));
  for (size_t p = 0; p < prompts_.size(); ++p) EXPECT_EQ(r.tokens[p], greedy_[p]) << "prompt " << p;
}

TEST_P(DefaultModel, SpeculativeGreedyEmitsTheSameTokensAndAcceptsOften) {
  const std::vector<int32_t> lens = {32, 20, 27, 32};
  const Run plain = run(0, prompts_, lens);
  for (int32_t k : {1, 2, 3}) {
    SCOPED_TRACE(::testing::Message() << "K=" << k);
    const Run alone = run(k, {prompts_[0]}, {32});
    EXPECT_EQ(alone.tokens[0], greedy_[0]);
    const Run mixed = run(k, prompts_, lens);
    EXPECT_EQ(mixed.tokens, plain.tokens);
    // On CUDA the steady verify steps replay captured speculative steps (the engine's default).
    if (GetParam() == Device::kCuda) {
      EXPECT_GT(alone.graph_steps, 0);
    }
    // A trained head: its first draft is accepted far above chance (1 / 4096).
    EXPECT_GT(static_cast<double>(mixed.stats.accepted_per_position[0]) / mixed.stats.num_drafts, 0.3)
        << mixed.stats.summary();
  }
}

CHIMERA_INSTANTIATE_BACKENDS(DefaultModel);

}  // namespace
}  // namespace chimera
