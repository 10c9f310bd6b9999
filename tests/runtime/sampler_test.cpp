#include "runtime/sampler.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <map>
#include <numeric>
#include <set>
#include <vector>

#include <gtest/gtest.h>

#include "common/backend_param.h"
#include "common/compare.h"
#include "core/error.h"
#include "io/model_config.h"
#include "io/safetensors.h"
#include "models/nemotron_h.h"
#include "runtime/engine.h"

namespace chimera {
namespace {

// log-softmax of a row in double, written from the definition.
std::vector<double> log_softmax(std::span<const float> l) {
  double mx = -std::numeric_limits<double>::infinity();
  for (float v : l) mx = std::max(mx, static_cast<double>(v));
  double sum = 0.0;
  for (float v : l) sum += std::exp(static_cast<double>(v) - mx);
  std::vector<double> out;
  for (float v : l) out.push_back(static_cast<double>(v) - mx - std::log(sum));
  return out;
}

// The penalised logits, from the definitions: repetition (HF / vLLM) over prompt + generated, then frequency and
// presence (OpenAI) over generated, each counted by a direct scan.
std::vector<float> penalised_reference(std::vector<float> l, const SamplingParams& p, const std::vector<int32_t>& prompt,
                                       const std::vector<int32_t>& generated) {
  for (size_t id = 0; id < l.size(); ++id) {
    const auto tok = static_cast<int32_t>(id);
    const auto count = std::count(generated.begin(), generated.end(), tok);
    const bool seen = count > 0 || std::find(prompt.begin(), prompt.end(), tok) != prompt.end();
    float v = l[id];
    if (seen) v = v > 0.0f ? v / p.repetition_penalty : v * p.repetition_penalty;
    v = v - p.frequency_penalty * static_cast<float>(count);
    if (count > 0) v = v - p.presence_penalty;
    l[id] = v;
  }
  return l;
}

TEST(Sampler, GreedyTakesArgmaxAndLowestIdOnTies) {
  SamplingParams p;
  std::vector<float> l{0.1f, 3.0f, -1.0f, 3.0f};
  EXPECT_EQ(sample_token(l, p, 0), 1);
  l[3] = 3.5f;
  EXPECT_EQ(sample_token(l, p, 0), 3);
}

TEST(Sampler, TopKOneIsGreedy) {
  SamplingParams p;
  p.temperature = 5.0f;
  p.top_k = 1;
  std::vector<float> l{0.1f, 0.2f, 0.15f};
  for (uint64_t s = 0; s < 50; ++s) EXPECT_EQ(sample_token(l, p, s), 1);
}

TEST(Sampler, SeededAndReproducible) {
  SamplingParams p;
  p.temperature = 1.0f;
  p.seed = 42;
  std::vector<float> l(100);
  for (size_t i = 0; i < l.size(); ++i) l[i] = std::sin(static_cast<float>(i));
  std::vector<int32_t> a, b;
  for (uint64_t s = 0; s < 64; ++s) a.push_back(sample_token(l, p, s));
  for (uint64_t s = 0; s < 64; ++s) b.push_back(sample_token(l, p, s));
  EXPECT_EQ(a, b);
  p.seed = 43;
  std::vector<int32_t> c;
  for (uint64_t s = 0; s < 64; ++s) c.push_back(sample_token(l, p, s));
  EXPECT_NE(a, c);
}

TEST(Sampler, FrequenciesFollowTheSoftmax) {
  SamplingParams p;
  p.temperature = 1.0f;
  std::vector<float> l{std::log(0.5f), std::log(0.3f), std::log(0.2f)};
  std::map<int32_t, int> n;
  const int draws = 20000;
  for (int s = 0; s < draws; ++s) ++n[sample_token(l, p, static_cast<uint64_t>(s))];
  EXPECT_NEAR(n[0] / double(draws), 0.5, 0.02);
  EXPECT_NEAR(n[1] / double(draws), 0.3, 0.02);
  EXPECT_NEAR(n[2] / double(draws), 0.2, 0.02);
}

TEST(Sampler, TopKAndTopPRestrictTheSupport) {
  std::vector<float> l{std::log(0.4f), std::log(0.3f), std::log(0.2f), std::log(0.1f)};
  SamplingParams p;
  p.temperature = 1.0f;
  p.top_k = 2;
  for (uint64_t s = 0; s < 2000; ++s) EXPECT_LT(sample_token(l, p, s), 2);
  p.top_k = 0;
  p.top_p = 0.65f;  // 0.4 + 0.3 >= 0.65: only the two most likely survive
  std::map<int32_t, int> n;
  for (uint64_t s = 0; s < 4000; ++s) ++n[sample_token(l, p, s)];
  EXPECT_EQ(n.count(2) + n.count(3), 0u);
  EXPECT_NEAR(n[0] / 4000.0, 0.4 / 0.7, 0.03);
  p.top_p = 0.1f;  // always keeps at least the best token
  for (uint64_t s = 0; s < 100; ++s) EXPECT_EQ(sample_token(l, p, s), 0);
}

TEST(Sampler, TemperatureSharpens) {
  std::vector<float> l{1.0f, 0.0f};
  SamplingParams p;
  p.temperature = 0.05f;
  int zeros = 0;
  for (uint64_t s = 0; s < 1000; ++s) zeros += sample_token(l, p, s) == 0;
  EXPECT_GT(zeros, 995);
}

TEST(Sampler, RejectsBadParameters) {
  SamplingParams p;
  p.temperature = -1.0f;
  EXPECT_THROW(p.validate(), Error);
  p = SamplingParams{};
  p.top_p = 0.0f;
  try {
    p.validate();
    FAIL() << "top_p = 0 accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.exit_code(), 2);
    EXPECT_NE(std::string(e.what()).find("--top-p"), std::string::npos);
  }
  p = SamplingParams{};
  p.top_k = -3;
  EXPECT_THROW(p.validate(), Error);
}

TEST(Sampler, CounterUniformIsInUnitInterval) {
  double lo = 1.0, hi = 0.0;
  for (uint64_t s = 0; s < 10000; ++s) {
    const double u = counter_uniform(7, s);
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    lo = std::min(lo, u);
    hi = std::max(hi, u);
  }
  EXPECT_LT(lo, 0.01);
  EXPECT_GT(hi, 0.99);
}

TEST(Sampler, RejectsBadNewParametersNamingTheField) {
  auto rejects = [](auto&& set, const char* field) {
    SamplingParams p;
    set(p);
    try {
      p.validate();
      ADD_FAILURE() << field << " accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidInput);
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    }
  };
  rejects([](SamplingParams& p) { p.min_p = -0.1f; }, "min_p");
  rejects([](SamplingParams& p) { p.min_p = 1.5f; }, "min_p");
  rejects([](SamplingParams& p) { p.presence_penalty = 2.5f; }, "presence_penalty");
  rejects([](SamplingParams& p) { p.frequency_penalty = -3.0f; }, "frequency_penalty");
  rejects([](SamplingParams& p) { p.frequency_penalty = std::nanf(""); }, "frequency_penalty");
  rejects([](SamplingParams& p) { p.repetition_penalty = 0.0f; }, "repetition_penalty");
  rejects([](SamplingParams& p) { p.repetition_penalty = INFINITY; }, "repetition_penalty");
  rejects([](SamplingParams& p) { p.logprobs = 21; }, "logprobs");
  rejects([](SamplingParams& p) { p.logprobs = -2; }, "logprobs");
  rejects([](SamplingParams& p) { p.stop_token_ids = {5, -1}; }, "stop_token_ids");
  SamplingParams ok;
  ok.min_p = 1.0f;
  ok.presence_penalty = -2.0f;
  ok.frequency_penalty = 2.0f;
  ok.repetition_penalty = 1.3f;
  ok.logprobs = 20;
  ok.stop_token_ids = {0, 7};
  EXPECT_NO_THROW(ok.validate());
}

// The sampled token's logprob and the top ones against log-softmax in double, whatever the sampling does to the
// distribution (temperature, top-k, penalties): logprobs are of the raw logits.
TEST(Sampler, LogprobsAreTheRawLogSoftmax) {
  auto rng = test::Rng::for_test();
  const Tensor t = rng.normal_tensor({1, 997}, 4.0f);
  std::vector<float> l(t.f32(), t.f32() + 997);
  l[10] = l[20] = *std::max_element(l.begin(), l.end()) + 0.5f;  // a tie at the top: the lower id first
  const std::vector<double> ref = log_softmax(l);
  const std::vector<int32_t> prompt{10, 3, 3}, generated{20, 5, 5, 5};
  for (int32_t k : {0, 1, 5, 20}) {
    for (float temperature : {0.0f, 0.6f, 1.7f}) {
      SamplingParams p;
      p.temperature = temperature;
      p.top_k = 50;
      p.repetition_penalty = 1.4f;
      p.frequency_penalty = 0.5f;
      p.logprobs = k;
      for (uint64_t step = 0; step < 20; ++step) {
        const SampledToken s = sample_token(l, p, step, prompt, generated);
        ASSERT_GE(s.id, 0);
        EXPECT_FALSE(s.nonfinite);
        EXPECT_NEAR(s.logprob, ref[static_cast<size_t>(s.id)], 1e-5) << "token " << s.id;
        ASSERT_EQ(s.top_logprobs.size(), static_cast<size_t>(k));
        std::vector<int32_t> order(l.size());
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return ref[a] > ref[b]; });
        for (int32_t j = 0; j < k; ++j) {
          EXPECT_EQ(s.top_logprobs[j].first, order[j]) << "rank " << j;
          EXPECT_NEAR(s.top_logprobs[j].second, ref[order[j]], 1e-5) << "rank " << j;
        }
        if (k > 1) {
          EXPECT_EQ(s.top_logprobs[0].first, 10);
          EXPECT_EQ(s.top_logprobs[1].first, 20);
        }
      }
    }
  }
  // More top logprobs than the vocabulary: all of it.
  SamplingParams p;
  p.logprobs = 20;
  const std::vector<float> tiny{0.5f, -1.0f, 2.0f};
  const SampledToken s = sample_token(tiny, p, 0, {}, {});
  ASSERT_EQ(s.top_logprobs.size(), 3u);
  EXPECT_EQ(s.top_logprobs[0].first, 2);
  EXPECT_EQ(s.top_logprobs[2].first, 1);
}

