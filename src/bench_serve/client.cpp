#include "bench_serve/client.h"

#include <curl/curl.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <optional>

#include "bench_serve/sse.h"
#include "core/error.h"

namespace chimera::bench_serve {
namespace {

using Clock = std::chrono::steady_clock;

double seconds(Clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

// curl_global_init is not thread-safe and must precede every other call; one function-local static does it once.
void ensure_curl() {
  static const bool ok = curl_global_init(CURL_GLOBAL_DEFAULT) == CURLE_OK;
  if (!ok) runtime_error("libcurl failed to initialize");
}

constexpr size_t kMaxErrorBody = 4096;

// One socket per stream: 1024 streams do not fit the common soft limit of 1024 descriptors. Raise the soft
// limit toward the hard one (no privilege needed); if the hard limit is lower, the surplus connections fail
// with libcurl's message and are counted as failed requests.
void raise_fd_limit(size_t streams) {
  rlimit lim{};
  if (getrlimit(RLIMIT_NOFILE, &lim) != 0) return;
  const rlim_t want = static_cast<rlim_t>(streams) + 256;
  if (lim.rlim_cur != RLIM_INFINITY && lim.rlim_cur < want) {
    lim.rlim_cur = lim.rlim_max == RLIM_INFINITY ? want : std::min(want, lim.rlim_max);
    setrlimit(RLIMIT_NOFILE, &lim);
  }
}

// One request in flight.
struct Transfer {
  size_t index = 0;
  CURL* easy = nullptr;
  curl_slist* headers = nullptr;
  const std::string* body = nullptr;
  bool chat = false;
  Clock::time_point run_start, sent, last;
  SseParser sse;
  long status = 0;
  bool first = false;
  std::string error_body;  // a non-200 response's body, for the message
  std::string error;       // set when the stream itself was bad
  RequestOutput out;
  char errbuf[CURL_ERROR_SIZE] = {};

  ~Transfer() {
    if (easy) curl_easy_cleanup(easy);
    if (headers) curl_slist_free_all(headers);
  }

  // One SSE event's data. Returns false to abort the transfer (error set).
  bool on_event(const std::string& data, Clock::time_point now) {
    if (data == "[DONE]") return true;
    nlohmann::json j = nlohmann::json::parse(data, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object()) {
      error = "malformed SSE data (not a JSON object): " + data.substr(0, 200);
      return false;
    }
    if (auto e = j.find("error"); e != j.end()) {
      const auto& msg = e->is_object() && e->contains("message") ? (*e)["message"] : *e;
      error = "server error in the stream: " + (msg.is_string() ? msg.get<std::string>() : msg.dump());
      return false;
    }
    auto choices = j.find("choices");
    if (choices != j.end() && choices->is_array() && !choices->empty()) {
      const nlohmann::json& c = (*choices)[0];
      if (first) {
        out.itl.push_back(seconds(now - last));
      } else {
        first = true;
        out.ttft = seconds(now - sent);
      }
      last = now;
      ++out.content_chunks;
      const nlohmann::json* text = nullptr;
      if (chat) {
        if (auto d = c.find("delta"); d != c.end() && d->is_object()) {
          if (auto t = d->find("content"); t != d->end() && t->is_string()) {
            text = &*t;
          } else if (auto r = d->find("reasoning_content"); r != d->end() && r->is_string()) {
            text = &*r;
          }
        }
      } else if (auto t = c.find("text"); t != c.end() && t->is_string()) {
        text = &*t;
      }
      if (text) out.generated_text += text->get_ref<const std::string&>();
    }
    // vLLM attaches usage to a final chunk with empty choices; read it wherever it comes.
    if (auto u = j.find("usage"); u != j.end() && u->is_object()) {
      if (auto ct = u->find("completion_tokens"); ct != u->end() && ct->is_number_integer()) {
        out.output_tokens = ct->get<int64_t>();
      }
    }
    return true;
  }

  size_t on_data(const char* ptr, size_t n) {
    const Clock::time_point now = Clock::now();
    if (status == 0) curl_easy_getinfo(easy, CURLINFO_RESPONSE_CODE, &status);
    if (status != 200) {
      error_body.append(ptr, std::min(n, kMaxErrorBody - std::min(kMaxErrorBody, error_body.size())));
      return n;
    }
    for (const std::string& ev : sse.feed(std::string_view(ptr, n))) {
      if (!on_event(ev, now)) return 0;  // curl aborts with CURLE_WRITE_ERROR
    }
    return n;
  }

  // The transfer ended with `code`: fill success / error / latency.
  void finish(CURLcode code) {
    if (code == CURLE_OK && status == 200) {
      const std::string tail = sse.finish();
      if (!tail.empty()) on_event(tail, Clock::now());
    }
    if (status == 0) curl_easy_getinfo(easy, CURLINFO_RESPONSE_CODE, &status);
    out.http_status = status;
    out.start_time = seconds(sent - run_start);
    out.latency = seconds(last - sent);
    if (!error.empty()) {
      out.error = error;
    } else if (code != CURLE_OK) {
      out.error = std::string("request failed: ") + (errbuf[0] ? errbuf : curl_easy_strerror(code));
    } else if (status != 200) {
      std::string msg = error_body;
      nlohmann::json j = nlohmann::json::parse(error_body, nullptr, false);
      if (!j.is_discarded() && j.is_object() && j.contains("error")) {
        const auto& e = j["error"];
        const auto& m = e.is_object() && e.contains("message") ? e["message"] : e;
        msg = m.is_string() ? m.get<std::string>() : m.dump();
      }
      out.error = "HTTP " + std::to_string(status) + (msg.empty() ? "" : ": " + msg.substr(0, 500));
    } else if (!first) {
      out.error = "the response had no chunk with choices (no token to time)";
    } else {
      out.success = true;
    }
  }
};

size_t write_cb(char* ptr, size_t size, size_t nmemb, void* user) {
  return static_cast<Transfer*>(user)->on_data(ptr, size * nmemb);
}

curl_slist* make_headers(const ClientConfig& cfg, bool json_body) {
  curl_slist* h = nullptr;
  if (json_body) h = curl_slist_append(h, "Content-Type: application/json");
  // libcurl waits for "100 Continue" before sending a body over 1 KiB unless told not to: that wait would be
  // counted in TTFT.
  h = curl_slist_append(h, "Expect:");
  if (!cfg.api_key.empty()) h = curl_slist_append(h, ("Authorization: Bearer " + cfg.api_key).c_str());
  for (const std::string& line : cfg.headers) h = curl_slist_append(h, line.c_str());
  return h;
}

struct MultiDeleter {
  void operator()(CURLM* m) const { curl_multi_cleanup(m); }
};

}  // namespace

nlohmann::json make_payload(const std::string& model, bool chat, const std::vector<int32_t>& prompt_ids,
                            const std::string& prompt_text, int64_t max_tokens, bool ignore_eos,
                            const nlohmann::json& extra_body) {
  nlohmann::json p;
  p["model"] = model;
  if (chat) {
    p["messages"] = nlohmann::json::array({{{"role", "user"}, {"content", prompt_text}}});
    p["max_completion_tokens"] = max_tokens;
  } else {
    if (prompt_ids.empty()) {
      p["prompt"] = prompt_text;
    } else {
      p["prompt"] = prompt_ids;
    }
    p["repetition_penalty"] = 1.0;
    p["max_tokens"] = max_tokens;
  }
  p["stream"] = true;
  p["stream_options"] = {{"include_usage", true}};
  if (ignore_eos) p["ignore_eos"] = true;
  if (extra_body.is_object()) {
    for (auto it = extra_body.begin(); it != extra_body.end(); ++it) p[it.key()] = it.value();
  }
  return p;
}

RunResult run_requests(const ClientConfig& cfg, const std::vector<PreparedRequest>& requests,
                       const std::vector<double>& arrivals) {
  CHIMERA_CHECK(arrivals.size() == requests.size(), "{} arrivals for {} requests", arrivals.size(), requests.size());
  ensure_curl();
  std::unique_ptr<CURLM, MultiDeleter> multi(curl_multi_init());
  if (!multi) runtime_error("libcurl: curl_multi_init failed");
  const size_t n = requests.size();
  const size_t limit = cfg.max_concurrency > 0 ? static_cast<size_t>(cfg.max_concurrency) : n;
  raise_fd_limit(std::min(limit, n));
  // Keep every connection of the pool open between requests (keep-alive), as aiohttp's connector does.
  curl_multi_setopt(multi.get(), CURLMOPT_MAXCONNECTS, static_cast<long>(std::max<size_t>(limit, 1) + 4));

  RunResult result;
  result.outputs.resize(n);
  std::vector<std::unique_ptr<Transfer>> slots(n);
  const Clock::time_point start = Clock::now();
  size_t next = 0, in_flight = 0, done = 0;
  std::vector<bool> finished(n, false);
  for (size_t i = 0; i < n; ++i) {
    CHIMERA_CHECK(requests[i].after < static_cast<int64_t>(i), "request {} waits for a later request {}", i,
                  requests[i].after);
  }
  auto ready = [&](size_t i) { return requests[i].after < 0 || finished[static_cast<size_t>(requests[i].after)]; };

  auto launch_due = [&] {
    const double now = seconds(Clock::now() - start);
    while (next < n && in_flight < limit && arrivals[next] <= now && ready(next)) {
      auto t = std::make_unique<Transfer>();
      t->index = next;
      t->chat = cfg.chat;
      t->body = &requests[next].body;
      t->out.prompt_len = requests[next].prompt_len;
      t->run_start = start;
      t->easy = curl_easy_init();
      if (!t->easy) runtime_error("libcurl: curl_easy_init failed");
      t->headers = make_headers(cfg, true);
      CURL* e = t->easy;
      curl_easy_setopt(e, CURLOPT_URL, cfg.api_url.c_str());
      curl_easy_setopt(e, CURLOPT_POST, 1L);
      curl_easy_setopt(e, CURLOPT_POSTFIELDS, t->body->data());
      curl_easy_setopt(e, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(t->body->size()));
      curl_easy_setopt(e, CURLOPT_HTTPHEADER, t->headers);
      curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, write_cb);
      curl_easy_setopt(e, CURLOPT_WRITEDATA, t.get());
      curl_easy_setopt(e, CURLOPT_PRIVATE, t.get());
      curl_easy_setopt(e, CURLOPT_ERRORBUFFER, t->errbuf);
      curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
      curl_easy_setopt(e, CURLOPT_TCP_NODELAY, 1L);
      curl_easy_setopt(e, CURLOPT_HTTP_VERSION, CURL_HTTP_VERSION_1_1);
      t->sent = t->last = Clock::now();
      if (curl_multi_add_handle(multi.get(), e) != CURLM_OK) runtime_error("libcurl: curl_multi_add_handle failed");
      slots[next] = std::move(t);
      ++next;
      ++in_flight;
    }
  };

