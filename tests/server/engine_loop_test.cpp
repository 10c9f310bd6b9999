// The engine thread's periodic stats line (vLLM's "Avg prompt throughput ..." log): what it counts and when it
// is printed, on the bundled model on the CPU.
#include "server/engine_loop.h"

#include <gtest/gtest.h>

#include <condition_variable>
#include <memory>
#include <mutex>
#include <regex>
#include <string>
#include <vector>

#include "common/compare.h"
#include "io/model_config.h"
#include "io/safetensors.h"
#include "models/nemotron_h.h"
#include "runtime/engine.h"
#include "server/metrics.h"

namespace chimera {
namespace {

// Collects a request's tokens; done when every sequence finished.
class WaitingSink : public server::RequestSink {
 public:
  explicit WaitingSink(int32_t seqs) : open_(seqs) {}
  void on_events(std::vector<server::SeqEvent> events) override {
    std::lock_guard lock(mu_);
    for (const server::SeqEvent& e : events) {
      if (e.token >= 0) ++tokens_;
      if (e.finish != FinishReason::kNone || e.aborted) --open_;
    }
    cv_.notify_all();
  }
  void on_error(int, std::string message) override {
    std::lock_guard lock(mu_);
    error_ = std::move(message);
    open_ = 0;
    cv_.notify_all();
  }
  int32_t wait() {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return open_ <= 0; });
    EXPECT_EQ(error_, "");
    return tokens_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int32_t open_;
  int32_t tokens_ = 0;
  std::string error_;
};

class EngineLoopStats : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string dir = test::source_path("models/nemotron-h-tiny");
    config_ = load_model_config(dir);
    ckpt_ = std::make_unique<Checkpoint>(Checkpoint::open(dir));
    model_ = std::make_unique<NemotronH>(NemotronH::load(config_, *ckpt_, ModelOptions{Device::kCpu, DType::kF32}));
    EngineConfig ec;
    ec.cache.max_seqs = 2;
    ec.cache.max_model_len = 128;
    ec.scheduler.max_num_seqs = 2;
    ec.scheduler.max_num_batched_tokens = 32;
    engine_ = std::make_unique<Engine>(*model_, ops::Context{Device::kCpu, nullptr}, ec);
    metrics_ = std::make_unique<server::Metrics>("tiny", 128);
  }

  // Runs one request of a 40-token prompt and 5 new tokens through a loop with this stats interval; returns the
  // lines it printed.
  std::vector<std::string> run(double interval_s) {
    std::vector<std::string> lines;
    std::mutex mu;
    server::EngineLoopConfig lc;
    lc.log_stats_interval_s = interval_s;
    lc.log = [&](const std::string& line) {
      std::lock_guard lock(mu);
      lines.push_back(line);
    };
    {
      server::EngineLoop loop(*engine_, *metrics_, lc, 2);
      server::SeqRequest r;
      for (int32_t i = 0; i < 40; ++i) r.prompt.push_back(5 + 7 * i);
      r.sampling.max_new_tokens = 5;
      r.sampling.ignore_eos = true;
      auto sink = std::make_shared<WaitingSink>(1);
      loop.submit({r}, sink, std::chrono::steady_clock::now());
      EXPECT_EQ(sink->wait(), 5);
    }
    return lines;
  }

  ModelConfig config_;
  std::unique_ptr<Checkpoint> ckpt_;
  std::unique_ptr<NemotronH> model_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<server::Metrics> metrics_;
};

// An interval shorter than any step prints one line a step: the prompt's two chunks (32 + 8 tokens, the second
// sampling the first token), then four one-token decodes, each naming its kind and the load.
TEST_F(EngineLoopStats, ALinePerIntervalWithThePromptAndGenerationCounts) {
  const std::vector<std::string> lines = run(1e-9);
  ASSERT_EQ(lines.size(), 6u);
  const std::regex re(
      R"(Avg prompt throughput: ([0-9.]+) tokens/s, Avg generation throughput: ([0-9.]+) tokens/s, Running: (\d+) )"
      R"(reqs, Waiting: (\d+) reqs, KV cache usage: ([0-9.]+)%, Steps: 1 \(eager 1 x [0-9.]+ ms, graph 0 x 0\.0 ms\))");
  for (size_t i = 0; i < lines.size(); ++i) {
    std::smatch m;
    ASSERT_TRUE(std::regex_match(lines[i], m, re)) << lines[i];
    const double prompt = std::stod(m[1]), generation = std::stod(m[2]);
    EXPECT_EQ(prompt > 0, i < 2) << lines[i];       // prompt chunks in steps 0 and 1 only
    EXPECT_EQ(generation > 0, i >= 1) << lines[i];  // a token from step 1 on
    EXPECT_EQ(m[4], "0");
    // The sequence's blocks until the step that finishes it frees them.
    EXPECT_EQ(std::stod(m[5]) > 0.0, i + 1 < lines.size()) << lines[i];
    EXPECT_EQ(m[3], i + 1 < lines.size() ? "1" : "0") << lines[i];
  }
}

TEST_F(EngineLoopStats, ZeroIntervalPrintsNothingAndALongOneWaitsForItsEnd) {
  EXPECT_TRUE(run(0).empty());
  EXPECT_TRUE(run(3600).empty());
}

}  // namespace
}  // namespace chimera
