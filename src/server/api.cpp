#include "server/api.h"

#include <cmath>
#include <limits>

#include <fmt/format.h>

namespace chimera::server {

using nlohmann::json;

ApiError::ApiError(int status, std::string message, std::string param, std::string type)
    : std::runtime_error(std::move(message)),
      status_(status),
      param_(std::move(param)),
      type_(type.empty() ? error_type_for_status(status) : std::move(type)) {}

json ApiError::to_json() const {
  json e = {{"message", what()}, {"type", type_}, {"param", nullptr}, {"code", status_}};
  if (!param_.empty()) e["param"] = param_;
  return json{{"error", std::move(e)}};
}

std::string error_type_for_status(int status) {
  switch (status) {
    case 400: return "BadRequestError";
    case 401: return "AuthenticationError";
    case 403: return "PermissionDeniedError";
    case 404: return "NotFoundError";
    case 405: return "MethodNotAllowedError";
    case 408: return "RequestTimeoutError";
    case 413: return "RequestEntityTooLargeError";
    case 422: return "UnprocessableEntityError";
    case 429: return "RateLimitError";
    case 431: return "RequestHeaderFieldsTooLargeError";
    case 503: return "ServiceUnavailableError";
    default: return status >= 500 ? "InternalServerError" : "BadRequestError";
  }
}

namespace {

template <typename... Args>
[[noreturn]] void bad(const std::string& param, fmt::format_string<Args...> f, Args&&... args) {
  throw ApiError(400, fmt::format(f, std::forward<Args>(args)...), param);
}

const char* type_name(const json& v) {
  switch (v.type()) {
    case json::value_t::null: return "null";
    case json::value_t::boolean: return "a boolean";
    case json::value_t::string: return "a string";
    case json::value_t::array: return "an array";
    case json::value_t::object: return "an object";
    case json::value_t::number_float: return "a number";
    default: return "an integer";
  }
}

// A present, non-null field (null means "not given", as the OpenAI clients send it).
const json* field(const json& body, const char* name) {
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return nullptr;
  return &*it;
}

bool get_bool(const json& body, const char* name, bool fallback) {
  const json* v = field(body, name);
  if (!v) return fallback;
  if (!v->is_boolean()) bad(name, "'{}' must be a boolean, got {}", name, type_name(*v));
  return v->get<bool>();
}

double get_number(const json& body, const char* name, double fallback) {
  const json* v = field(body, name);
  if (!v) return fallback;
  if (!v->is_number()) bad(name, "'{}' must be a number, got {}", name, type_name(*v));
  const double d = v->get<double>();
  if (!std::isfinite(d)) bad(name, "'{}' must be finite", name);
  return d;
}

// An integer: JSON integers, or numbers with an integral value (5.0), as pydantic accepts them.
int64_t as_integer(const json& v, const std::string& name) {
  if (v.is_number_integer()) {
    if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max())) {
      bad(name, "'{}' is out of range", name);
    }
    return v.get<int64_t>();
  }
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9.0e15) return static_cast<int64_t>(d);
  }
  bad(name, "'{}' must be an integer, got {}", name, type_name(v));
}

std::optional<int64_t> get_int(const json& body, const char* name) {
  const json* v = field(body, name);
  if (!v) return std::nullopt;
  return as_integer(*v, name);
}

int32_t get_int_in(const json& body, const char* name, int32_t fallback, int64_t lo, int64_t hi) {
  const auto v = get_int(body, name);
  if (!v) return fallback;
  if (*v < lo || *v > hi) bad(name, "'{}' must be in [{}, {}], got {}", name, lo, hi, *v);
  return static_cast<int32_t>(*v);
}

std::vector<int32_t> token_ids(const json& arr, const std::string& name) {
  std::vector<int32_t> ids;
  ids.reserve(arr.size());
  for (const json& t : arr) {
    const int64_t id = as_integer(t, name);
    if (id < 0 || id > std::numeric_limits<int32_t>::max()) bad(name, "'{}': token id {} is out of range", name, id);
    ids.push_back(static_cast<int32_t>(id));
  }
  return ids;
}

