// chimera bench serve end to end against tests/bench_serve/mock_openai_server.py (Python's standard library,
// started per test on a free loopback port): request and token counts, latencies and throughput consistent
// with the mock's configured delays, --max-concurrency as the mock's peak of concurrent requests, Poisson
// spacing of --request-rate arrivals as the mock saw them, the saved JSON's keys, failures counted with their
// reasons, a server that is down, and bad flags.
#include <curl/curl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <numeric>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/compare.h"
#include "common/run_command.h"
#include "tokenizer/tokenizer.h"

namespace chimera {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// The mock server as a child process; SIGTERM on destruction.
class MockServer {
 public:
  explicit MockServer(const std::vector<std::string>& args) {
    int fds[2];
    if (pipe(fds) != 0) return;
    pid_ = fork();
    if (pid_ == 0) {
      dup2(fds[1], STDOUT_FILENO);
      close(fds[0]);
      close(fds[1]);
      std::vector<std::string> argv_s = {"python3", test::source_path("tests/bench_serve/mock_openai_server.py")};
      argv_s.insert(argv_s.end(), args.begin(), args.end());
      std::vector<char*> argv;
      for (auto& a : argv_s) argv.push_back(a.data());
      argv.push_back(nullptr);
      execvp("python3", argv.data());
      _exit(127);
    }
    close(fds[1]);
    // "PORT <n>\n" within 20 s.
    std::string line;
    pollfd pfd{fds[0], POLLIN, 0};
    while (line.find('\n') == std::string::npos && poll(&pfd, 1, 20000) > 0) {
      char buf[64];
      const ssize_t n = read(fds[0], buf, sizeof(buf));
      if (n <= 0) break;
      line.append(buf, static_cast<size_t>(n));
    }
    close(fds[0]);
    if (line.rfind("PORT ", 0) == 0) port_ = std::stoi(line.substr(5));
  }
  ~MockServer() {
    if (pid_ > 0) {
      kill(pid_, SIGTERM);
      waitpid(pid_, nullptr, 0);
    }
  }
  int port() const { return port_; }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }

  json stats() const {
    CURL* e = curl_easy_init();
    std::string body;
    const std::string stats_url = url() + "/stats";
    curl_easy_setopt(e, CURLOPT_URL, stats_url.c_str());
    curl_easy_setopt(e, CURLOPT_TIMEOUT, 10L);
    curl_easy_setopt(e, CURLOPT_WRITEDATA, &body);
    curl_easy_setopt(
        e, CURLOPT_WRITEFUNCTION, +[](char* p, size_t s, size_t m, void* u) {
          static_cast<std::string*>(u)->append(p, s * m);
          return s * m;
        });
    const CURLcode rc = curl_easy_perform(e);
    curl_easy_cleanup(e);
    EXPECT_EQ(rc, CURLE_OK);
    return json::parse(body, nullptr, false);
  }

 private:
  pid_t pid_ = -1;
  int port_ = 0;
};

using test::RunOutput;

// The CLI, bounded by coreutils' timeout so that a hang fails the test instead of stalling CI.
RunOutput run_cli(const std::string& args, const std::string& env = "") {
  return test::run_shell(env + " timeout 120 " + std::string(CHIMERA_CLI_PATH) + " " + args + " 2>&1");
}

std::string tokenizer_flag() {
  return "--tokenizer " + test::source_path("models/nemotron-h-tiny");
}