// Penalties against a direct formula: with the same uniform, sampling with penalties equals sampling the
// reference-penalised logits without them, greedy and sampled, for each penalty alone and together.
TEST(Sampler, PenaltiesMatchTheirDefinitions) {
  auto rng = test::Rng::for_test();
  const int64_t V = 300;
  const Tensor t = rng.normal_tensor({1, V}, 2.0f);
  std::vector<float> l(t.f32(), t.f32() + V);
  std::vector<int32_t> prompt, generated;
  for (int i = 0; i < 40; ++i) prompt.push_back(static_cast<int32_t>(rng.integer(0, V - 1)));
  for (int i = 0; i < 60; ++i) generated.push_back(static_cast<int32_t>(rng.integer(0, 30)));  // many repeats
  // Generated tokens 0..30 compete with unpenalised ones 31..61 at the top, so penalties change the outcome.
  for (size_t id = 0; id < 62; ++id) l[id] += 3.0f;
  for (size_t i = 0; i < 10; ++i) l[static_cast<size_t>(prompt[i])] = -1.5f - static_cast<float>(i);  // negative ones
  struct Case {
    float presence, frequency, repetition;
  };
  for (const Case c : {Case{0.7f, 0.0f, 1.0f}, Case{0.0f, 0.3f, 1.0f}, Case{0.0f, 0.0f, 1.8f}, Case{0.0f, 0.0f, 0.6f},
                       Case{-0.5f, 0.25f, 1.3f}, Case{1.5f, 1.1f, 2.0f}}) {
    SCOPED_TRACE(::testing::Message() << "presence " << c.presence << " frequency " << c.frequency << " repetition "
                                      << c.repetition);
    int differs_from_unpenalised = 0;
    for (float temperature : {0.0f, 0.8f}) {
      SamplingParams p;
      p.temperature = temperature;
      p.presence_penalty = c.presence;
      p.frequency_penalty = c.frequency;
      p.repetition_penalty = c.repetition;
      p.seed = 9;
      const std::vector<float> ref = penalised_reference(l, p, prompt, generated);
      SamplingParams plain = p;
      plain.presence_penalty = plain.frequency_penalty = 0.0f;
      plain.repetition_penalty = 1.0f;
      for (uint64_t step = 0; step < 200; ++step) {
        const int32_t got = sample_token(l, p, step, prompt, generated).id;
        ASSERT_EQ(got, sample_token(ref, plain, step)) << "step " << step;
        differs_from_unpenalised += got != sample_token(l, plain, step);
      }
    }
    EXPECT_GT(differs_from_unpenalised, 0) << "the penalty changed nothing";
  }
  // Presence and frequency look at the generated tokens only: a token only in the prompt keeps its logit.
  SamplingParams p;
  p.presence_penalty = 2.0f;
  p.frequency_penalty = 2.0f;
  std::vector<float> two{1.0f, 0.9f};
  EXPECT_EQ(sample_token(two, p, 0, std::vector<int32_t>{0, 0, 0}, {}).id, 0);
  EXPECT_EQ(sample_token(two, p, 0, {}, std::vector<int32_t>{0}).id, 1);
}