// The sampling and output fields both routes share.
void parse_common(const json& body, GenerationRequest& r) {
  if (const json* m = field(body, "model")) {
    if (!m->is_string()) bad("model", "'model' must be a string, got {}", type_name(*m));
    r.model = m->get<std::string>();
  }
  r.n = get_int_in(body, "n", 1, 1, kMaxN);
  // max_completion_tokens (the newer name) wins over max_tokens when both are sent, as in vLLM.
  for (const char* name : {"max_tokens", "max_completion_tokens"}) {
    if (const auto v = get_int(body, name)) {
      // 0 is legal only for a completion that echoes its prompt (checked there): vLLM's scoring request.
      if (*v < 0) bad(name, "'{}' must be at least 1, got {}", name, *v);
      r.max_tokens = static_cast<int32_t>(std::min<int64_t>(*v, std::numeric_limits<int32_t>::max()));
    }
  }
  r.temperature = static_cast<float>(get_number(body, "temperature", 1.0));
  if (r.temperature < 0.0f) bad("temperature", "'temperature' must be >= 0, got {}", r.temperature);
  r.top_p = static_cast<float>(get_number(body, "top_p", 1.0));
  if (!(r.top_p > 0.0f && r.top_p <= 1.0f)) bad("top_p", "'top_p' must be in (0, 1], got {}", r.top_p);
  r.top_k = get_int_in(body, "top_k", 0, -1, std::numeric_limits<int32_t>::max());
  if (r.top_k < 0) r.top_k = 0;
  r.min_p = static_cast<float>(get_number(body, "min_p", 0.0));
  if (!(r.min_p >= 0.0f && r.min_p <= 1.0f)) bad("min_p", "'min_p' must be in [0, 1], got {}", r.min_p);
  if (const auto s = get_int(body, "seed")) r.seed = static_cast<uint64_t>(*s);
  r.presence_penalty = static_cast<float>(get_number(body, "presence_penalty", 0.0));
  if (std::fabs(r.presence_penalty) > 2.0f) {
    bad("presence_penalty", "'presence_penalty' must be in [-2, 2], got {}", r.presence_penalty);
  }
  r.frequency_penalty = static_cast<float>(get_number(body, "frequency_penalty", 0.0));
  if (std::fabs(r.frequency_penalty) > 2.0f) {
    bad("frequency_penalty", "'frequency_penalty' must be in [-2, 2], got {}", r.frequency_penalty);
  }
  r.repetition_penalty = static_cast<float>(get_number(body, "repetition_penalty", 1.0));
  if (!(r.repetition_penalty > 0.0f)) {
    bad("repetition_penalty", "'repetition_penalty' must be > 0, got {}", r.repetition_penalty);
  }
  if (const json* s = field(body, "stop")) {
    if (s->is_string()) {
      r.stop.push_back(s->get<std::string>());
    } else if (s->is_array()) {
      if (s->size() > kMaxStopStrings) bad("stop", "'stop' has {} strings, at most {}", s->size(), kMaxStopStrings);
      for (const json& e : *s) {
        if (!e.is_string()) bad("stop", "'stop' must be a string or a list of strings, got an entry of {}", type_name(e));
        r.stop.push_back(e.get<std::string>());
      }
    } else {
      bad("stop", "'stop' must be a string or a list of strings, got {}", type_name(*s));
    }
    for (const std::string& st : r.stop) {
      if (st.empty()) bad("stop", "'stop' strings must not be empty");
    }
  }
  if (const json* s = field(body, "stop_token_ids")) {
    if (!s->is_array()) bad("stop_token_ids", "'stop_token_ids' must be a list of token ids, got {}", type_name(*s));
    r.stop_token_ids = token_ids(*s, "stop_token_ids");
  }
  r.ignore_eos = get_bool(body, "ignore_eos", false);
  r.skip_special_tokens = get_bool(body, "skip_special_tokens", true);
  r.stream = get_bool(body, "stream", false);
  if (const json* so = field(body, "stream_options")) {
    if (!so->is_object()) bad("stream_options", "'stream_options' must be an object, got {}", type_name(*so));
    if (!r.stream) bad("stream_options", "'stream_options' can only be given with 'stream': true");
    r.include_usage = get_bool(*so, "include_usage", false);
  }
}

}  // namespace

json parse_json_body(std::string_view body) {
  json j = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) throw ApiError(400, "the request body is not valid JSON");
  if (!j.is_object()) throw ApiError(400, fmt::format("the request body must be a JSON object, got {}", type_name(j)));
  return j;
}