  while (done < n) {
    launch_due();
    int running = 0;
    curl_multi_perform(multi.get(), &running);
    int queued = 0;
    while (CURLMsg* msg = curl_multi_info_read(multi.get(), &queued)) {
      if (msg->msg != CURLMSG_DONE) continue;
      Transfer* t = nullptr;
      curl_easy_getinfo(msg->easy_handle, CURLINFO_PRIVATE, &t);
      const CURLcode code = msg->data.result;
      curl_multi_remove_handle(multi.get(), msg->easy_handle);
      t->finish(code);
      result.outputs[t->index] = std::move(t->out);
      finished[t->index] = true;
      slots[t->index].reset();
      --in_flight;
      ++done;
    }
    launch_due();
    if (done == n) break;
    // Sleep until a socket is ready, curl's own timer fires, or the next arrival is due.
    int wait_ms = 1000;
    if (next < n && in_flight < limit && ready(next)) {
      const double due = arrivals[next] - seconds(Clock::now() - start);
      wait_ms = std::clamp(static_cast<int>(due * 1000.0), 0, 1000);
    }
    curl_multi_poll(multi.get(), nullptr, 0, wait_ms, nullptr);
  }
  result.duration_s = seconds(Clock::now() - start);
  return result;
}

namespace {
// A blocking GET: the status (0 when no answer came) and the body; `error` gets libcurl's message.
long http_get(const std::string& url, const ClientConfig& cfg, long timeout_s, std::string& body, std::string& error) {
  ensure_curl();
  CURL* e = curl_easy_init();
  if (!e) runtime_error("libcurl: curl_easy_init failed");
  curl_slist* h = make_headers(cfg, false);
  char errbuf[CURL_ERROR_SIZE] = {};
  curl_easy_setopt(e, CURLOPT_URL, url.c_str());
  curl_easy_setopt(e, CURLOPT_HTTPHEADER, h);
  curl_easy_setopt(e, CURLOPT_ERRORBUFFER, errbuf);
  curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(e, CURLOPT_TIMEOUT, timeout_s);
  curl_easy_setopt(e, CURLOPT_WRITEDATA, &body);
  curl_easy_setopt(
      e, CURLOPT_WRITEFUNCTION, +[](char* p, size_t s, size_t m, void* u) {
        static_cast<std::string*>(u)->append(p, s * m);
        return s * m;
      });
  const CURLcode code = curl_easy_perform(e);
  long status = 0;
  curl_easy_getinfo(e, CURLINFO_RESPONSE_CODE, &status);
  curl_easy_cleanup(e);
  curl_slist_free_all(h);
  if (code != CURLE_OK) {
    error = errbuf[0] ? errbuf : curl_easy_strerror(code);
    return 0;
  }
  return status;
}
}  // namespace

std::string first_model_id(const std::string& base_url, const ClientConfig& cfg) {
  const std::string url = base_url + "/v1/models";
  std::string body, error;
  const long status = http_get(url, cfg, 30, body, error);
  if (status == 0)
    runtime_error("cannot list the server's models at {}: {} (is the server running? or pass --model)", url, error);
  if (status != 200) runtime_error("GET {} answered HTTP {}: {}", url, status, body.substr(0, 300));
  nlohmann::json j = nlohmann::json::parse(body, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("data") || !j["data"].is_array() || j["data"].empty() ||
      !j["data"][0].is_object() || !j["data"][0].contains("id") || !j["data"][0]["id"].is_string()) {
    runtime_error("GET {} did not list a model (expected {{\"data\": [{{\"id\": ...}}]}}): {}", url,
                  body.substr(0, 300));
  }
  return j["data"][0]["id"].get<std::string>();
}

std::optional<std::string> scrape_metrics(const std::string& base_url, const ClientConfig& cfg) {
  std::string body, error;
  if (http_get(base_url + "/metrics", cfg, 10, body, error) != 200) return std::nullopt;
  return body;
}

}  // namespace chimera::bench_serve