// min_p against its definition: p_i >= min_p * p_max under the tempered softmax; the draws stay in that set and
// follow the renormalised distribution over it.
TEST(Sampler, MinPKeepsTokensAboveTheScaledMaximum) {
  std::vector<float> l{2.0f, 1.5f, 1.0f, 0.0f, -1.0f, 1.9f};
  for (float temperature : {0.5f, 1.0f, 2.0f}) {
    for (float min_p : {0.05f, 0.3f, 0.7f, 1.0f}) {
      SCOPED_TRACE(::testing::Message() << "T " << temperature << " min_p " << min_p);
      std::vector<double> prob;
      double pmax = 0.0, z = 0.0;
      for (float v : l) prob.push_back(std::exp(static_cast<double>(v) / temperature));
      for (double q : prob) pmax = std::max(pmax, q);
      std::vector<double> kept(l.size(), 0.0);
      for (size_t i = 0; i < l.size(); ++i) {
        if (prob[i] >= min_p * pmax) kept[i] = prob[i];
        z += kept[i];
      }
      SamplingParams p;
      p.temperature = temperature;
      p.min_p = min_p;
      std::map<int32_t, int> n;
      const int draws = 20000;
      for (int s = 0; s < draws; ++s) ++n[sample_token(l, p, static_cast<uint64_t>(s))];
      for (size_t i = 0; i < l.size(); ++i) {
        const double f = n[static_cast<int32_t>(i)] / static_cast<double>(draws);
        if (kept[i] == 0.0) {
          EXPECT_EQ(f, 0.0) << "token " << i << " is below min_p";
        } else {
          EXPECT_NEAR(f, kept[i] / z, 0.015) << "token " << i;
        }
      }
    }
  }
  // min_p 0 is off: every token can come.
  SamplingParams p;
  p.temperature = 1.0f;
  std::set<int32_t> seen;
  for (uint64_t s = 0; s < 5000; ++s) seen.insert(sample_token(l, p, s));
  EXPECT_EQ(seen.size(), l.size());
}

