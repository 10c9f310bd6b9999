#include "server/metrics.h"

#include <algorithm>

#include <fmt/format.h>

namespace chimera::server {

namespace {
// vLLM's bucket boundaries for the latency histograms.
const std::vector<double> kTtftBuckets = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,   0.25,  0.5,   0.75,
                                          1.0,   2.5,   5.0,  7.5,  10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0};
const std::vector<double> kItlBuckets = {0.01, 0.025, 0.05, 0.075, 0.1,  0.15, 0.2,  0.3,  0.4, 0.5,
                                         0.75, 1.0,   2.5,  5.0,   7.5,  10.0, 20.0, 40.0, 80.0};
const std::vector<double> kRequestLatencyBuckets = {0.3,  0.5,  0.8,  1.0,  1.5,   2.0,   2.5,   5.0,    10.0,   15.0,  20.0,
                                                    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};

std::string fmt_value(double v) { return fmt::format("{}", v); }
}  // namespace

std::vector<double> buckets_1_2_5(double max) {
  std::vector<double> b;
  for (double scale = 1.0;; scale *= 10.0) {
    for (double m : {1.0, 2.0, 5.0}) {
      if (m * scale > max) return b;
      b.push_back(m * scale);
    }
  }
}

std::string escape_label(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '\\') out += "\\\\";
    else if (c == '"') out += "\\\"";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
  return out;
}

Histogram::Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::observe(double v) {
  const size_t i = std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin();  // le: v <= bound
  ++counts_[i];
  sum_ += v;
  ++count_;
}

void Histogram::render(std::string& out, const std::string& name, const std::string& labels) const {
  uint64_t cum = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cum += counts_[i];
    out += fmt::format("{}_bucket{{{},le=\"{}\"}} {}\n", name, labels, fmt_value(bounds_[i]), cum);
  }
  out += fmt::format("{}_bucket{{{},le=\"+Inf\"}} {}\n", name, labels, count_);
  out += fmt::format("{}_sum{{{}}} {}\n", name, labels, fmt_value(sum_));
  out += fmt::format("{}_count{{{}}} {}\n", name, labels, count_);
}

Metrics::Metrics(std::string model_name, int32_t max_model_len)
    : labels_(fmt::format("model_name=\"{}\"", escape_label(model_name))),
      ttft_(kTtftBuckets),
      itl_(kItlBuckets),
      e2e_(kRequestLatencyBuckets),
      queue_(kRequestLatencyBuckets),
      prompt_len_(buckets_1_2_5(max_model_len)),
      gen_len_(buckets_1_2_5(max_model_len)) {
  for (const char* r : {"stop", "length", "abort", "error"}) success_[r] = 0;
}

void Metrics::add_prompt_tokens(int64_t n) {
  std::lock_guard lock(mu_);
  prompt_tokens_ += n;
}
void Metrics::set_speculative(int64_t drafts, int64_t draft_tokens, int64_t accepted_tokens,
                              std::vector<int64_t> accepted_per_position) {
  std::lock_guard lock(mu_);
  speculative_ = true;
  spec_drafts_ = drafts;
  spec_draft_tokens_ = draft_tokens;
  spec_accepted_ = accepted_tokens;
  spec_accepted_per_pos_ = std::move(accepted_per_position);
}

void Metrics::set_prefix_cache(const PrefixCacheStats& stats, int32_t checkpoints, int32_t checkpoint_capacity) {
  std::lock_guard lock(mu_);
  prefix_ = stats;
  checkpoints_ = checkpoints;
  checkpoint_capacity_ = checkpoint_capacity;
}

void Metrics::add_generation_tokens(int64_t n) {
  std::lock_guard lock(mu_);
  generation_tokens_ += n;
}
void Metrics::observe_ttft(double s) {
  std::lock_guard lock(mu_);
  ttft_.observe(s);
}
void Metrics::observe_inter_token(double s) {
  std::lock_guard lock(mu_);
  itl_.observe(s);
}
void Metrics::record_finished(const std::string& reason, int64_t prompt_tokens, int64_t generation_tokens,
                              double e2e_seconds, double queue_seconds) {
  std::lock_guard lock(mu_);
  ++success_[reason];
  prompt_len_.observe(static_cast<double>(prompt_tokens));
  gen_len_.observe(static_cast<double>(generation_tokens));
  e2e_.observe(e2e_seconds);
  queue_.observe(queue_seconds);
}
void Metrics::set_gauges(const EngineGauges& g) {
  std::lock_guard lock(mu_);
  gauges_ = g;
}
EngineGauges Metrics::gauges() const {
  std::lock_guard lock(mu_);
  return gauges_;
}

