// The OpenAI API's request side, as plain data: a request body (JSON) -> a validated GenerationRequest, or an
// ApiError carrying the HTTP status and OpenAI's error shape {"error": {"message", "type", "param", "code"}}.
// No HTTP library and no engine here, so the parser is unit-tested and fuzzed on its own.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace chimera::server {

// A client's mistake (4xx) or the server's refusal (503), with OpenAI's error fields.
class ApiError : public std::runtime_error {
 public:
  ApiError(int status, std::string message, std::string param = {}, std::string type = {});
  int status() const { return status_; }
  const std::string& type() const { return type_; }
  const std::string& param() const { return param_; }
  // {"error": {"message", "type", "param", "code"}}; code is the HTTP status as vLLM sends it.
  nlohmann::json to_json() const;

 private:
  int status_;
  std::string param_;
  std::string type_;
};

// The OpenAI type name of an HTTP status: 400 BadRequestError, 401 AuthenticationError, ...
std::string error_type_for_status(int status);

// One prompt of /v1/completions: text to tokenize, or token ids as given.
struct PromptInput {
  bool is_text = true;
  std::string text;
  std::vector<int32_t> ids;
};

// What both /v1/completions and /v1/chat/completions ask for, validated for type and range. Limits that need
// the model (vocabulary, --max-model-len) are checked where the prompt is tokenized.
struct GenerationRequest {
  bool chat = false;
  std::string model;  // "" = the served model
  std::vector<PromptInput> prompts;  // completions: one choice group per prompt
  nlohmann::json messages;           // chat: the list of messages as sent
  nlohmann::json tools;              // chat: null or the list of tools
  nlohmann::json chat_template_kwargs = nlohmann::json::object();
  bool add_generation_prompt = true;
  int32_t n = 1;
  std::optional<int32_t> max_tokens;  // max_tokens / max_completion_tokens; absent = up to --max-model-len
  float temperature = 1.0f;
  float top_p = 1.0f;
  int32_t top_k = 0;  // 0 (or -1 as sent by vLLM clients) = off
  float min_p = 0.0f;
  std::optional<uint64_t> seed;
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  float repetition_penalty = 1.0f;
  std::vector<std::string> stop;
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;
  bool skip_special_tokens = true;
  // completions: logprobs = N (top N alternatives, 0 = only the chosen token's); chat: logprobs = true and
  // top_logprobs = N. Absent = no logprobs.
  std::optional<int32_t> logprobs;
  // completions, vLLM's extension: the prompt tokens' logprobs with N alternatives each (choice field
  // "prompt_logprobs"); echo with logprobs asks for them too (logprobs then covers the prompt).
  std::optional<int32_t> prompt_logprobs;
  bool echo = false;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
};

// Limits of the request parser (OpenAI's and vLLM's where they have one).
inline constexpr int32_t kMaxN = 128;
inline constexpr int32_t kMaxLogprobs = 20;
inline constexpr size_t kMaxStopStrings = 16;
inline constexpr size_t kMaxPrompts = 1024;

// Parses a request body into a JSON object. Malformed JSON or a non-object -> ApiError 400.
nlohmann::json parse_json_body(std::string_view body);
// Validate one route's body (ApiError 400 naming the field on a wrong type or value).
GenerationRequest parse_completion_request(const nlohmann::json& body);
GenerationRequest parse_chat_request(const nlohmann::json& body);

}  // namespace chimera::server
