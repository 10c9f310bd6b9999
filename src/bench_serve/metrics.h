// The arithmetic of `chimera bench serve`: per-request timings -> the aggregate numbers vLLM's `vllm bench serve`
// prints and saves, with its definitions:
//   TTFT   time from sending the request to the first chunk whose `choices` is non-empty
//   ITL    the gaps between consecutive such chunks (all requests' gaps pooled)
//   TPOT   per request (e2e - ttft) / (output_tokens - 1), only for requests with more than one output token
//   E2EL   time from sending the request to its last content chunk
// Mean, median, standard deviation (population) and percentiles (numpy's default linear interpolation) over
// the successful requests; 0 for an empty set. Throughputs divide by the benchmark's wall duration.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace chimera::bench_serve {

// One request as the client saw it. Times in seconds; start_time on the run's clock (seconds since its start).
struct RequestOutput {
  bool success = false;
  int64_t prompt_len = 0;
  int64_t output_tokens = 0;   // completion_tokens of the usage block; 0 when the server sent none
  int64_t content_chunks = 0;  // chunks with non-empty `choices`
  double start_time = 0.0;
  double ttft = 0.0;
  double latency = 0.0;     // e2e
  std::vector<double> itl;  // gaps between content chunks
  std::string generated_text;
  std::string error;
  long http_status = 0;  // 0: no HTTP response (connection refused, reset, ...)
};

// Mean / median / std / requested percentiles of one metric, in milliseconds.
struct MetricStats {
  double mean_ms = 0.0;
  double median_ms = 0.0;
  double std_ms = 0.0;
  std::vector<std::pair<double, double>> percentiles_ms;  // (p, value)
};

struct BenchmarkMetrics {
  int64_t completed = 0;
  int64_t failed = 0;
  int64_t total_input = 0;
  int64_t total_output = 0;
  double request_throughput = 0.0;
  double output_throughput = 0.0;
  double total_token_throughput = 0.0;
  MetricStats ttft, tpot, itl, e2el;
  // Most output tokens in one whole-second bucket from the first request's start, and the most requests
  // active in any one bucket.
  double max_output_tokens_per_s = 0.0;
  int64_t max_concurrent_requests = 0;
};

// numpy.percentile(values, p) with the default ("linear") method; 0 for no values. p in [0, 100].
double percentile(std::vector<double> values, double p);
double mean(const std::vector<double>& values);
double stddev(const std::vector<double>& values);  // population (numpy.std's ddof=0)

// values in seconds -> stats in milliseconds.
MetricStats summarize(const std::vector<double>& values_s, const std::vector<double>& percentiles);

BenchmarkMetrics compute_metrics(const std::vector<RequestOutput>& outputs, double duration_s,
                                 const std::vector<double>& percentiles);

// The speculative-decoding counters of a server's /metrics text (Prometheus exposition): the series named
// <prefix>:spec_decode_num_drafts, _num_draft_tokens, _num_accepted_tokens and _num_accepted_tokens_per_pos{position}
// whatever the prefix (chimera: or vllm:), summed over their other labels. `present` is false when the text has none
// (a server without speculative decoding). Malformed lines are skipped.
struct SpecDecodeCounters {
  bool present = false;
  double drafts = 0, draft_tokens = 0, accepted_tokens = 0;
  std::vector<double> accepted_per_position;
};
SpecDecodeCounters parse_spec_decode_counters(const std::string& prometheus_text);

// What a benchmark run added to the counters (after - before): acceptance rate = accepted / draft tokens,
// acceptance length = 1 + accepted / drafts (the tokens a verify step emits), per position accepted / drafts.
struct SpecDecodeResult {
  double drafts = 0, draft_tokens = 0, accepted_tokens = 0;
  double acceptance_rate = 0, acceptance_length = 1;
  std::vector<double> per_position_rate;
};
SpecDecodeResult spec_decode_delta(const SpecDecodeCounters& before, const SpecDecodeCounters& after);

// The prefix-cache counters of a server's /metrics text: <prefix>:prefix_cache_queries and prefix_cache_hits (tokens,
// with or without the _total suffix), summed over their labels; `present` false when the text has neither.
struct PrefixCacheCounters {
  bool present = false;
  double queries = 0, hits = 0;
};
PrefixCacheCounters parse_prefix_cache_counters(const std::string& prometheus_text);

}  // namespace chimera::bench_serve