std::string Metrics::render() const {
  std::lock_guard lock(mu_);
  std::string out;
  auto head = [&](const char* name, const char* type, const char* help) {
    out += fmt::format("# HELP chimera:{} {}\n# TYPE chimera:{} {}\n", name, help, name, type);
  };
  head("num_requests_running", "gauge", "Number of requests in model execution batches.");
  out += fmt::format("chimera:num_requests_running{{{}}} {}\n", labels_, gauges_.running);
  head("num_requests_waiting", "gauge", "Number of requests waiting to be processed.");
  out += fmt::format("chimera:num_requests_waiting{{{}}} {}\n", labels_, gauges_.waiting);
  head("kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.");
  out += fmt::format("chimera:kv_cache_usage_perc{{{}}} {}\n", labels_, fmt_value(gauges_.kv_cache_usage));
  head("prompt_tokens_total", "counter", "Number of prefill tokens processed.");
  out += fmt::format("chimera:prompt_tokens_total{{{}}} {}\n", labels_, prompt_tokens_);
  head("generation_tokens_total", "counter", "Number of generation tokens processed.");
  out += fmt::format("chimera:generation_tokens_total{{{}}} {}\n", labels_, generation_tokens_);
  // vLLM's prefix-cache counters (tokens), and the Mamba checkpoints behind them.
  head("prefix_cache_queries_total", "counter", "Prefix cache queries, in terms of number of queried tokens.");
  out += fmt::format("chimera:prefix_cache_queries_total{{{}}} {}\n", labels_, prefix_.queries);
  head("prefix_cache_hits_total", "counter", "Prefix cache hits, in terms of number of cached tokens.");
  out += fmt::format("chimera:prefix_cache_hits_total{{{}}} {}\n", labels_, prefix_.hits);
  head("prefix_cache_restores_total", "counter", "Requests admitted on a cached prefix.");
  out += fmt::format("chimera:prefix_cache_restores_total{{{}}} {}\n", labels_, prefix_.restores);
  head("mamba_checkpoints_saved_total", "counter", "Mamba state checkpoints written.");
  out += fmt::format("chimera:mamba_checkpoints_saved_total{{{}}} {}\n", labels_, prefix_.checkpoints_saved);
  head("mamba_checkpoints", "gauge", "Mamba state checkpoints held.");
  out += fmt::format("chimera:mamba_checkpoints{{{}}} {}\n", labels_, checkpoints_);
  head("mamba_checkpoint_capacity", "gauge", "Mamba state checkpoint slots.");
  out += fmt::format("chimera:mamba_checkpoint_capacity{{{}}} {}\n", labels_, checkpoint_capacity_);
  if (speculative_) {  // vLLM's spec-decode counters
    head("spec_decode_num_drafts", "counter", "Number of spec decoding drafts.");
    out += fmt::format("chimera:spec_decode_num_drafts{{{}}} {}\n", labels_, spec_drafts_);
    head("spec_decode_num_draft_tokens", "counter", "Number of draft tokens.");
    out += fmt::format("chimera:spec_decode_num_draft_tokens{{{}}} {}\n", labels_, spec_draft_tokens_);
    head("spec_decode_num_accepted_tokens", "counter", "Number of accepted tokens.");
    out += fmt::format("chimera:spec_decode_num_accepted_tokens{{{}}} {}\n", labels_, spec_accepted_);
    head("spec_decode_num_accepted_tokens_per_pos", "counter", "Accepted tokens per draft position.");
    for (size_t i = 0; i < spec_accepted_per_pos_.size(); ++i) {
      out += fmt::format("chimera:spec_decode_num_accepted_tokens_per_pos{{{},position=\"{}\"}} {}\n", labels_, i,
                         spec_accepted_per_pos_[i]);
    }
  }
  head("request_success_total", "counter", "Count of successfully processed requests.");
  for (const auto& [reason, n] : success_) {
    out += fmt::format("chimera:request_success_total{{{},finished_reason=\"{}\"}} {}\n", labels_,
                       escape_label(reason), n);
  }
  const struct {
    const char* name;
    const char* help;
    const Histogram& h;
  } hists[] = {
      {"time_to_first_token_seconds", "Histogram of time to first token in seconds.", ttft_},
      {"inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", itl_},
      {"e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", e2e_},
      {"request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", queue_},
      {"request_prompt_tokens", "Number of prefill tokens processed.", prompt_len_},
      {"request_generation_tokens", "Number of generation tokens processed.", gen_len_},
  };
  for (const auto& h : hists) {
    head(h.name, "histogram", h.help);
    h.h.render(out, std::string("chimera:") + h.name, labels_);
  }
  return out;
}

}  // namespace chimera::server
