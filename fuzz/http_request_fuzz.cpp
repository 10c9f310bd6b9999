// libFuzzer: a request body (any bytes) through the OpenAI request parser and validator of chimera serve
// (server/api.h) for both routes. Properties: the only exception is ApiError with a 4xx status; an accepted
// request satisfies the validator's invariants; and its stop strings cut the body's text the same way whether
// the text arrives whole or in two pieces (server/stop_matcher.h).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "server/api.h"
#include "server/stop_matcher.h"

namespace {

using namespace chimera::server;

void check(bool ok) {
  if (!ok) std::abort();
}

void check_request(const GenerationRequest& r) {
  check(r.n >= 1 && r.n <= kMaxN);
  check(!r.max_tokens || *r.max_tokens >= 1);
  check(r.temperature >= 0.0f);
  check(r.top_p > 0.0f && r.top_p <= 1.0f);
  check(r.top_k >= 0);
  check(r.min_p >= 0.0f && r.min_p <= 1.0f);
  check(r.repetition_penalty > 0.0f);
  check(!r.logprobs || (*r.logprobs >= 0 && *r.logprobs <= kMaxLogprobs));
  check(!r.include_usage || r.stream);
  for (const std::string& s : r.stop) check(!s.empty());
  for (int32_t id : r.stop_token_ids) check(id >= 0);
  if (r.chat) {
    check(r.messages.is_array() && !r.messages.empty());
  } else {
    check(!r.prompts.empty() && r.prompts.size() <= kMaxPrompts);
    for (const PromptInput& p : r.prompts) {
      check(p.is_text ? !p.text.empty() : !p.ids.empty());
      for (int32_t id : p.ids) check(id >= 0);
    }
  }
}

void check_stop_split(const GenerationRequest& r, std::string_view text) {
  StopMatcher whole(r.stop);
  const std::string expected = whole.feed(text) + whole.flush();
  const size_t cut = text.size() / 2;
  StopMatcher parts(r.stop);
  std::string got = parts.feed(text.substr(0, cut));
  got += parts.feed(text.substr(cut));
  got += parts.flush();
  check(got == expected);
  check(whole.stopped() == parts.stopped());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view body(reinterpret_cast<const char*>(data), size);
  for (bool chat : {false, true}) {
    try {
      const nlohmann::json j = parse_json_body(body);
      const GenerationRequest r = chat ? parse_chat_request(j) : parse_completion_request(j);
      check(r.chat == chat);
      check_request(r);
      check_stop_split(r, body);
    } catch (const ApiError& e) {
      check(e.status() >= 400 && e.status() < 500);
      check(e.to_json()["error"].contains("message"));
    }
  }
  return 0;
}
