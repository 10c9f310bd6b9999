// The arithmetic of chimera bench serve on synthetic timings: percentiles as numpy's default (linear)
// method (values from Python's statistics.quantiles(method='inclusive'), the same interpolation), population
// std, and vLLM's TTFT / TPOT / ITL / E2EL / throughput definitions.
#include "bench_serve/metrics.h"

#include <gtest/gtest.h>

namespace chimera::bench_serve {
namespace {

TEST(BenchServeMetrics, PercentileMatchesLinearInterpolation) {
  const std::vector<double> a = {0.5, 0.1, 0.3, 0.9, 0.7};  // unsorted on purpose
  EXPECT_NEAR(percentile(a, 99.0), 0.892, 1e-12);
  EXPECT_NEAR(percentile(a, 50.0), 0.5, 1e-12);
  EXPECT_NEAR(percentile(a, 25.0), 0.3, 1e-12);
  EXPECT_NEAR(percentile(a, 0.0), 0.1, 1e-12);
  EXPECT_NEAR(percentile(a, 100.0), 0.9, 1e-12);
  EXPECT_NEAR(stddev(a), 0.282842712474619, 1e-12);
  EXPECT_NEAR(mean(a), 0.5, 1e-12);
  const std::vector<double> b = {1.0, 2.0, 3.0, 4.0};
  EXPECT_NEAR(percentile(b, 99.0), 3.97, 1e-12);
  EXPECT_NEAR(percentile(b, 99.9), 3.997, 1e-12);
  EXPECT_NEAR(percentile(b, 50.0), 2.5, 1e-12);  // the median of an even count
  EXPECT_NEAR(stddev(b), 1.118033988749895, 1e-12);
  EXPECT_EQ(percentile({}, 99.0), 0.0);
  EXPECT_EQ(mean({}), 0.0);
  EXPECT_EQ(stddev({}), 0.0);
  EXPECT_EQ(percentile({7.0}, 99.0), 7.0);
}

TEST(BenchServeMetrics, SummarizeIsInMilliseconds) {
  const MetricStats s = summarize({0.001, 0.002, 0.003, 0.004}, {50.0, 99.0});
  EXPECT_NEAR(s.mean_ms, 2.5, 1e-9);
  EXPECT_NEAR(s.median_ms, 2.5, 1e-9);
  EXPECT_NEAR(s.std_ms, 1.118033988749895, 1e-9);
  ASSERT_EQ(s.percentiles_ms.size(), 2u);
  EXPECT_EQ(s.percentiles_ms[1].first, 99.0);
  EXPECT_NEAR(s.percentiles_ms[1].second, 3.97, 1e-9);
}

RequestOutput request(double start, double ttft, std::vector<double> itl, int64_t prompt, int64_t out) {
  RequestOutput r;
  r.success = true;
  r.start_time = start;
  r.ttft = ttft;
  r.itl = std::move(itl);
  double e2e = ttft;
  for (double g : r.itl) e2e += g;
  r.latency = e2e;
  r.prompt_len = prompt;
  r.output_tokens = out;
  return r;
}

TEST(BenchServeMetrics, TpotItlTtftE2elAndThroughput) {
  // A: ttft 0.1, 4 tokens in 4 chunks 0.02 apart -> e2e 0.16, tpot (0.16 - 0.1) / 3 = 0.02.
  // B: ttft 0.3, 3 tokens but 2 chunks (the server bundled two tokens into one chunk): gap 0.1, e2e 0.4,
  //    tpot (0.4 - 0.3) / 2 = 0.05 while its one ITL is 0.1 (TPOT counts tokens, ITL counts chunks).
  // C: one output token: no TPOT, no ITL. D: failed, counted apart and excluded from everything.
  std::vector<RequestOutput> outs = {request(0.0, 0.1, {0.02, 0.02, 0.02}, 10, 4), request(0.5, 0.3, {0.1}, 20, 3),
                                     request(1.0, 0.2, {}, 30, 1)};
  RequestOutput failed;
  failed.prompt_len = 99;
  failed.output_tokens = 99;
  failed.error = "HTTP 500";
  outs.push_back(failed);
  const BenchmarkMetrics m = compute_metrics(outs, 2.0, {99.0});
  EXPECT_EQ(m.completed, 3);
  EXPECT_EQ(m.failed, 1);
  EXPECT_EQ(m.total_input, 60);
  EXPECT_EQ(m.total_output, 8);
  EXPECT_NEAR(m.request_throughput, 1.5, 1e-12);
  EXPECT_NEAR(m.output_throughput, 4.0, 1e-12);
  EXPECT_NEAR(m.total_token_throughput, 34.0, 1e-12);
  EXPECT_NEAR(m.ttft.mean_ms, 200.0, 1e-9);
  EXPECT_NEAR(m.ttft.median_ms, 200.0, 1e-9);
  EXPECT_NEAR(m.tpot.mean_ms, 35.0, 1e-9);  // mean of 20 and 50
  EXPECT_NEAR(m.tpot.percentiles_ms[0].second, 20.0 + 30.0 * 0.99, 1e-9);
  // ITL pools every gap of every request: {20, 20, 20, 100}.
  EXPECT_NEAR(m.itl.mean_ms, 40.0, 1e-9);
  EXPECT_NEAR(m.itl.median_ms, 20.0, 1e-9);
  EXPECT_NEAR(m.itl.percentiles_ms[0].second, 20.0 + 80.0 * (0.99 * 3 - 2), 1e-9);
  EXPECT_NEAR(m.e2el.mean_ms, (160.0 + 400.0 + 200.0) / 3.0, 1e-9);
  // Buckets from t = 0: A's 4 chunks at 0.1..0.16 and B's 2 at 0.8, 0.9 fall in second 0, C's at 1.2 in 1.
  EXPECT_EQ(m.max_output_tokens_per_s, 6.0);
  // A and B are active in second 0; B (0.5..0.9) ends in second 0; C (1.0..1.2) is in second 1.
  EXPECT_EQ(m.max_concurrent_requests, 2);
}

TEST(BenchServeMetrics, AllFailedGivesZeros) {
  RequestOutput f;
  f.error = "connection refused";
  const BenchmarkMetrics m = compute_metrics({f, f}, 1.0, {99.0});
  EXPECT_EQ(m.completed, 0);
  EXPECT_EQ(m.failed, 2);
  EXPECT_EQ(m.total_output, 0);
  EXPECT_EQ(m.ttft.mean_ms, 0.0);
  EXPECT_EQ(m.tpot.percentiles_ms[0].second, 0.0);
  EXPECT_EQ(m.max_output_tokens_per_s, 0.0);
  EXPECT_EQ(m.max_concurrent_requests, 0);
}

// The spec-decode counters of /metrics, chimera's or vLLM's prefix, summed over label sets; deltas as rates.
TEST(BenchServeMetrics, SpecDecodeCountersFromPrometheusText) {
  const std::string before =
      "# HELP chimera:spec_decode_num_drafts Number of spec decoding drafts.\n"
      "chimera:spec_decode_num_drafts{model_name=\"m\"} 10\n"
      "chimera:spec_decode_num_draft_tokens{model_name=\"m\"} 30\n"
      "chimera:spec_decode_num_accepted_tokens{model_name=\"m\"} 12\n"
      "chimera:spec_decode_num_accepted_tokens_per_pos{model_name=\"m\",position=\"0\"} 8\n"
      "chimera:spec_decode_num_accepted_tokens_per_pos{model_name=\"m\",position=\"2\"} 1\n"
      "chimera:generation_tokens_total{model_name=\"m\"} 99\n";
  const std::string after =
      "vllm:spec_decode_num_drafts_total{engine=\"0\"} 60\n"
      "vllm:spec_decode_num_drafts_total{engine=\"1\"} 50\n"
      "vllm:spec_decode_num_draft_tokens_total{engine=\"0\"} 330\n"
      "vllm:spec_decode_num_accepted_tokens_total{engine=\"0\"} 212\n"
      "vllm:spec_decode_num_accepted_tokens_per_pos_total{engine=\"0\",position=\"0\"} 88\n"
      "vllm:spec_decode_num_accepted_tokens_per_pos_total{engine=\"0\",position=\"1\"} 50\n"
      "vllm:spec_decode_num_accepted_tokens_per_pos_total{engine=\"0\",position=\"2\"} 21\n"
      "broken line\nvllm:spec_decode_num_drafts_total{engine=\"2\"} nan\n";
  const SpecDecodeCounters b = parse_spec_decode_counters(before), a = parse_spec_decode_counters(after);
  EXPECT_TRUE(b.present);
  EXPECT_EQ(b.drafts, 10);
  EXPECT_EQ(b.accepted_per_position, (std::vector<double>{8, 0, 1}));
  EXPECT_EQ(a.drafts, 110);  // two engines' series summed; the nan skipped
  const SpecDecodeResult d = spec_decode_delta(b, a);
  EXPECT_EQ(d.drafts, 100);
  EXPECT_EQ(d.draft_tokens, 300);
  EXPECT_EQ(d.accepted_tokens, 200);
  EXPECT_DOUBLE_EQ(d.acceptance_rate, 200.0 / 300.0);
  EXPECT_DOUBLE_EQ(d.acceptance_length, 3.0);
  EXPECT_EQ(d.per_position_rate, (std::vector<double>{0.8, 0.5, 0.2}));
  EXPECT_FALSE(parse_spec_decode_counters("chimera:generation_tokens_total{} 5\n").present);
}

// The prefix-cache counters, either prefix, with or without _total, summed over label sets.
TEST(BenchServeMetrics, PrefixCacheCountersFromPrometheusText) {
  EXPECT_FALSE(parse_prefix_cache_counters("chimera:prompt_tokens_total{m=\"x\"} 5\n").present);
  const PrefixCacheCounters c = parse_prefix_cache_counters(
      "# TYPE chimera:prefix_cache_queries_total counter\n"
      "chimera:prefix_cache_queries_total{model_name=\"m\"} 1000\n"
      "chimera:prefix_cache_hits_total{model_name=\"m\"} 750\n"
      "vllm:prefix_cache_queries{engine=\"1\"} 10\n"
      "vllm:prefix_cache_hits{engine=\"1\"} nan\n");
  EXPECT_TRUE(c.present);
  EXPECT_EQ(c.queries, 1010);
  EXPECT_EQ(c.hits, 750);
}

}  // namespace
}  // namespace chimera::bench_serve
