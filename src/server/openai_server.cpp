#include "server/openai_server.h"

#include <algorithm>
#include <ctime>
#include <optional>
#include <random>
#include <span>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "server/api.h"
#include "server/sse.h"
#include "chat/reasoning_parser.h"
#include "chat/tool_call_parser.h"
#include "server/stop_matcher.h"

namespace chimera::server {

using nlohmann::json;

namespace {

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

void send_json(Responder& r, int status, const json& body,
               std::vector<std::pair<std::string, std::string>> extra = {}) {
  r.send(status, "application/json", dump(body), std::move(extra));
}

void send_error(Responder& r, const ApiError& e, int32_t retry_after_s) {
  std::vector<std::pair<std::string, std::string>> extra;
  if (e.status() == 503) extra.emplace_back("Retry-After", std::to_string(retry_after_s));
  send_json(r, e.status(), e.to_json(), std::move(extra));
}

const char* finish_name(FinishReason f) {
  return f == FinishReason::kStop ? "stop" : f == FinishReason::kAbort ? "abort" : "length";
}

json utf8_bytes(const std::string& s) {
  json b = json::array();
  for (unsigned char c : s) b.push_back(int{c});
  return b;
}

// One token's log-probabilities, as the engine gave them; no logprob for the first prompt token (nothing
// precedes it), which the legacy format writes as nulls.
struct TokenLogprobs {
  int32_t token;
  std::optional<float> logprob;
  std::vector<std::pair<int32_t, float>> top;
};

// vLLM clamps -inf log-probabilities (a token the model rules out) to this, so that the JSON holds a number.
constexpr float kMinLogprob = -9999.0f;
float clamp_logprob(float v) { return std::max(v, kMinLogprob); }

void append(chat::ReasoningSplit& to, const chat::ReasoningSplit& more) {
  to.reasoning += more.reasoning;
  to.content += more.content;
}

// The id of `tag` where the tokenizer writes it as that one token (an added token such as Nemotron 3's
// <think>), else -1.
int32_t single_token_id(const Tokenizer& tok, std::string_view tag) {
  const std::optional<int32_t> id = tok.token_to_id(tag);
  if (!id) return -1;
  const std::vector<int32_t> ids = tok.encode(tag, /*add_special_tokens=*/false);
  return ids.size() == 1 && ids[0] == *id ? *id : -1;
}

// One output sequence of a request, on the connection's strand.
struct Choice {
  int32_t prompt = 0;  // which prompt it continues
  uint64_t handle = 0;
  StreamingDecoder decoder;
  StopMatcher matcher;
  std::optional<chat::ReasoningParser> reasoning;  // chat with --reasoning-parser (streaming or not)
  std::optional<chat::ToolCallParser> tools;       // streaming chat with --tool-call-parser and tools
  std::string text;                                // non-streaming: the answer's content (after the reasoning parser)
  std::string reasoning_text;                      // non-streaming with --reasoning-parser: its reasoning_content
  std::vector<TokenLogprobs> logprobs;             // non-streaming, when asked
  std::vector<PromptLogprob> prompt_logprobs;      // when the request computes them (from the first event)
  bool seen_event = false;
  size_t text_offset = 0;  // streaming completions: where the next chunk's logprobs tokens start
  size_t num_tool_calls = 0;
  int32_t num_tokens = 0;
  std::string finish;  // "" while it runs
  Choice(const Tokenizer& tok, bool skip_special, std::vector<std::string> stop)
      : decoder(tok, skip_special), matcher(std::move(stop)) {}
};

// The state of one generation request, touched only on its connection's strand.
class RequestState : public std::enable_shared_from_this<RequestState> {
 public:
  RequestState(EngineLoop& loop, std::shared_ptr<Responder> responder) : loop_(loop), responder_(std::move(responder)) {}