class BenchServeE2E : public ::testing::Test {
 protected:
  void SetUp() override {
    tmp_ = fs::temp_directory_path() /
           ("chimera_bench_serve_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(tmp_);
    fs::create_directories(tmp_);
  }
  void TearDown() override { fs::remove_all(tmp_); }
  json read_json(const fs::path& p) {
    std::ifstream f(p);
    EXPECT_TRUE(f.good()) << p;
    return json::parse(f, nullptr, false);
  }
  fs::path tmp_;
};

TEST_F(BenchServeE2E, CountsLatenciesConcurrencyAndJsonKeys) {
  MockServer mock({"--ttft-ms", "50", "--token-delay-ms", "20"});
  ASSERT_GT(mock.port(), 0);
  const fs::path result = tmp_ / "result.json";
  const auto r = run_cli("bench serve --base-url " + mock.url() + " --model mock " + tokenizer_flag() +
                         " --random-input-len 32 --random-output-len 10 --num-prompts 12 --max-concurrency 4"
                         " --percentile-metrics ttft,tpot,itl,e2el --save-result --result-filename " +
                         result.string());
  ASSERT_EQ(r.status, 0) << r.out;
  // vLLM's block, labels in its order.
  size_t pos = 0;
  for (const char* label : {"============ Serving Benchmark Result ============",
                            "Successful requests:                     12",
                            "Failed requests:                         0",
                            "Maximum request concurrency:             4",
                            "Benchmark duration (s):",
                            "Total input tokens:                      384",
                            "Total generated tokens:                  120",
                            "Request throughput (req/s):",
                            "Output token throughput (tok/s):",
                            "Peak output token throughput (tok/s):",
                            "Peak concurrent requests:",
                            "Total token throughput (tok/s):",
                            "---------------Time to First Token----------------",
                            "Mean TTFT (ms):",
                            "Median TTFT (ms):",
                            "P99 TTFT (ms):",
                            "-----Time per Output Token (excl. 1st token)------",
                            "Mean TPOT (ms):",
                            "Median TPOT (ms):",
                            "P99 TPOT (ms):",
                            "---------------Inter-token Latency----------------",
                            "Mean ITL (ms):",
                            "Median ITL (ms):",
                            "P99 ITL (ms):",
                            "Mean E2EL (ms):",
                            "P99 E2EL (ms):",
                            "=================================================="}) {
    const size_t at = r.out.find(label, pos);
    ASSERT_NE(at, std::string::npos) << "missing or out of order: " << label << "\n" << r.out;
    pos = at;
  }

  const json j = read_json(result);
  ASSERT_FALSE(j.is_discarded());
  for (const char* key : {"date",
                          "endpoint_type",
                          "backend",
                          "label",
                          "model_id",
                          "tokenizer_id",
                          "num_prompts",
                          "request_rate",
                          "burstiness",
                          "max_concurrency",
                          "duration",
                          "completed",
                          "failed",
                          "total_input_tokens",
                          "total_output_tokens",
                          "request_throughput",
                          "request_goodput",
                          "output_throughput",
                          "total_token_throughput",
                          "max_output_tokens_per_s",
                          "max_concurrent_requests",
                          "mean_ttft_ms",
                          "median_ttft_ms",
                          "std_ttft_ms",
                          "p99_ttft_ms",
                          "mean_tpot_ms",
                          "median_tpot_ms",
                          "std_tpot_ms",
                          "p99_tpot_ms",
                          "mean_itl_ms",
                          "median_itl_ms",
                          "std_itl_ms",
                          "p99_itl_ms",
                          "mean_e2el_ms",
                          "median_e2el_ms",
                          "std_e2el_ms",
                          "p99_e2el_ms",
                          "base_url"}) {
    EXPECT_TRUE(j.contains(key)) << key;
  }
  EXPECT_EQ(j["completed"], 12);
  EXPECT_EQ(j["failed"], 0);
  EXPECT_EQ(j["total_input_tokens"], 12 * 32);
  EXPECT_EQ(j["total_output_tokens"], 12 * 10);
  EXPECT_EQ(j["max_concurrency"], 4);
  EXPECT_EQ(j["request_rate"], "inf");
  EXPECT_EQ(j["model_id"], "mock");
  EXPECT_EQ(j["base_url"], mock.url());
  const double dur = j["duration"];
  // 12 requests, 4 at a time, each at least 50 ms + 9 x 20 ms: at least 3 x 0.23 s.
  EXPECT_GE(dur, 0.69);
  EXPECT_LT(dur, 30.0);
  EXPECT_NEAR(j["output_throughput"].get<double>(), 120.0 / dur, 1e-6 * 120.0 / dur);
  EXPECT_NEAR(j["request_throughput"].get<double>(), 12.0 / dur, 1e-6 * 12.0 / dur);
  EXPECT_NEAR(j["total_token_throughput"].get<double>(), (384.0 + 120.0) / dur, 1e-6 * 504.0 / dur);
  // The mock sleeps 50 ms before the first token and 20 ms between tokens; generous upper bounds for a
  // loaded 2-core CI machine.
  EXPECT_GE(j["mean_ttft_ms"].get<double>(), 49.0);
  EXPECT_LT(j["mean_ttft_ms"].get<double>(), 1000.0);
  EXPECT_GE(j["mean_tpot_ms"].get<double>(), 19.0);
  EXPECT_LT(j["mean_tpot_ms"].get<double>(), 200.0);
  EXPECT_GE(j["median_itl_ms"].get<double>(), 15.0);
  EXPECT_LT(j["median_itl_ms"].get<double>(), 200.0);
  EXPECT_GE(j["mean_e2el_ms"].get<double>(), 229.0);
  EXPECT_LT(j["mean_e2el_ms"].get<double>(), 3000.0);
  EXPECT_LE(j["median_ttft_ms"].get<double>(), j["p99_ttft_ms"].get<double>());
  // e2e = ttft + (tokens - 1) x tpot for each request, so the means agree too.
  EXPECT_NEAR(j["mean_e2el_ms"].get<double>(), j["mean_ttft_ms"].get<double>() + 9 * j["mean_tpot_ms"].get<double>(),
              1e-6 * j["mean_e2el_ms"].get<double>());

  const json s = mock.stats();
  ASSERT_FALSE(s.is_discarded());
  EXPECT_EQ(s["requests"], 13);  // the initial test request + 12
  EXPECT_EQ(s["peak_concurrency"], 4);
  for (size_t i = 0; i < 13; ++i) {
    EXPECT_EQ(s["prompt_lens"][i], 32);
    EXPECT_EQ(s["prompt_is_ids"][i], true);
    EXPECT_EQ(s["max_tokens"][i], 10);
    EXPECT_EQ(s["ignore_eos"][i], true);
    EXPECT_EQ(s["include_usage"][i], true);
  }
}

TEST_F(BenchServeE2E, RequestRateGivesPoissonArrivals) {
  MockServer mock({});
  ASSERT_GT(mock.port(), 0);
  const fs::path result = tmp_ / "rate.json";
  const auto r = run_cli("bench serve --base-url " + mock.url() + " --model mock " + tokenizer_flag() +
                         " --random-input-len 8 --random-output-len 2 --num-prompts 50 --request-rate 25"
                         " --seed 1 --ready-check-timeout-sec 0 --result-filename " +
                         result.string());
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("Traffic request rate: 25.0"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("Burstiness factor: 1.0 (Poisson process)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("Request rate configured (RPS):           25.00"), std::string::npos) << r.out;
  const json j = read_json(result);
  EXPECT_EQ(j["completed"], 50);
  EXPECT_EQ(j["request_rate"], 25.0);
  // The last of 50 arrivals is at 50 / 25 = 2 s exactly (vLLM's normalization).
  EXPECT_GE(j["duration"].get<double>(), 1.95);
  const json s = mock.stats();
  std::vector<double> t = s["arrivals"].get<std::vector<double>>();
  ASSERT_EQ(t.size(), 50u);
  std::vector<double> gaps;
  for (size_t i = 1; i < t.size(); ++i) gaps.push_back(t[i] - t[i - 1]);
  const double mean = std::accumulate(gaps.begin(), gaps.end(), 0.0) / static_cast<double>(gaps.size());
  double var = 0.0;
  for (double g : gaps) var += (g - mean) * (g - mean);
  const double cv = std::sqrt(var / static_cast<double>(gaps.size())) / mean;
  // Mean gap about 1 / 25 s; exponential gaps have a coefficient of variation near 1 (an evenly spaced or
  // all-at-once sender would give about 0).
  EXPECT_GT(mean, 0.025);
  EXPECT_LT(mean, 0.06);
  EXPECT_GT(cv, 0.5);
  EXPECT_LT(cv, 1.8);
}

// The multi-turn replay: 3 conversations x 3 turns; a turn goes out only after its conversation's previous turn has
// finished (each takes >= 100 ms at the mock), while the conversations of one turn go out together.
TEST_F(BenchServeE2E, MultiTurnTurnsWaitForThePreviousTurn) {
  MockServer mock({"--ttft-ms", "100"});
  ASSERT_GT(mock.port(), 0);
  const fs::path result = tmp_ / "multi.json";
  const auto r = run_cli("bench serve --base-url " + mock.url() + " --model mock " + tokenizer_flag() +
                         " --dataset-name multi-turn --multi-turn-conversations 3 --multi-turn-turns 3"
                         " --random-prefix-len 5 --random-input-len 4 --random-output-len 2 --max-concurrency 8"
                         " --ready-check-timeout-sec 0 --result-filename " +
                         result.string());
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_EQ(read_json(result)["num_prompts"], 9);
  const json s = mock.stats();
  const auto t = s["arrivals"].get<std::vector<double>>();
  const auto lens = s["prompt_lens"].get<std::vector<int64_t>>();
  ASSERT_EQ(t.size(), 9u);
  std::vector<int64_t> sorted = lens;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(sorted, (std::vector<int64_t>{9, 9, 9, 15, 15, 15, 21, 21, 21}));  // 5 + 4, then + 2 + 4 a turn
  double last_of_turn_0 = 0, first_of_turn_1 = 1e30, first_of_turn_0 = 1e30;
  for (size_t i = 0; i < t.size(); ++i) {
    if (lens[i] == 9)
      last_of_turn_0 = std::max(last_of_turn_0, t[i]), first_of_turn_0 = std::min(first_of_turn_0, t[i]);
    if (lens[i] == 15) first_of_turn_1 = std::min(first_of_turn_1, t[i]);
  }
  EXPECT_LT(last_of_turn_0 - first_of_turn_0, 0.08);    // one turn's conversations together
  EXPECT_GE(first_of_turn_1 - first_of_turn_0, 0.095);  // the next turn after the previous finished
}

TEST_F(BenchServeE2E, FailedRequestsAreCountedWithTheirReasons) {
  // Request n (from 1) fails: n % 4 == 0 HTTP 500; else n % 5 == 0 malformed SSE; else n % 7 == 0 dropped
  // mid-stream. Of 1..20: {4,8,12,16,20}, {5,10,15}, {7,14}: 10 failed, 10 completed.
  MockServer mock({"--fail-every", "4", "--malformed-every", "5", "--drop-every", "7"});
  ASSERT_GT(mock.port(), 0);
  const fs::path result = tmp_ / "failed.json";
  const auto r = run_cli("bench serve --base-url " + mock.url() + " --model mock " + tokenizer_flag() +
                         " --random-input-len 8 --random-output-len 3 --num-prompts 20 --max-concurrency 1"
                         " --ready-check-timeout-sec 0 --save-detailed --result-filename " +
                         result.string());
  ASSERT_EQ(r.status, 0) << r.out;  // failed requests are reported, as vLLM does, not fatal
  EXPECT_NE(r.out.find("Successful requests:                     10"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("Failed requests:                         10"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("HTTP 500: mock failure"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("malformed SSE data"), std::string::npos) << r.out;
  const json j = read_json(result);
  EXPECT_EQ(j["completed"], 10);
  EXPECT_EQ(j["failed"], 10);
  EXPECT_EQ(j["total_output_tokens"], 30);
  const auto errors = j["errors"].get<std::vector<std::string>>();
  ASSERT_EQ(errors.size(), 20u);
  for (size_t i = 0; i < 20; ++i) {
    const size_t n = i + 1;
    const std::string& e = errors[i];
    if (n % 4 == 0) {
      EXPECT_NE(e.find("HTTP 500"), std::string::npos) << n << ": " << e;
    } else if (n % 5 == 0) {
      EXPECT_NE(e.find("malformed SSE data"), std::string::npos) << n << ": " << e;
    } else if (n % 7 == 0) {
      EXPECT_NE(e.find("request failed"), std::string::npos) << n << ": " << e;
    } else {
      EXPECT_EQ(e, "") << n;
    }
  }
}

TEST_F(BenchServeE2E, ApiKeyFromFlagOrEnvironment) {
  MockServer mock({"--api-key", "sekrit"});
  ASSERT_GT(mock.port(), 0);
  const std::string args = "bench serve --base-url " + mock.url() + " --model mock " + tokenizer_flag() +
                           " --random-input-len 4 --random-output-len 2 --num-prompts 2 --ready-check-timeout-sec 0";
  auto r = run_cli(args);
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find("HTTP 401: invalid API key"), std::string::npos) << r.out;
  // The initial test request gives up at once on an answer that retrying cannot change.
  const auto t0 = std::chrono::steady_clock::now();
  r = run_cli("bench serve --base-url " + mock.url() + " --model mock " + tokenizer_flag() + " --num-prompts 2");
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find("initial test request to " + mock.url() + "/v1/completions failed: HTTP 401"), std::string::npos)
      << r.out;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(30));
  r = run_cli(args + " --api-key sekrit");
  EXPECT_EQ(r.status, 0) << r.out;
  r = run_cli(args, "OPENAI_API_KEY=sekrit");
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("Successful requests:                     2"), std::string::npos) << r.out;
}

TEST_F(BenchServeE2E, ModelFromServerAndChatEndpoint) {
  MockServer mock({"--model", "served-by-mock"});
  ASSERT_GT(mock.port(), 0);
  const fs::path result = tmp_ / "chat.json";
  const auto r =
      run_cli("bench serve --base-url " + mock.url() + " --endpoint /v1/chat/completions " + tokenizer_flag() +
              " --random-input-len 16 --random-output-len 4 --num-prompts 3" + " --result-filename " + result.string());
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("Using model: served-by-mock"), std::string::npos) << r.out;
  const json j = read_json(result);
  EXPECT_EQ(j["completed"], 3);
  EXPECT_EQ(j["total_output_tokens"], 12);
  EXPECT_EQ(j["model_id"], "served-by-mock");
  const json s = mock.stats();
  EXPECT_EQ(s["prompt_is_ids"][0], false);  // chat sends text messages
  EXPECT_EQ(s["max_tokens"][0], 4);         // as max_completion_tokens
}

TEST_F(BenchServeE2E, WithoutUsageTheTextIsTokenized) {
  // No usage block: output tokens are the tokenizer's count of the streamed text, as vLLM counts them.
  MockServer mock({"--no-usage"});
  ASSERT_GT(mock.port(), 0);
  const fs::path result = tmp_ / "nousage.json";
  const auto r =
      run_cli("bench serve --base-url " + mock.url() + " --model mock " + tokenizer_flag() +
              " --random-input-len 8 --random-output-len 6 --num-prompts 2 --result-filename " + result.string());
  ASSERT_EQ(r.status, 0) << r.out;
  const Tokenizer tok = Tokenizer::load(test::source_path("models/nemotron-h-tiny/tokenizer.json"));
  std::string text;
  for (int i = 0; i < 6; ++i) text += " tok";  // what the mock streams per token
  const json j = read_json(result);
  EXPECT_EQ(j["completed"], 2);
  EXPECT_EQ(j["total_output_tokens"], 2 * static_cast<int64_t>(tok.encode(text).size()));
}

TEST_F(BenchServeE2E, SixtyFourStreamsAtOnce) {
  // Streams of 16 tokens 20 ms apart (0.3 s each) keep every slot busy long enough for the mock to see all 64
  // at once even on a loaded machine.
  MockServer mock({"--token-delay-ms", "20"});
  ASSERT_GT(mock.port(), 0);
  const fs::path result = tmp_ / "streams.json";
  const auto r = run_cli("bench serve --base-url " + mock.url() + " --model mock " + tokenizer_flag() +
                         " --random-input-len 64 --random-output-len 16 --num-prompts 128 --max-concurrency 64"
                         " --random-prefix-len 16 --result-filename " +
                         result.string());
  ASSERT_EQ(r.status, 0) << r.out;
  const json j = read_json(result);
  EXPECT_EQ(j["completed"], 128);
  EXPECT_EQ(j["failed"], 0);
  EXPECT_EQ(j["total_input_tokens"], 128 * (64 + 16));  // the shared prefix counts in every prompt
  EXPECT_EQ(j["total_output_tokens"], 128 * 16);
  const json s = mock.stats();
  EXPECT_EQ(s["requests"], 129);
  EXPECT_EQ(s["peak_concurrency"], 64);
}

TEST_F(BenchServeE2E, InitialTestRequestWaitsForAStartingServer) {
  // 503 twice (a server still loading), then up: the test request is retried once a second.
  MockServer mock({"--unavailable-first", "2"});
  ASSERT_GT(mock.port(), 0);
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = run_cli("bench serve --base-url " + mock.url() + " --model mock " + tokenizer_flag() +
                         " --random-input-len 4 --random-output-len 2 --num-prompts 2 --ready-check-timeout-sec 60");
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("Initial test run completed."), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("Successful requests:                     2"), std::string::npos) << r.out;
  EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(1900));
  EXPECT_EQ(mock.stats()["requests"], 3);
}