TEST(Sampler, NonFiniteLogitsAreFlagged) {
  std::vector<float> l{0.5f, 1.0f, -2.0f, 0.0f};
  SamplingParams p;
  EXPECT_FALSE(sample_token(l, p, 0, {}, {}).nonfinite);
  for (float bad : {std::nanf(""), INFINITY, -INFINITY}) {
    for (size_t at : {size_t{0}, size_t{3}}) {
      std::vector<float> b = l;
      b[at] = bad;
      for (float temperature : {0.0f, 1.0f}) {
        p.temperature = temperature;
        EXPECT_TRUE(sample_token(b, p, 0, {}, {}).nonfinite) << bad << " at " << at;
      }
    }
  }
}

// ---- through the engine on the bundled model, on each backend ----
class SamplerEngine : public test::BackendTest {
 protected:
  void SetUp() override {
    BackendTest::SetUp();
    if (IsSkipped()) return;
    dir_ = test::source_path("models/nemotron-h-tiny");
    config_ = load_model_config(dir_);
    ckpt_ = std::make_unique<Checkpoint>(Checkpoint::open(dir_));
    const ModelOptions mo{GetParam(), GetParam() == Device::kCuda ? DType::kBF16 : DType::kF32};
    model_ = std::make_unique<NemotronH>(NemotronH::load(config_, *ckpt_, mo));
  }
  struct Run {
    std::vector<TokenEvent> events;  // this request's, in order
    std::vector<std::vector<float>> rows;  // with keep_logits: the logits row each event sampled from
    Sequence finished;
  };
  // One request (sampling as given) beside a second, plain one, so the batch has two rows. keep_logits makes the
  // engine sample on the host (the rows come back) instead of on the device.
  Run run(const SamplingParams& sp, bool keep_logits) {
    EngineConfig ec;
    ec.cache.max_seqs = 2;
    ec.cache.max_model_len = 96;
    ec.cache.block_size = 16;
    ec.scheduler.max_num_seqs = 2;
    ec.scheduler.max_num_batched_tokens = 64;
    Engine engine(*model_, ctx(), ec);
    Run r;
    std::map<int32_t, std::vector<float>> last_row;
    if (keep_logits) {
      engine.on_logits = [&](int32_t id, std::span<const float> row) { last_row[id].assign(row.begin(), row.end()); };
    }
    std::vector<int32_t> prompt(13);
    for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>(5 + 11 * i) % 4096;
    const int32_t id = engine.add_request(prompt, sp);
    SamplingParams other;
    other.max_new_tokens = 5;
    engine.add_request(std::vector<int32_t>{7, 8, 9}, other);
    while (engine.has_unfinished()) {
      for (TokenEvent& ev : engine.step()) {
        if (ev.seq_id != id) continue;
        if (keep_logits) r.rows.push_back(last_row[id]);
        r.events.push_back(std::move(ev));
      }
    }
    for (Sequence& s : engine.take_finished()) {
      if (s.id == id) r.finished = std::move(s);
    }
    return r;
  }
  std::filesystem::path dir_;
  ModelConfig config_;
  std::unique_ptr<Checkpoint> ckpt_;
  std::unique_ptr<NemotronH> model_;
};