  bool chat = false, stream = false, include_usage = false, echo = false;
  bool want_logprobs = false;
  // Completions: the prompt logprobs the engine computes (-1: none): echo with logprobs puts them at the head
  // of `logprobs` (as vLLM); non-streaming responses also carry them as the choice's "prompt_logprobs".
  int32_t prompt_logprobs = -1;
  int32_t num_logprobs = 0;  // completions: the `logprobs` value (alternatives per token)
  bool echo_logprobs() const { return echo && want_logprobs && !chat; }
  bool reasoning_parser = false, tool_parser = false, enable_thinking = true;
  // The think tags' token ids (-1: the reasoning parser finds the tags in the text). A tag token bypasses the
  // detokenizer and stop strings and goes to the parser as a tag, so skip_special_tokens cannot hide it.
  int32_t think_open = -1, think_close = -1;
  bool tags_by_token() const { return think_open >= 0 && think_close >= 0; }
  json tools_spec;  // the request's tools (for the tool-call parser's parameter types)
  uint64_t tool_id_seed = 0;
  std::string request_id, model;
  int64_t created = 0;
  std::vector<std::string> prompt_text;  // per prompt, for echo
  std::vector<int32_t> prompt_len;       // per prompt
  std::vector<int32_t> prompt_first;     // per prompt: its first token (no logprob of its own)
  std::vector<Choice> choices;
  const Tokenizer* tokenizer = nullptr;

  void begin() {
    remaining_ = static_cast<int32_t>(choices.size());
    // Streaming and not share the reasoning parser (one split for both); the tool-call parser of a whole
    // answer runs in full_response().
    for (size_t i = 0; i < choices.size(); ++i) {
      if (reasoning_parser) choices[i].reasoning.emplace(enable_thinking, /*tags_in_text=*/!tags_by_token());
      if (tool_parser && stream) choices[i].tools.emplace(tools_spec, tool_id_seed + i);
    }
    if (!stream) return;
    responder_->start_stream(200, "text/event-stream");
    std::string out;
    for (size_t i = 0; i < choices.size(); ++i) {
      if (chat) {
        out += sse_event(chunk(i, json{{"role", "assistant"}, {"content", ""}}, nullptr, nullptr));
      } else if (echo && !echo_logprobs()) {
        // With logprobs the prompt goes out with the first token's chunk, which carries the prompt's logprobs.
        out += sse_event(chunk(i, prompt_text[choices[i].prompt], nullptr, nullptr));
      }
    }
    if (!out.empty()) responder_->write(std::move(out));
  }

  void apply(std::vector<SeqEvent> events) {
    if (done_) return;
    std::string out;
    for (const SeqEvent& ev : events) {
      Choice& c = choices.at(ev.choice);
      if (!c.finish.empty()) continue;
      if (ev.finish == FinishReason::kError) {
        return fail(500, ev.error.empty() ? "the sequence failed" : ev.error);
      }
      // The new text, split into reasoning / content by the reasoning parser where there is one.
      std::string delta;
      chat::ReasoningSplit split;
      auto route = [&](std::string text) {
        if (c.reasoning) {
          append(split, c.reasoning->feed(text));
        } else {
          delta += text;
        }
      };
      std::vector<TokenLogprobs> lps;
      const bool first_event = !c.seen_event && !ev.aborted;
      if (first_event) {
        c.seen_event = true;
        if (prompt_logprobs >= 0) c.prompt_logprobs = ev.prompt_logprobs;
        if (echo_logprobs() && stream) lps = prompt_entries(c);  // non-streaming: full_response() adds them
      }
      if (ev.aborted) {
        c.finish = "abort";
      } else {
        if (ev.token >= 0) {
          ++c.num_tokens;
          if (want_logprobs) lps.push_back(TokenLogprobs{ev.token, clamp_logprob(ev.logprob), ev.top_logprobs});
          // A token that ends the sequence as a stop token (EOS, stop_token_ids) adds no text, as in vLLM.
          if (ev.finish != FinishReason::kStop) {
            if (c.reasoning && tags_by_token() && (ev.token == think_open || ev.token == think_close)) {
              // The text before the tag goes first, whole (a stop string does not span a tag); then the tag.
              std::string before = c.matcher.feed(c.decoder.flush());
              before += c.matcher.flush();
              route(std::move(before));
              const chat::ThinkTag tag = ev.token == think_open ? chat::ThinkTag::kOpen : chat::ThinkTag::kClose;
              if (!c.matcher.stopped()) append(split, c.reasoning->tag(tag));
            } else {
              route(c.matcher.feed(c.decoder.feed(ev.token)));
            }
          }
        }
        if (c.matcher.stopped()) {
          c.finish = "stop";
          loop_.abort(c.handle, /*as_stop=*/true);  // the engine's sequence goes on until told
        } else if (ev.finish != FinishReason::kNone) {
          std::string rest = c.matcher.feed(c.decoder.flush());
          rest += c.matcher.flush();
          route(std::move(rest));
          c.finish = c.matcher.stopped() ? "stop" : finish_name(ev.finish);
        }
      }
      if (c.reasoning && !c.finish.empty()) append(split, c.reasoning->finish());
      if (!c.reasoning) split.content = std::move(delta);
      if (stream) {
        if (first_event && echo_logprobs()) split.content = prompt_text[c.prompt] + split.content;
        out += stream_delta(static_cast<size_t>(ev.choice), c, split, lps);
      } else {
        c.text += split.content;
        c.reasoning_text += split.reasoning;
        c.logprobs.insert(c.logprobs.end(), lps.begin(), lps.end());
      }
      if (!c.finish.empty()) --remaining_;
    }
    if (remaining_ == 0) {
      done_ = true;
      if (stream) {
        if (include_usage) {
          json u = base(chat ? "chat.completion.chunk" : "text_completion");
          u["choices"] = json::array();
          u["usage"] = usage();
          out += sse_event(u);
        }
        out += kSseDone;
        responder_->write(std::move(out));
        responder_->end();
      } else {
        send_json(*responder_, 200, full_response());
      }
    } else if (stream && !out.empty()) {
      responder_->write(std::move(out));
    }
  }

