#include "bench_serve/metrics.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace chimera::bench_serve {

double percentile(std::vector<double> values, double p) {
  if (values.empty()) return 0.0;
  std::sort(values.begin(), values.end());
  const double rank = p / 100.0 * static_cast<double>(values.size() - 1);
  const auto lo = static_cast<size_t>(std::floor(rank));
  const auto hi = static_cast<size_t>(std::ceil(rank));
  return values[lo] + (values[hi] - values[lo]) * (rank - static_cast<double>(lo));
}

double mean(const std::vector<double>& values) {
  if (values.empty()) return 0.0;
  return std::accumulate(values.begin(), values.end(), 0.0) / static_cast<double>(values.size());
}

double stddev(const std::vector<double>& values) {
  if (values.empty()) return 0.0;
  const double m = mean(values);
  double ss = 0.0;
  for (double v : values) ss += (v - m) * (v - m);
  return std::sqrt(ss / static_cast<double>(values.size()));
}

MetricStats summarize(const std::vector<double>& values_s, const std::vector<double>& percentiles) {
  MetricStats s;
  s.mean_ms = mean(values_s) * 1000.0;
  s.median_ms = percentile(values_s, 50.0) * 1000.0;
  s.std_ms = stddev(values_s) * 1000.0;
  for (double p : percentiles) s.percentiles_ms.emplace_back(p, percentile(values_s, p) * 1000.0);
  return s;
}

BenchmarkMetrics compute_metrics(const std::vector<RequestOutput>& outputs, double duration_s,
                                 const std::vector<double>& percentiles) {
  BenchmarkMetrics m;
  std::vector<double> ttfts, tpots, itls, e2els;
  double min_start = 0.0, max_end = 0.0;
  bool any = false;
  for (const RequestOutput& o : outputs) {
    if (!o.success) {
      ++m.failed;
      continue;
    }
    ++m.completed;
    m.total_input += o.prompt_len;
    m.total_output += o.output_tokens;
    if (o.output_tokens > 1) tpots.push_back((o.latency - o.ttft) / static_cast<double>(o.output_tokens - 1));
    itls.insert(itls.end(), o.itl.begin(), o.itl.end());
    ttfts.push_back(o.ttft);
    e2els.push_back(o.latency);
    min_start = any ? std::min(min_start, o.start_time) : o.start_time;
    max_end = any ? std::max(max_end, o.start_time + o.latency) : o.start_time + o.latency;
    any = true;
  }
  if (duration_s > 0.0) {
    m.request_throughput = static_cast<double>(m.completed) / duration_s;
    m.output_throughput = static_cast<double>(m.total_output) / duration_s;
    m.total_token_throughput = static_cast<double>(m.total_input + m.total_output) / duration_s;
  }
  m.ttft = summarize(ttfts, percentiles);
  m.tpot = summarize(tpots, percentiles);
  m.itl = summarize(itls, percentiles);
  m.e2el = summarize(e2els, percentiles);

  // Peak output throughput: each content chunk's arrival (start + ttft + the running sum of the gaps) counted
  // in whole-second buckets from the earliest start; a request counts as active in every bucket it touches.
  if (any) {
    const auto buckets = static_cast<size_t>(std::ceil(max_end - min_start)) + 1;
    std::vector<double> tokens(buckets, 0.0);
    std::vector<int64_t> active(buckets, 0);
    auto bucket_of = [&](double t) { return static_cast<int64_t>(t - min_start); };
    for (const RequestOutput& o : outputs) {
      if (!o.success) continue;
      double t = o.start_time + o.ttft;
      auto add = [&](double when) {
        const int64_t b = bucket_of(when);
        if (b >= 0 && static_cast<size_t>(b) < buckets) tokens[static_cast<size_t>(b)] += 1.0;
      };
      add(t);
      for (double gap : o.itl) add(t += gap);
      const int64_t first = bucket_of(o.start_time), last = bucket_of(o.start_time + o.latency);
      for (int64_t b = std::max<int64_t>(first, 0); b <= last && static_cast<size_t>(b) < buckets; ++b) {
        ++active[static_cast<size_t>(b)];
      }
    }
    m.max_output_tokens_per_s = *std::max_element(tokens.begin(), tokens.end());
    m.max_concurrent_requests = *std::max_element(active.begin(), active.end());
  }
  return m;
}

}  // namespace chimera::bench_serve