GenerationRequest parse_completion_request(const json& body) {
  GenerationRequest r;
  parse_common(body, r);
  const json* p = field(body, "prompt");
  if (!p) bad("prompt", "'prompt' is required");
  auto add_text = [&](const json& s) {
    if (s.get_ref<const std::string&>().empty()) bad("prompt", "'prompt' must not be empty");
    r.prompts.push_back(PromptInput{true, s.get<std::string>(), {}});
  };
  auto add_ids = [&](const json& a) {
    if (a.empty()) bad("prompt", "'prompt' must not be empty");
    r.prompts.push_back(PromptInput{false, {}, token_ids(a, "prompt")});
  };
  if (p->is_string()) {
    add_text(*p);
  } else if (p->is_array()) {
    if (p->empty()) bad("prompt", "'prompt' must not be empty");
    if ((*p)[0].is_number()) {
      add_ids(*p);
    } else {
      if (p->size() > kMaxPrompts) bad("prompt", "'prompt' has {} prompts, at most {}", p->size(), kMaxPrompts);
      for (const json& e : *p) {
        if (e.is_string()) {
          add_text(e);
        } else if (e.is_array()) {
          add_ids(e);
        } else {
          bad("prompt", "'prompt' must be a string, a list of token ids or a list of either, got an entry of {}",
              type_name(e));
        }
      }
    }
  } else {
    bad("prompt", "'prompt' must be a string, a list of token ids or a list of either, got {}", type_name(*p));
  }
  r.echo = get_bool(body, "echo", false);
  // echo with max_tokens 0 returns the prompt alone (with its logprobs when asked): how evaluation harnesses score
  // a text, as vLLM allows.
  if (r.max_tokens && *r.max_tokens == 0 && !r.echo) {
    const char* name = field(body, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
    bad(name, "'{}' must be at least 1, got 0 (0 only with 'echo': the prompt alone)", name);
  }
  if (field(body, "logprobs")) r.logprobs = get_int_in(body, "logprobs", 0, 0, kMaxLogprobs);
  if (field(body, "prompt_logprobs")) {
    r.prompt_logprobs = get_int_in(body, "prompt_logprobs", 0, 0, kMaxLogprobs);
    // vLLM's rule: the prompt's logprobs come in the final response only.
    if (r.stream && *r.prompt_logprobs > 0) {
      bad("prompt_logprobs", "'prompt_logprobs' are not available when 'stream' is true");
    }
  }
  if (r.n > 1 && r.prompts.size() * size_t(r.n) > kMaxPrompts) {
    bad("n", "{} prompts x n = {} choices, at most {}", r.prompts.size(), r.n, kMaxPrompts);
  }
  return r;
}

GenerationRequest parse_chat_request(const json& body) {
  GenerationRequest r;
  r.chat = true;
  parse_common(body, r);
  if (r.max_tokens && *r.max_tokens == 0) {
    const char* name = field(body, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
    bad(name, "'{}' must be at least 1, got 0", name);
  }
  const json* m = field(body, "messages");
  if (!m) bad("messages", "'messages' is required");
  if (!m->is_array() || m->empty()) bad("messages", "'messages' must be a non-empty list of messages");
  for (const json& msg : *m) {
    if (!msg.is_object()) bad("messages", "each message must be an object, got {}", type_name(msg));
    const json* role = field(msg, "role");
    if (!role || !role->is_string()) bad("messages", "each message needs a string 'role'");
    const json* content = field(msg, "content");
    if (content && !content->is_string() && !content->is_array()) {
      bad("messages", "a message's 'content' must be a string or a list of parts, got {}", type_name(*content));
    }
    if (content && content->is_array()) {
      for (const json& part : *content) {
        if (!part.is_object() || !part.contains("type") || !part["type"].is_string()) {
          bad("messages", "a content part must be an object with a string 'type'");
        }
        if (part["type"] == "text" && !(part.contains("text") && part["text"].is_string())) {
          bad("messages", "a text content part needs a string 'text'");
        }
      }
    }
  }
  r.messages = *m;
  if (const json* t = field(body, "tools")) {
    if (!t->is_array()) bad("tools", "'tools' must be a list, got {}", type_name(*t));
    for (const json& tool : *t) {
      if (!tool.is_object()) bad("tools", "each tool must be an object, got {}", type_name(tool));
    }
    r.tools = *t;
  }
  if (const json* k = field(body, "chat_template_kwargs")) {
    if (!k->is_object()) bad("chat_template_kwargs", "'chat_template_kwargs' must be an object, got {}", type_name(*k));
    r.chat_template_kwargs = *k;
  }
  r.add_generation_prompt = get_bool(body, "add_generation_prompt", true);
  const bool want_logprobs = get_bool(body, "logprobs", false);
  const int32_t top = get_int_in(body, "top_logprobs", 0, 0, kMaxLogprobs);
  if (field(body, "top_logprobs") && !want_logprobs) {
    bad("top_logprobs", "'top_logprobs' needs 'logprobs': true");
  }
  if (want_logprobs) r.logprobs = top;
  return r;
}

}  // namespace chimera::server