  void fail(int status, const std::string& message) {
    if (done_) return;
    cancel();
    if (stream) {
      // Headers are out: the error travels as an event, as vLLM sends it, then the stream ends.
      responder_->write(sse_event(ApiError(status, message).to_json()) + std::string(kSseDone));
      responder_->end();
    } else {
      send_error(*responder_, ApiError(status, message), 1);
    }
  }

  // The client went away (or the request failed): free every sequence still running.
  void cancel() {
    for (Choice& c : choices) {
      if (c.finish.empty()) {
        c.finish = "abort";
        loop_.abort(c.handle);
      }
    }
    done_ = true;
  }

  const std::shared_ptr<Responder>& responder() const { return responder_; }

 private:
  json base(const char* object) const {
    return json{{"id", request_id}, {"object", object}, {"created", created}, {"model", model}};
  }
  static json finish_json(const Choice& c, size_t tool_calls) {
    if (c.finish.empty()) return nullptr;
    return c.finish == "stop" && tool_calls > 0 ? json("tool_calls") : json(c.finish);
  }
  json chunk(size_t index, json delta_or_text, json finish, json logprobs) const {
    json c = base(chat ? "chat.completion.chunk" : "text_completion");
    json choice = {{"index", index}, {"logprobs", std::move(logprobs)}, {"finish_reason", std::move(finish)}};
    if (chat) {
      choice["delta"] = std::move(delta_or_text);
    } else {
      choice["text"] = std::move(delta_or_text);
    }
    c["choices"] = json::array({std::move(choice)});
    if (include_usage) c["usage"] = nullptr;
    return c;
  }

  std::string token_text(int32_t id) const { return tokenizer->decode(std::span<const int32_t>(&id, 1)); }