TEST_F(BenchServeE2E, TextPromptsAreTheDecodedIds) {
  MockServer mock({});
  ASSERT_GT(mock.port(), 0);
  const fs::path result = tmp_ / "text.json";
  const auto r = run_cli("bench serve --base-url " + mock.url() + " --model mock " + tokenizer_flag() +
                         " --prompt-format text --random-input-len 16 --random-output-len 2 --num-prompts 2"
                         " --result-filename " +
                         result.string());
  ASSERT_EQ(r.status, 0) << r.out;
  const json j = read_json(result);
  EXPECT_EQ(j["completed"], 2);
  EXPECT_EQ(j["prompt_format"], "text");
  EXPECT_EQ(j["total_input_tokens"], 32);  // the drawn lengths
  const json s = mock.stats();
  EXPECT_EQ(s["prompt_is_ids"][1], false);
}

// A loopback port with nothing listening on it.
int unused_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

TEST_F(BenchServeE2E, ServerDownExitsOneWithTheReason) {
  const std::string url = "http://127.0.0.1:" + std::to_string(unused_port());
  const std::string args = "bench serve --base-url " + url + " --model mock " + tokenizer_flag() +
                           " --random-input-len 4 --random-output-len 2 --num-prompts 3";
  auto r = run_cli(args + " --ready-check-timeout-sec 1");
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find("initial test request to " + url + "/v1/completions failed"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("onnect"), std::string::npos) << r.out;  // libcurl's "Couldn't connect" / "Connection refused"
  r = run_cli(args + " --ready-check-timeout-sec 0");
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find("Failed requests:                         3"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("all 3 requests failed"), std::string::npos) << r.out;
  // No --model and nothing to ask: a clear error too.
  r = run_cli("bench serve --base-url " + url + " " + tokenizer_flag() + " --num-prompts 1");
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find("/v1/models"), std::string::npos) << r.out;
}