// A stop token id finishes the sequence with kStop right after it is generated, and is part of the output
// (vLLM's behaviour), even with ignore_eos.
TEST_P(SamplerEngine, StopTokenIdsEndTheSequenceAndAreKept) {
  SamplingParams sp;
  sp.max_new_tokens = 12;
  sp.ignore_eos = true;
  const Run free = run(sp, false);
  ASSERT_EQ(free.events.size(), 12u);
  std::vector<int32_t> out;
  for (const TokenEvent& ev : free.events) out.push_back(ev.token);
  EXPECT_EQ(free.events.back().finish, FinishReason::kLength);
  // Stop at the token generated fourth (or at its first occurrence, if earlier).
  const int32_t stop = out[3];
  const size_t first = static_cast<size_t>(std::find(out.begin(), out.end(), stop) - out.begin());
  sp.stop_token_ids = {4095, stop};
  const Run stopped = run(sp, false);
  ASSERT_EQ(stopped.events.size(), first + 1);
  for (size_t i = 0; i <= first; ++i) EXPECT_EQ(stopped.events[i].token, out[i]) << i;
  EXPECT_EQ(stopped.events.back().finish, FinishReason::kStop);
  EXPECT_EQ(stopped.finished.finish, FinishReason::kStop);
  EXPECT_EQ(stopped.finished.tokens.back(), stop);
  EXPECT_EQ(stopped.finished.num_generated(), static_cast<int32_t>(first + 1));
}