  // Completions: {"tokens", "token_logprobs", "top_logprobs", "text_offset"}. text_offset[i] is offset_base plus
  // the characters (Unicode code points, as Python's len) of tokens[0 .. i) (vLLM's rule, with the token strings
  // as listed); *offset_end: where the next token would start. A token without a logprob (the first of an echoed
  // prompt) has null entries.
  json completion_logprobs(const std::vector<TokenLogprobs>& lps, size_t offset_base, size_t* offset_end = nullptr) const {
    json tokens = json::array(), lp = json::array(), top = json::array(), off = json::array();
    size_t at = offset_base;
    for (const TokenLogprobs& t : lps) {
      const std::string s = token_text(t.token);
      tokens.push_back(s);
      if (t.logprob) {
        lp.push_back(*t.logprob);
        json d = json::object();
        d[s] = *t.logprob;
        for (const auto& [id, v] : t.top) d[token_text(id)] = v;
        top.push_back(std::move(d));
      } else {
        lp.push_back(nullptr);
        top.push_back(nullptr);
      }
      off.push_back(at);
      // Code points: every byte that does not continue a UTF-8 sequence starts one.
      at += static_cast<size_t>(std::count_if(s.begin(), s.end(), [](char ch) { return (ch & 0xC0) != 0x80; }));
    }
    if (offset_end) *offset_end = at;
    return json{{"tokens", tokens}, {"token_logprobs", lp}, {"top_logprobs", top}, {"text_offset", off}};
  }
  // The echoed prompt's head of a completion's `logprobs`: its first token without a logprob, then each later
  // one with the engine's prompt logprob and at most `logprobs` alternatives.
  std::vector<TokenLogprobs> prompt_entries(const Choice& c) const {
    std::vector<TokenLogprobs> out;
    out.push_back(TokenLogprobs{prompt_first[static_cast<size_t>(c.prompt)], std::nullopt, {}});
    for (const PromptLogprob& p : c.prompt_logprobs) {
      TokenLogprobs t{p.token, clamp_logprob(p.logprob), {}};
      for (size_t j = 0; j < p.top.size() && j < static_cast<size_t>(num_logprobs); ++j) {
        t.top.emplace_back(p.top[j].first, clamp_logprob(p.top[j].second));
      }
      out.push_back(std::move(t));
    }
    return out;
  }
  // vLLM's choice field "prompt_logprobs": null for the first token, then {"<id>": {"logprob", "rank",
  // "decoded_token"}} holding the prompt token and its alternatives.
  json prompt_logprobs_json(const Choice& c) const {
    json out = json::array({nullptr});
    for (const PromptLogprob& p : c.prompt_logprobs) {
      json d = json::object();
      d[std::to_string(p.token)] = {{"logprob", clamp_logprob(p.logprob)}, {"rank", p.rank},
                                    {"decoded_token", token_text(p.token)}};
      for (size_t j = 0; j < p.top.size(); ++j) {
        const std::string key = std::to_string(p.top[j].first);
        if (d.contains(key)) continue;
        d[key] = {{"logprob", clamp_logprob(p.top[j].second)}, {"rank", j + 1},
                  {"decoded_token", token_text(p.top[j].first)}};
      }
      out.push_back(std::move(d));
    }
    return out;
  }
  // Chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}.
  json chat_logprobs(const std::vector<TokenLogprobs>& lps) const {
    json content = json::array();
    for (const TokenLogprobs& t : lps) {
      const std::string s = token_text(t.token);
      json top = json::array();
      for (const auto& [id, v] : t.top) {
        const std::string ts = token_text(id);
        top.push_back(json{{"token", ts}, {"logprob", v}, {"bytes", utf8_bytes(ts)}});
      }
      content.push_back(
          json{{"token", s}, {"logprob", t.logprob.value_or(0.0f)}, {"bytes", utf8_bytes(s)}, {"top_logprobs", top}});
    }
    return json{{"content", content}};
  }

  // The SSE events of one choice's new text (split by the reasoning parser; all content without one; the
  // tool-call parser runs here) and finish.
  std::string stream_delta(size_t i, Choice& c, const chat::ReasoningSplit& split,
                           const std::vector<TokenLogprobs>& lps) {
    json lp = nullptr;
    if (want_logprobs && !lps.empty()) {
      lp = chat ? chat_logprobs(lps) : completion_logprobs(lps, c.text_offset, &c.text_offset);
    }
    if (!chat) {
      if (split.content.empty() && c.finish.empty() && lp.is_null()) return {};
      return sse_event(chunk(i, split.content, finish_json(c, 0), lp));
    }
    std::string reasoning = split.reasoning, content = split.content;
    std::vector<json> calls;
    if (c.tools) {
      chat::ToolCallDelta d = c.tools->feed(content);
      content = std::move(d.content);
      auto add_calls = [&](const chat::ToolCallDelta& td) {
        for (size_t k = 0; k < td.tool_calls.size(); ++k) {
          const chat::ToolCall& tc = td.tool_calls[k];
          calls.push_back(json{{"index", td.first_index + k}, {"id", tc.id}, {"type", "function"},
                               {"function", {{"name", tc.name}, {"arguments", tc.arguments}}}});
        }
      };
      add_calls(d);
      if (!c.finish.empty()) {
        chat::ToolCallDelta f = c.tools->finish();
        content += f.content;
        add_calls(f);
      }
      c.num_tool_calls = c.tools->num_tool_calls();
    }
    json delta = json::object();
    if (!reasoning.empty()) delta["reasoning_content"] = reasoning;
    if (!content.empty()) delta["content"] = content;
    if (!calls.empty()) delta["tool_calls"] = calls;
    if (delta.empty() && c.finish.empty() && lp.is_null()) return {};
    return sse_event(chunk(i, std::move(delta), finish_json(c, c.num_tool_calls), lp));
  }

