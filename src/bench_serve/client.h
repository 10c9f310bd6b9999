// The HTTP side of `chimera bench serve`: every request a streaming POST on libcurl's multi interface, all on
// the calling thread (one poll loop drives every connection, so a thousand streams need no thread each).
// Requests start at their arrival offsets, at most max_concurrency at once (later arrivals wait for a free slot,
// as vLLM's semaphore; a request's clock starts when it is sent). Each response is read as SSE: the first
// chunk with non-empty `choices` gives TTFT, each later one an ITL gap, a chunk with `usage` the output tokens.
// Nothing a server sends can crash the run: connection errors, HTTP errors, malformed SSE or JSON and an
// `error` object in the stream each fail that one request with a message naming what went wrong.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench_serve/metrics.h"

namespace chimera::bench_serve {

struct ClientConfig {
  std::string api_url;               // base URL + endpoint
  bool chat = false;                 // the endpoint is chat/completions: read delta.content, not text
  std::vector<std::string> headers;  // extra "Name: value" lines, after the defaults
  std::string api_key;               // "" = no Authorization header
  int64_t max_concurrency = 0;       // 0 = unlimited
};

struct PreparedRequest {
  std::string body;  // the JSON payload
  int64_t prompt_len = 0;
  // The request, if any (>= 0, an earlier index), that must have finished before this one is sent (the previous
  // turn of a conversation). Requests still go out in order: a waiting one holds back those after it.
  int64_t after = -1;
};

struct RunResult {
  std::vector<RequestOutput> outputs;  // in request order
  double duration_s = 0.0;             // from the run's start until the last request finished
};

// The payload of one streaming request, as vLLM's openai backends send it: model, prompt (token ids) or
// messages (text), max_tokens / max_completion_tokens, stream with include_usage, ignore_eos when set, then
// extra_body's fields on top.
nlohmann::json make_payload(const std::string& model, bool chat, const std::vector<int32_t>& prompt_ids,
                            const std::string& prompt_text, int64_t max_tokens, bool ignore_eos,
                            const nlohmann::json& extra_body);

RunResult run_requests(const ClientConfig& cfg, const std::vector<PreparedRequest>& requests,
                       const std::vector<double>& arrivals);

// GET base_url/v1/models: the first model's id. Throws runtime_error with the reason when that fails.
std::string first_model_id(const std::string& base_url, const ClientConfig& cfg);
// GET base_url/metrics: the Prometheus text, or nullopt when the server has none (any failure or non-200 answer).
std::optional<std::string> scrape_metrics(const std::string& base_url, const ClientConfig& cfg);

}  // namespace chimera::bench_serve
