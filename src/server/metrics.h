// Prometheus metrics in the text exposition format, with vLLM's metric names and meanings under the
// `chimera:` prefix, labelled model_name (vLLM's v1 engine: vllm/v1/metrics/loggers.py):
//   gauges      num_requests_running, num_requests_waiting, kv_cache_usage_perc (0..1 of the KV blocks)
//   counters    prompt_tokens_total, generation_tokens_total, request_success_total{finished_reason}, and with
//               speculative decoding spec_decode_num_drafts, spec_decode_num_draft_tokens,
//               spec_decode_num_accepted_tokens, spec_decode_num_accepted_tokens_per_pos{position};
//               prefix_cache_queries_total, prefix_cache_hits_total (tokens), prefix_cache_restores_total,
//               mamba_checkpoints_saved_total
//   gauges of prefix caching: mamba_checkpoints (held), mamba_checkpoint_capacity
//   histograms  time_to_first_token_seconds, inter_token_latency_seconds, e2e_request_latency_seconds,
//               request_queue_time_seconds, request_prompt_tokens, request_generation_tokens
// Thread-safe: the engine thread records, HTTP threads render.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "runtime/prefix_cache.h"

namespace chimera::server {

class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void observe(double v);
  // `name`_bucket{...,le="x"} (cumulative), _bucket{le="+Inf"}, _sum, _count.
  void render(std::string& out, const std::string& name, const std::string& labels) const;
  uint64_t count() const { return count_; }
  double sum() const { return sum_; }

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // per bucket, not cumulative
  double sum_ = 0.0;
  uint64_t count_ = 0;
};

// vLLM's 1-2-5 buckets up to `max` (request_prompt_tokens / request_generation_tokens).
std::vector<double> buckets_1_2_5(double max);

struct EngineGauges {
  int64_t running = 0;
  int64_t waiting = 0;
  double kv_cache_usage = 0.0;  // 0..1
};

class Metrics {
 public:
  Metrics(std::string model_name, int32_t max_model_len);

  void add_prompt_tokens(int64_t n);
  void add_generation_tokens(int64_t n);
  void observe_ttft(double seconds);
  void observe_inter_token(double seconds);
  // A finished request (one sequence, as vLLM counts): finished_reason "stop", "length", "abort" or "error".
  void record_finished(const std::string& finished_reason, int64_t prompt_tokens, int64_t generation_tokens,
                       double e2e_seconds, double queue_seconds);
  void set_gauges(const EngineGauges& g);
  EngineGauges gauges() const;
  // The engine's speculative-decoding counters so far (runtime/speculative.h), rendered only once set.
  void set_speculative(int64_t drafts, int64_t draft_tokens, int64_t accepted_tokens,
                       std::vector<int64_t> accepted_per_position);

  // Prefix caching (runtime/prefix_cache.h): token counts so far and the Mamba checkpoint pool's use.
  void set_prefix_cache(const PrefixCacheStats& stats, int32_t checkpoints, int32_t checkpoint_capacity);

  std::string render() const;

 private:
  mutable std::mutex mu_;
  std::string labels_;  // model_name="..."
  EngineGauges gauges_;
  int64_t prompt_tokens_ = 0;
  int64_t generation_tokens_ = 0;
  std::map<std::string, int64_t> success_;  // by finished_reason
  bool speculative_ = false;
  int64_t spec_drafts_ = 0, spec_draft_tokens_ = 0, spec_accepted_ = 0;
  std::vector<int64_t> spec_accepted_per_pos_;
  PrefixCacheStats prefix_;
  int32_t checkpoints_ = 0, checkpoint_capacity_ = 0;
  Histogram ttft_, itl_, e2e_, queue_, prompt_len_, gen_len_;
};

// Prometheus label value escaping (backslash, double quote, newline).
std::string escape_label(const std::string& v);

}  // namespace chimera::server