TEST_P(SamplerEngine, StopTokenIdOutsideTheVocabularyIsRejected) {
  EngineConfig ec;
  ec.cache.max_seqs = 1;
  ec.cache.max_model_len = 32;
  ec.scheduler.max_num_seqs = 1;
  Engine engine(*model_, ctx(), ec);
  SamplingParams sp;
  sp.stop_token_ids = {4096};
  EXPECT_TRUE(test::throws_error([&] { engine.add_request({1, 2, 3}, sp); }, ErrorKind::kInvalidInput,
                                 "stop_token_ids (--stop-token-ids): entry 0 is 4096, outside the vocabulary"));
}

// Logprobs through the engine: on the host path against log-softmax (double) of the row the engine sampled from;
// the device path (no rows asked for) gives the same tokens and logprobs.
TEST_P(SamplerEngine, LogprobsOfEachEventAreTheRowsLogSoftmax) {
  SamplingParams sp;
  sp.max_new_tokens = 6;
  sp.ignore_eos = true;
  sp.temperature = 0.9f;
  sp.seed = 17;
  sp.logprobs = 4;
  sp.repetition_penalty = 1.2f;
  const Run host = run(sp, true);
  ASSERT_EQ(host.events.size(), 6u);
  for (size_t e = 0; e < host.events.size(); ++e) {
    const TokenEvent& ev = host.events[e];
    const std::vector<double> ref = log_softmax(host.rows[e]);
    EXPECT_NEAR(ev.logprob, ref[static_cast<size_t>(ev.token)], 1e-4) << "event " << e;
    ASSERT_EQ(ev.top_logprobs.size(), 4u);
    for (size_t j = 0; j < 4; ++j) {
      EXPECT_NEAR(ev.top_logprobs[j].second, ref[static_cast<size_t>(ev.top_logprobs[j].first)], 1e-4);
      if (j > 0) {
        EXPECT_GE(ev.top_logprobs[j - 1].second, ev.top_logprobs[j].second);
      }
    }
    const double best = *std::max_element(ref.begin(), ref.end());
    EXPECT_NEAR(ev.top_logprobs[0].second, best, 1e-4);
  }
  const Run device = run(sp, false);
  ASSERT_EQ(device.events.size(), host.events.size());
  int same = 0;
  for (size_t e = 0; e < host.events.size(); ++e) same += device.events[e].token == host.events[e].token;
  EXPECT_GE(same, 5) << "device and host sampling drew different tokens";
  EXPECT_NEAR(device.events[0].logprob, host.events[0].logprob, on_cuda() ? 1e-3 : 1e-6);
  // Without logprobs asked, none are filled.
  sp.logprobs = -1;
  const Run none = run(sp, false);
  for (const TokenEvent& ev : none.events) EXPECT_TRUE(ev.top_logprobs.empty());
}

