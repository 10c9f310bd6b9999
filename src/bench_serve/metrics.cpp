#include "bench_serve/metrics.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
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

namespace {
// Calls fn(metric, line, labels_at, value) for each sample line of a Prometheus text: metric is the name after its
// last ':' (the prefix dropped), labels_at the position of '{' in line (npos without labels). Comments, blank and
// malformed lines are skipped.
template <typename Fn>
void for_each_sample(const std::string& text, Fn fn) {
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(pos, end - pos);
    pos = end + 1;
    if (line.empty() || line[0] == '#') continue;
    // name{labels} value
    const size_t brace = line.find('{'), space = line.rfind(' ');
    if (space == std::string::npos) continue;
    const std::string name = line.substr(0, std::min(brace, space));
    const size_t colon = name.rfind(':');
    const std::string metric = colon == std::string::npos ? name : name.substr(colon + 1);
    char* stop = nullptr;
    const std::string value_text = line.substr(space + 1);
    const double v = std::strtod(value_text.c_str(), &stop);
    if (stop == value_text.c_str() || !std::isfinite(v)) continue;
    fn(metric, line, brace < space ? brace : std::string::npos, v);
  }
}
}  // namespace

SpecDecodeCounters parse_spec_decode_counters(const std::string& text) {
  SpecDecodeCounters c;
  for_each_sample(text, [&c](const std::string& metric, const std::string& line, size_t brace, double v) {
    if (metric == "spec_decode_num_drafts" || metric == "spec_decode_num_drafts_total") {
      c.drafts += v;
    } else if (metric == "spec_decode_num_draft_tokens" || metric == "spec_decode_num_draft_tokens_total") {
      c.draft_tokens += v;
    } else if (metric == "spec_decode_num_accepted_tokens" || metric == "spec_decode_num_accepted_tokens_total") {
      c.accepted_tokens += v;
    } else if (metric == "spec_decode_num_accepted_tokens_per_pos" ||
               metric == "spec_decode_num_accepted_tokens_per_pos_total") {
      const size_t at = line.find("position=\"");
      if (at == std::string::npos || brace == std::string::npos || at > line.rfind(' ')) return;
      const long p = std::strtol(line.c_str() + at + 10, nullptr, 10);
      if (p < 0 || p > 64) return;
      if (c.accepted_per_position.size() <= static_cast<size_t>(p)) c.accepted_per_position.resize(p + 1, 0.0);
      c.accepted_per_position[static_cast<size_t>(p)] += v;
    } else {
      return;
    }
    c.present = true;
  });
  return c;
}

PrefixCacheCounters parse_prefix_cache_counters(const std::string& text) {
  PrefixCacheCounters c;
  for_each_sample(text, [&c](const std::string& metric, const std::string&, size_t, double v) {
    if (metric == "prefix_cache_queries" || metric == "prefix_cache_queries_total") {
      c.queries += v;
    } else if (metric == "prefix_cache_hits" || metric == "prefix_cache_hits_total") {
      c.hits += v;
    } else {
      return;
    }
    c.present = true;
  });
  return c;
}

SpecDecodeResult spec_decode_delta(const SpecDecodeCounters& before, const SpecDecodeCounters& after) {
  SpecDecodeResult r;
  r.drafts = after.drafts - before.drafts;
  r.draft_tokens = after.draft_tokens - before.draft_tokens;
  r.accepted_tokens = after.accepted_tokens - before.accepted_tokens;
  if (r.draft_tokens > 0) r.acceptance_rate = r.accepted_tokens / r.draft_tokens;
  if (r.drafts > 0) r.acceptance_length = 1.0 + r.accepted_tokens / r.drafts;
  for (size_t i = 0; i < after.accepted_per_position.size(); ++i) {
    const double b = i < before.accepted_per_position.size() ? before.accepted_per_position[i] : 0.0;
    r.per_position_rate.push_back(r.drafts > 0 ? (after.accepted_per_position[i] - b) / r.drafts : 0.0);
  }
  return r;
}

}  // namespace chimera::bench_serve