TEST_F(BenchServeE2E, BadFlagsExitTwoNamingTheFlag) {
  const std::string base = "bench serve --base-url http://127.0.0.1:9 --model m ";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {tokenizer_flag() + " --random-range-ratio 1.5", "--random-range-ratio"},
      {tokenizer_flag() + " --endpoint /v1/models", "--endpoint"},
      {"--tokenizer /no/such/dir", "--tokenizer"},
      {"", "--tokenizer"},
      {tokenizer_flag() + " --extra-body '[1]'", "--extra-body"},
      {tokenizer_flag() + " --dataset-name sharegpt", "--dataset-name"},
      {tokenizer_flag() + " --header novalue", "--header"},
      {tokenizer_flag() + " --metric-percentiles 99,abc", "--metric-percentiles"},
      {tokenizer_flag() + " --percentile-metrics ttft,foo", "--percentile-metrics"},
      {tokenizer_flag() + " --num-prompts 0", "--num-prompts"},
      {tokenizer_flag() + " --request-rate -1", "--request-rate"},
  };
  for (const auto& [flags, name] : cases) {
    const auto r = run_cli(base + flags);
    EXPECT_EQ(r.status, 2) << flags << "\n" << r.out;
    EXPECT_NE(r.out.find(name), std::string::npos) << flags << "\n" << r.out;
  }
}

TEST_F(BenchServeE2E, BenchKeepsItsFlagsBesideServe) {
  auto r = run_cli("bench --help");
  EXPECT_EQ(r.status, 0) << r.out;
  for (const char* flag : {"--input-lens", "--batch-sizes", "--json-out", "serve"}) {
    EXPECT_NE(r.out.find(flag), std::string::npos) << flag;
  }
  r = run_cli("bench serve --help");
  EXPECT_EQ(r.status, 0) << r.out;
  for (const char* flag : {"--base-url", "--max-concurrency", "--request-rate", "--random-prefix-len", "--save-result",
                           "--burstiness", "--ignore-eos"}) {
    EXPECT_NE(r.out.find(flag), std::string::npos) << flag;
  }
  EXPECT_EQ(run_cli("bench serve --no-such-flag").status, 2);
}

}  // namespace
}  // namespace chimera
