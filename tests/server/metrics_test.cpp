// The /metrics text: Prometheus exposition format with vLLM's names under chimera:, cumulative buckets, labels.
#include "server/metrics.h"

#include <gtest/gtest.h>

#include <sstream>

namespace chimera::server {
namespace {

bool has_line(const std::string& text, const std::string& line) {
  std::istringstream in(text);
  for (std::string l; std::getline(in, l);) {
    if (l == line) return true;
  }
  return false;
}

TEST(ServerMetrics, HistogramBucketsAreCumulative) {
  Histogram h({1.0, 2.0, 5.0});
  for (double v : {0.5, 1.0, 1.5, 3.0, 7.0}) h.observe(v);
  std::string out;
  h.render(out, "x", "a=\"b\"");
  EXPECT_TRUE(has_line(out, "x_bucket{a=\"b\",le=\"1\"} 2")) << out;  // le is inclusive
  EXPECT_TRUE(has_line(out, "x_bucket{a=\"b\",le=\"2\"} 3")) << out;
  EXPECT_TRUE(has_line(out, "x_bucket{a=\"b\",le=\"5\"} 4")) << out;
  EXPECT_TRUE(has_line(out, "x_bucket{a=\"b\",le=\"+Inf\"} 5")) << out;
  EXPECT_TRUE(has_line(out, "x_sum{a=\"b\"} 13")) << out;
  EXPECT_TRUE(has_line(out, "x_count{a=\"b\"} 5")) << out;
}

TEST(ServerMetrics, OneTwoFiveBuckets) {
  EXPECT_EQ(buckets_1_2_5(100), (std::vector<double>{1, 2, 5, 10, 20, 50, 100}));
  EXPECT_EQ(buckets_1_2_5(4096).back(), 2000);
}

// Speculative decoding's counters appear only once the engine reports them, under vLLM's spec_decode_* names.
TEST(ServerMetrics, SpeculativeDecodingCounters) {
  Metrics m("kjv", 256);
  EXPECT_EQ(m.render().find("spec_decode"), std::string::npos);
  m.set_speculative(21, 40, 24, {17, 7});
  const std::string out = m.render();
  EXPECT_NE(out.find("chimera:spec_decode_num_drafts{model_name=\"kjv\"} 21\n"), std::string::npos) << out;
  EXPECT_NE(out.find("chimera:spec_decode_num_draft_tokens{model_name=\"kjv\"} 40\n"), std::string::npos) << out;
  EXPECT_NE(out.find("chimera:spec_decode_num_accepted_tokens{model_name=\"kjv\"} 24\n"), std::string::npos) << out;
  EXPECT_NE(out.find("chimera:spec_decode_num_accepted_tokens_per_pos{model_name=\"kjv\",position=\"1\"} 7\n"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("# TYPE chimera:spec_decode_num_drafts counter"), std::string::npos) << out;
}

TEST(ServerMetrics, PrefixCacheCountersAndCheckpointGauges) {
  Metrics m("kjv", 256);
  std::string out = m.render();
  EXPECT_NE(out.find("chimera:prefix_cache_hits_total{model_name=\"kjv\"} 0\n"), std::string::npos) << out;
  m.set_prefix_cache(PrefixCacheStats{.queries = 900, .hits = 640, .restores = 5, .checkpoints_saved = 12}, 9, 40);
  out = m.render();
  EXPECT_NE(out.find("# TYPE chimera:prefix_cache_queries_total counter"), std::string::npos) << out;
  EXPECT_NE(out.find("chimera:prefix_cache_queries_total{model_name=\"kjv\"} 900\n"), std::string::npos) << out;
  EXPECT_NE(out.find("chimera:prefix_cache_hits_total{model_name=\"kjv\"} 640\n"), std::string::npos) << out;
  EXPECT_NE(out.find("chimera:prefix_cache_restores_total{model_name=\"kjv\"} 5\n"), std::string::npos) << out;
  EXPECT_NE(out.find("chimera:mamba_checkpoints_saved_total{model_name=\"kjv\"} 12\n"), std::string::npos) << out;
  EXPECT_NE(out.find("chimera:mamba_checkpoints{model_name=\"kjv\"} 9\n"), std::string::npos) << out;
  EXPECT_NE(out.find("chimera:mamba_checkpoint_capacity{model_name=\"kjv\"} 40\n"), std::string::npos) << out;
}

TEST(ServerMetrics, VllmNamesAndLabels) {
  Metrics m("my \"model\"", 4096);
  m.set_gauges({3, 2, 0.25});
  m.add_prompt_tokens(10);
  m.add_generation_tokens(7);
  m.observe_ttft(0.03);
  m.observe_inter_token(0.02);
  m.record_finished("stop", 10, 7, 0.4, 0.01);
  m.record_finished("abort", 5, 1, 0.2, 0.0);
  const std::string t = m.render();
  const std::string l = "model_name=\"my \\\"model\\\"\"";
  EXPECT_TRUE(has_line(t, "chimera:num_requests_running{" + l + "} 3")) << t;
  EXPECT_TRUE(has_line(t, "chimera:num_requests_waiting{" + l + "} 2")) << t;
  EXPECT_TRUE(has_line(t, "chimera:kv_cache_usage_perc{" + l + "} 0.25")) << t;
  EXPECT_TRUE(has_line(t, "chimera:prompt_tokens_total{" + l + "} 10")) << t;
  EXPECT_TRUE(has_line(t, "chimera:generation_tokens_total{" + l + "} 7")) << t;
  EXPECT_TRUE(has_line(t, "chimera:request_success_total{" + l + ",finished_reason=\"stop\"} 1")) << t;
  EXPECT_TRUE(has_line(t, "chimera:request_success_total{" + l + ",finished_reason=\"abort\"} 1")) << t;
  EXPECT_TRUE(has_line(t, "chimera:request_success_total{" + l + ",finished_reason=\"length\"} 0")) << t;
  EXPECT_TRUE(has_line(t, "# TYPE chimera:time_to_first_token_seconds histogram")) << t;
  EXPECT_TRUE(has_line(t, "chimera:time_to_first_token_seconds_bucket{" + l + ",le=\"0.04\"} 1")) << t;
  EXPECT_TRUE(has_line(t, "chimera:inter_token_latency_seconds_count{" + l + "} 1")) << t;
  EXPECT_TRUE(has_line(t, "chimera:e2e_request_latency_seconds_count{" + l + "} 2")) << t;
  EXPECT_TRUE(has_line(t, "chimera:request_queue_time_seconds_count{" + l + "} 2")) << t;
  EXPECT_TRUE(has_line(t, "chimera:request_prompt_tokens_sum{" + l + "} 15")) << t;
  EXPECT_TRUE(has_line(t, "chimera:request_generation_tokens_sum{" + l + "} 8")) << t;
  // Every sample line is NAME{labels} VALUE; every metric has HELP and TYPE.
  std::istringstream in(t);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("# HELP ", 0) == 0 || line.rfind("# TYPE ", 0) == 0) continue;
    EXPECT_EQ(line.rfind("chimera:", 0), 0u) << line;
    EXPECT_NE(line.find("} "), std::string::npos) << line;
  }
}

}  // namespace
}  // namespace chimera::server