// A copy of the bundled model in `dst` whose tensor `name` has NaN in elements [begin, end).
void write_poisoned_model(const std::filesystem::path& src, const std::filesystem::path& dst, const std::string& name,
                          int64_t begin, int64_t end) {
  namespace fs = std::filesystem;
  fs::remove_all(dst);
  fs::create_directories(dst);
  for (const auto& e : fs::directory_iterator(src)) {
    if (e.path().extension() != ".safetensors") fs::copy(e.path(), dst / e.path().filename());
  }
  const auto file = SafetensorsFile::open(src / "model.safetensors");
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const std::string& n : file->names()) {
    Tensor t = file->tensor(n).clone();
    if (n == name) {
      for (int64_t i = begin; i < end; ++i) {
        switch (t.dtype()) {
          case DType::kF32: t.data_as<float>()[i] = std::nanf(""); break;
          case DType::kBF16: t.data_as<uint16_t>()[i] = 0x7fc0; break;
          case DType::kF16: t.data_as<uint16_t>()[i] = 0x7e00; break;
          default: FAIL() << n << " has an unexpected dtype";
        }
      }
    }
    tensors.emplace_back(n, std::move(t));
  }
  write_safetensors(dst / "model.safetensors", tensors, file->metadata());
}

// Non-finite logits stop the sequence with kError and a message naming the step and the sequence, instead of
// sampling garbage: a NaN in the embedding row of a token the model generates at step 2 turns the logits of the
// step after it first feeds that token into NaN.
TEST_P(SamplerEngine, NonFiniteLogitsStopTheSequenceWithAnError) {
  SamplingParams sp;
  sp.max_new_tokens = 8;
  sp.ignore_eos = true;
  const Run clean = run(sp, false);
  ASSERT_EQ(clean.events.size(), 8u);
  const int32_t poison = clean.events[2].token;
  std::vector<int32_t> out;
  for (const TokenEvent& ev : clean.events) out.push_back(ev.token);
  const auto first = std::find(out.begin(), out.end(), poison) - out.begin();
  if (poison < 140 && (poison - 5) % 11 == 0) GTEST_SKIP() << "the generated token is in the prompt";
  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    ("chimera_poisoned_" + std::string(on_cuda() ? "cuda" : "cpu"));
  const int64_t H = config_.hidden_size;
  ASSERT_NO_FATAL_FAILURE(write_poisoned_model(dir_, dir, "backbone.embeddings.weight", poison * H + 3, poison * H + 4));
  const ModelConfig cfg = load_model_config(dir);
  ckpt_ = std::make_unique<Checkpoint>(Checkpoint::open(dir));
  const ModelOptions mo{GetParam(), on_cuda() ? DType::kBF16 : DType::kF32};
  model_ = std::make_unique<NemotronH>(NemotronH::load(cfg, *ckpt_, mo));
  for (bool keep_logits : {false, true}) {
    SCOPED_TRACE(keep_logits ? "host sampling" : "device sampling");
    const Run bad = run(sp, keep_logits);
    ASSERT_EQ(bad.events.size(), static_cast<size_t>(first + 2));
    for (int64_t i = 0; i <= first; ++i) EXPECT_EQ(bad.events[i].token, out[i]);
    const TokenEvent& last = bad.events.back();
    EXPECT_EQ(last.token, -1);
    EXPECT_EQ(last.finish, FinishReason::kError);
    const std::string want = "non-finite logits at step " + std::to_string(first + 1) + " of sequence 0";
    EXPECT_NE(last.error.find(want), std::string::npos) << last.error;
    EXPECT_EQ(bad.finished.finish, FinishReason::kError);
    EXPECT_EQ(bad.finished.error, last.error);
    EXPECT_EQ(bad.finished.num_generated(), first + 1);
  }
  std::filesystem::remove_all(dir);
}

CHIMERA_INSTANTIATE_BACKENDS(SamplerEngine);

}  // namespace
}  // namespace chimera