  json usage() const {
    int64_t p = 0, g = 0;
    for (int32_t n : prompt_len) p += n;
    for (const Choice& c : choices) g += c.num_tokens;
    return json{{"prompt_tokens", p}, {"completion_tokens", g}, {"total_tokens", p + g}};
  }
  json full_response() const {
    json r = base(chat ? "chat.completion" : "text_completion");
    json arr = json::array();
    for (size_t i = 0; i < choices.size(); ++i) {
      const Choice& c = choices[i];
      json choice = {{"index", i}, {"logprobs", nullptr}, {"finish_reason", c.finish}};
      if (chat) {
        std::string content = c.text;  // after the reasoning parser, which apply() fed
        json message = {{"role", "assistant"}};
        if (reasoning_parser) {
          message["reasoning_content"] = c.reasoning_text.empty() ? json(nullptr) : json(c.reasoning_text);
        }
        json calls = json::array();
        if (tool_parser) {
          chat::ToolCallParser parser(tools_spec, tool_id_seed + i);
          chat::ToolCallResult res = parser.parse(content);
          content = std::move(res.content);
          for (const chat::ToolCall& tc : res.tool_calls) {
            calls.push_back(json{{"id", tc.id}, {"type", "function"},
                                 {"function", {{"name", tc.name}, {"arguments", tc.arguments}}}});
          }
        }
        message["content"] = content.empty() && !calls.empty() ? json(nullptr) : json(content);
        message["tool_calls"] = calls;
        choice["message"] = std::move(message);
        choice["finish_reason"] = finish_json(c, calls.size());
        if (want_logprobs) choice["logprobs"] = chat_logprobs(c.logprobs);
      } else {
        choice["text"] = echo ? prompt_text[c.prompt] + c.text : c.text;
        if (want_logprobs) {
          std::vector<TokenLogprobs> all = echo_logprobs() ? prompt_entries(c) : std::vector<TokenLogprobs>{};
          all.insert(all.end(), c.logprobs.begin(), c.logprobs.end());
          choice["logprobs"] = completion_logprobs(all, 0);
        }
        if (prompt_logprobs >= 0) choice["prompt_logprobs"] = prompt_logprobs_json(c);
      }
      arr.push_back(std::move(choice));
    }
    r["choices"] = std::move(arr);
    r["usage"] = usage();
    return r;
  }

  EngineLoop& loop_;
  std::shared_ptr<Responder> responder_;
  int32_t remaining_ = 0;
  bool done_ = false;
};

// Hands the engine thread's events to the request's strand.
class StrandSink : public RequestSink {
 public:
  explicit StrandSink(std::shared_ptr<RequestState> st) : st_(std::move(st)) {}
  void on_events(std::vector<SeqEvent> events) override {
    st_->responder()->post([st = st_, ev = std::move(events)]() mutable { st->apply(std::move(ev)); });
  }
  void on_error(int status, std::string message) override {
    st_->responder()->post([st = st_, status, m = std::move(message)] { st->fail(status, m); });
  }

