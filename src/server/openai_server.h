// The OpenAI-compatible routes over an EngineLoop: /v1/completions, /v1/chat/completions, /v1/models, /health,
// /version, /tokenize, /detokenize, /metrics. Each generation request becomes one engine sequence per prompt
// and choice (n); its tokens come back on the connection's strand, where they are detokenized per choice
// (StreamingDecoder), cut at stop strings (StopMatcher) and written as SSE chunks or one JSON response.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "chat/chat_template.h"
#include "server/engine_loop.h"
#include "server/http_server.h"
#include "server/metrics.h"
#include "tokenizer/tokenizer.h"

namespace chimera::server {

struct ServerConfig {
  std::string served_model_name;
  std::string api_key;  // "" = no authentication
  int32_t max_model_len = 4096;
  int64_t vocab_size = 0;
  std::string version = "0.1.0";
  int32_t retry_after_s = 1;  // Retry-After of a 503
  std::string reasoning_parser;  // "" or "nemotron_v3": reasoning_content
  std::string tool_call_parser;  // "" or "nemotron_v3": tool_calls
};

class OpenAiServer {
 public:
  // `tokenizer` may be null (a synthetic model without one): text prompts are then refused with 400.
  // `chat_template` may be null (the model has none): /v1/chat/completions then answers 400.
  OpenAiServer(ServerConfig config, const Tokenizer* tokenizer, const chat::ChatTemplate* chat_template,
               EngineLoop& loop, Metrics& metrics);
  void handle(HttpRequest request, std::shared_ptr<Responder> responder);

 private:
  void generate(const HttpRequest& req, const std::shared_ptr<Responder>& r, bool chat);
  void tokenize(const HttpRequest& req, const std::shared_ptr<Responder>& r);
  void detokenize(const HttpRequest& req, const std::shared_ptr<Responder>& r);
  std::string new_id(const char* prefix);

  ServerConfig config_;
  const Tokenizer* tokenizer_;
  const chat::ChatTemplate* chat_template_;
  EngineLoop& loop_;
  Metrics& metrics_;
  // The reasoning parser's <think> / </think> token ids where the tokenizer writes each tag as one token (-1:
  // not, and the parser finds the tags in the text).
  int32_t think_open_id_ = -1, think_close_id_ = -1;
  std::atomic<uint64_t> next_id_{0};
  uint64_t id_salt_;
};

}  // namespace chimera::server