 private:
  std::shared_ptr<RequestState> st_;
};

// Seed of choice i of a request: the request's seed for choice 0, then seed + i, so that n > 1 draws differ and
// a request with a seed repeats exactly.
uint64_t choice_seed(uint64_t seed, int32_t i) { return seed + static_cast<uint64_t>(i); }

}  // namespace

OpenAiServer::OpenAiServer(ServerConfig config, const Tokenizer* tokenizer, const chat::ChatTemplate* chat_template,
                           EngineLoop& loop, Metrics& metrics)
    : config_(std::move(config)),
      tokenizer_(tokenizer),
      chat_template_(chat_template),
      loop_(loop),
      metrics_(metrics) {
  std::random_device rd;
  id_salt_ = (uint64_t{rd()} << 32) ^ rd();
  if (tokenizer_ && !config_.reasoning_parser.empty()) {
    think_open_id_ = single_token_id(*tokenizer_, "<think>");
    think_close_id_ = single_token_id(*tokenizer_, "</think>");
  }
}

std::string OpenAiServer::new_id(const char* prefix) {
  return fmt::format("{}-{:016x}{:016x}", prefix, id_salt_, next_id_.fetch_add(1));
}

void OpenAiServer::handle(HttpRequest req, std::shared_ptr<Responder> r) {
  const std::string path = req.path();
  struct Route {
    const char* path;
    const char* method;
  };
  static constexpr Route kRoutes[] = {
      {"/v1/completions", "POST"}, {"/v1/chat/completions", "POST"}, {"/v1/models", "GET"},
      {"/health", "GET"},          {"/version", "GET"},              {"/tokenize", "POST"},
      {"/detokenize", "POST"},     {"/metrics", "GET"},
  };
  try {
    const Route* route = nullptr;
    for (const Route& rt : kRoutes) {
      if (path == rt.path) route = &rt;
    }
    if (!route) throw ApiError(404, fmt::format("no route {} {}", req.method, path));
    const bool head_ok = req.method == "HEAD" && std::string_view(route->method) == "GET";
    if (req.method != route->method && !head_ok) {
      send_json(*r, 405, ApiError(405, fmt::format("{} does not allow {}; use {}", path, req.method, route->method)).to_json(),
                {{"Allow", route->method}});
      return;
    }
    if (!config_.api_key.empty() && path.rfind("/v1/", 0) == 0 &&
        req.header("Authorization") != "Bearer " + config_.api_key) {
      throw ApiError(401, "missing or wrong API key (send 'Authorization: Bearer KEY')");
    }
    if (path == "/v1/completions") return generate(req, r, /*chat=*/false);
    if (path == "/v1/chat/completions") return generate(req, r, /*chat=*/true);
    if (path == "/tokenize") return tokenize(req, r);
    if (path == "/detokenize") return detokenize(req, r);
    if (path == "/health") {
      // 503 once the engine can run no more steps (a broken tensor-parallel group): orchestrators restart it.
      const std::string failure = loop_.failure();
      if (!failure.empty()) return r->send(503, "text/plain", "the engine can run no more steps: " + failure, {});
      return r->send(200, "text/plain", "", {});
    }
    if (path == "/version") return send_json(*r, 200, json{{"version", config_.version}});
    if (path == "/metrics") return r->send(200, "text/plain; version=0.0.4; charset=utf-8", metrics_.render(), {});
    if (path == "/v1/models") {
      const json model = {{"id", config_.served_model_name}, {"object", "model"}, {"created", std::time(nullptr)},
                          {"owned_by", "chimera"}, {"root", config_.served_model_name}, {"parent", nullptr},
                          {"max_model_len", config_.max_model_len}};
      return send_json(*r, 200, json{{"object", "list"}, {"data", json::array({model})}});
    }
  } catch (const ApiError& e) {
    send_error(*r, e, config_.retry_after_s);
  } catch (const Error& e) {
    // Input the model layer refused (kInvalidInput) is the client's; anything else is ours.
    send_error(*r, ApiError(e.kind() == ErrorKind::kInvalidInput ? 400 : 500, e.what()), config_.retry_after_s);
  }
}

void OpenAiServer::generate(const HttpRequest& req, const std::shared_ptr<Responder>& r, bool chat) {
  const auto arrival = std::chrono::steady_clock::now();
  const json body = parse_json_body(req.body);
  const GenerationRequest g = chat ? parse_chat_request(body) : parse_completion_request(body);
  if (!g.model.empty() && g.model != config_.served_model_name) {
    throw ApiError(404, fmt::format("The model `{}` does not exist.", g.model), "model", "NotFoundError");
  }
  if (!tokenizer_) throw ApiError(400, "this server has no tokenizer; text generation needs one");
  std::vector<PromptInput> inputs = g.prompts;
  if (chat) {
    if (!chat_template_) throw ApiError(400, "the model has no chat template; use /v1/completions");
    // The template sees the request's own key order (tojson, |items), as transformers does.
    const nlohmann::ordered_json ob = nlohmann::ordered_json::parse(req.body);
    const nlohmann::ordered_json tools = ob.contains("tools") ? ob["tools"] : nlohmann::ordered_json(nullptr);
    const nlohmann::ordered_json kwargs =
        ob.contains("chat_template_kwargs") ? ob["chat_template_kwargs"] : nlohmann::ordered_json(nullptr);
    const std::string prompt = chat_template_->render(chat::tool_call_arguments_as_objects(ob["messages"]), tools,
                                                      g.add_generation_prompt, kwargs);
    // The template writes the special tokens itself (BOS): encode without adding them again.
    PromptInput in;
    in.is_text = false;
    in.text = prompt;
    in.ids = tokenizer_->encode(prompt, /*add_special_tokens=*/false);
    inputs = {std::move(in)};
  }

  auto st = std::make_shared<RequestState>(loop_, r);
  st->chat = chat;
  st->stream = g.stream;
  st->include_usage = g.include_usage;
  st->echo = g.echo;
  st->request_id = new_id(chat ? "chatcmpl" : "cmpl");
  st->model = config_.served_model_name;
  st->created = std::time(nullptr);
  st->tokenizer = tokenizer_;
  st->want_logprobs = g.logprobs.has_value();
  st->num_logprobs = g.logprobs.value_or(0);
  // vLLM: an explicit prompt_logprobs wins; echo with logprobs asks for the prompt's with as many alternatives.
  if (!chat) st->prompt_logprobs = g.prompt_logprobs ? *g.prompt_logprobs : g.echo && g.logprobs ? *g.logprobs : -1;
  st->reasoning_parser = chat && !config_.reasoning_parser.empty();
  st->tool_parser = chat && !config_.tool_call_parser.empty() && g.tools.is_array() && !g.tools.empty();
  st->enable_thinking = !(g.chat_template_kwargs.contains("enable_thinking") &&
                          g.chat_template_kwargs["enable_thinking"] == false);
  st->think_open = think_open_id_;
  st->think_close = think_close_id_;
  st->tools_spec = g.tools;
  st->tool_id_seed = id_salt_ ^ next_id_.load();

  std::vector<std::vector<int32_t>> prompts;
  for (const PromptInput& p : inputs) {
    std::vector<int32_t> ids = p.is_text ? tokenizer_->encode(p.text, /*add_special_tokens=*/true) : p.ids;
    if (ids.empty()) throw ApiError(400, "the prompt encodes to no tokens", "prompt");
    for (int32_t id : ids) {
      if (id >= config_.vocab_size) {
        throw ApiError(400, fmt::format("token id {} is outside the vocabulary [0, {})", id, config_.vocab_size),
                       "prompt");
      }
    }
    const int64_t len = static_cast<int64_t>(ids.size());
    const int64_t want = g.max_tokens ? *g.max_tokens : std::max<int64_t>(config_.max_model_len - len, 0);
    if (len >= config_.max_model_len || len + want > config_.max_model_len) {
      throw ApiError(400,
                     fmt::format("This model's maximum context length is {} tokens. However, you requested {} tokens "
                                 "({} in the prompt, {} in the completion). Please reduce the length of the prompt "
                                 "or the completion.",
                                 config_.max_model_len, len + want, len, want),
                     g.max_tokens ? "max_tokens" : "prompt");
    }
    st->prompt_text.push_back(!p.text.empty() ? p.text : tokenizer_->decode(ids, /*skip_special_tokens=*/false));
    st->prompt_len.push_back(static_cast<int32_t>(len));
    st->prompt_first.push_back(ids.front());
    prompts.push_back(std::move(ids));
  }

  for (int32_t id : g.stop_token_ids) {
    if (id >= config_.vocab_size) {
      throw ApiError(400, fmt::format("stop token id {} is outside the vocabulary [0, {})", id, config_.vocab_size),
                     "stop_token_ids");
    }
  }
  const uint64_t seed = g.seed ? *g.seed : (uint64_t{std::random_device{}()} << 32) ^ std::random_device{}();
  std::vector<SeqRequest> seqs;
  for (size_t p = 0; p < prompts.size(); ++p) {
    for (int32_t i = 0; i < g.n; ++i) {
      SeqRequest s;
      s.prompt = prompts[p];
      s.sampling.temperature = g.temperature;
      s.sampling.top_k = g.top_k;
      s.sampling.top_p = g.top_p;
      s.sampling.seed = choice_seed(seed, i);
      s.sampling.ignore_eos = g.ignore_eos;
      s.sampling.min_p = g.min_p;
      s.sampling.presence_penalty = g.presence_penalty;
      s.sampling.frequency_penalty = g.frequency_penalty;
      s.sampling.repetition_penalty = g.repetition_penalty;
      s.sampling.stop_token_ids = g.stop_token_ids;
      s.sampling.logprobs = g.logprobs ? *g.logprobs : -1;
      s.sampling.prompt_logprobs = st->prompt_logprobs;
      s.sampling.validate();  // kInvalidInput -> 400 here, before anything is queued
      s.sampling.max_new_tokens =
          g.max_tokens ? *g.max_tokens : config_.max_model_len - static_cast<int32_t>(prompts[p].size());
      seqs.push_back(std::move(s));
      st->choices.emplace_back(*tokenizer_, g.skip_special_tokens, g.stop);
      st->choices.back().prompt = static_cast<int32_t>(p);
    }
  }
  const uint64_t first = loop_.submit(std::move(seqs), std::make_shared<StrandSink>(st), arrival);
  for (size_t i = 0; i < st->choices.size(); ++i) st->choices[i].handle = first + i;
  // The handler runs on the strand, so begin() precedes every event of this request.
  st->begin();
  r->on_disconnect([st] { st->cancel(); });
}

void OpenAiServer::tokenize(const HttpRequest& req, const std::shared_ptr<Responder>& r) {
  const json body = parse_json_body(req.body);
  if (!tokenizer_) throw ApiError(400, "this server has no tokenizer");
  bool add_special = true;
  std::string text;
  if (body.contains("messages")) {
    // A chat: the prompt the chat template renders (as /v1/chat/completions would send it to the engine).
    const GenerationRequest g = parse_chat_request(body);
    if (!chat_template_) throw ApiError(400, "the model has no chat template");
    const nlohmann::ordered_json ob = nlohmann::ordered_json::parse(req.body);
    text = chat_template_->render(chat::tool_call_arguments_as_objects(ob["messages"]),
                                  ob.contains("tools") ? ob["tools"] : nlohmann::ordered_json(nullptr),
                                  g.add_generation_prompt,
                                  ob.contains("chat_template_kwargs") ? ob["chat_template_kwargs"]
                                                                      : nlohmann::ordered_json(nullptr));
    add_special = false;
  } else {
    auto it = body.find("prompt");
    if (it == body.end() || !it->is_string()) throw ApiError(400, "'prompt' must be a string", "prompt");
    text = it->get<std::string>();
  }
  if (auto a = body.find("add_special_tokens"); a != body.end() && !a->is_null()) {
    if (!a->is_boolean()) throw ApiError(400, "'add_special_tokens' must be a boolean", "add_special_tokens");
    add_special = a->get<bool>();
  }
  const std::vector<int32_t> ids = tokenizer_->encode(text, add_special);
  send_json(*r, 200, json{{"count", ids.size()}, {"max_model_len", config_.max_model_len}, {"tokens", ids}});
}

void OpenAiServer::detokenize(const HttpRequest& req, const std::shared_ptr<Responder>& r) {
  const json body = parse_json_body(req.body);
  if (!tokenizer_) throw ApiError(400, "this server has no tokenizer");
  auto it = body.find("tokens");
  if (it == body.end() || !it->is_array()) throw ApiError(400, "'tokens' must be a list of token ids", "tokens");
  std::vector<int32_t> ids;
  for (const json& t : *it) {
    if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() >= config_.vocab_size) {
      throw ApiError(400, fmt::format("'tokens' must hold token ids in [0, {})", config_.vocab_size), "tokens");
    }
    ids.push_back(t.get<int32_t>());
  }
  send_json(*r, 200, json{{"prompt", tokenizer_->decode(ids)}});
}

}  // namespace chimera::server
