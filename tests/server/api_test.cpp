// The request parser and validator: every field's type and range, prompts in each accepted shape, errors in
// OpenAI's JSON shape naming the field.
#include "server/api.h"

#include <gtest/gtest.h>

namespace chimera::server {
namespace {

using nlohmann::json;

GenerationRequest completion(const std::string& body) { return parse_completion_request(parse_json_body(body)); }

// The error a body gets: status and param.
std::pair<int, std::string> error_of(const std::string& body, bool chat = false) {
  try {
    const json j = parse_json_body(body);
    if (chat) {
      parse_chat_request(j);
    } else {
      parse_completion_request(j);
    }
  } catch (const ApiError& e) {
    return {e.status(), e.param()};
  }
  return {0, ""};
}

TEST(ServerApi, PromptShapes) {
  GenerationRequest r = completion(R"({"prompt": "hi"})");
  ASSERT_EQ(r.prompts.size(), 1u);
  EXPECT_TRUE(r.prompts[0].is_text);
  EXPECT_EQ(r.prompts[0].text, "hi");
  r = completion(R"({"prompt": [5, 6, 7]})");
  ASSERT_EQ(r.prompts.size(), 1u);
  EXPECT_FALSE(r.prompts[0].is_text);
  EXPECT_EQ(r.prompts[0].ids, (std::vector<int32_t>{5, 6, 7}));
  r = completion(R"({"prompt": ["a", [1, 2], "b"]})");
  ASSERT_EQ(r.prompts.size(), 3u);
  EXPECT_EQ(r.prompts[0].text, "a");
  EXPECT_EQ(r.prompts[1].ids, (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(r.prompts[2].text, "b");
}

TEST(ServerApi, Defaults) {
  const GenerationRequest r = completion(R"({"prompt": "x", "model": "m"})");
  EXPECT_EQ(r.model, "m");
  EXPECT_EQ(r.n, 1);
  EXPECT_FALSE(r.max_tokens.has_value());
  EXPECT_FLOAT_EQ(r.temperature, 1.0f);
  EXPECT_FLOAT_EQ(r.top_p, 1.0f);
  EXPECT_EQ(r.top_k, 0);
  EXPECT_FALSE(r.seed.has_value());
  EXPECT_FALSE(r.stream);
  EXPECT_FALSE(r.logprobs.has_value());
  EXPECT_TRUE(r.stop.empty());
}

TEST(ServerApi, SamplingFields) {
  const GenerationRequest r = completion(
      R"({"prompt": "x", "max_tokens": 7, "temperature": 0, "top_p": 0.5, "top_k": 40, "min_p": 0.1, "seed": 3,
          "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2, "stop": ["a", "bc"],
          "stop_token_ids": [2, 4], "ignore_eos": true, "n": 2, "logprobs": 3, "echo": true, "stream": true,
          "stream_options": {"include_usage": true}, "unknown_field": {"ignored": 1}})");
  EXPECT_EQ(r.max_tokens, 7);
  EXPECT_FLOAT_EQ(r.temperature, 0.0f);
  EXPECT_FLOAT_EQ(r.top_p, 0.5f);
  EXPECT_EQ(r.top_k, 40);
  EXPECT_FLOAT_EQ(r.min_p, 0.1f);
  EXPECT_EQ(r.seed, 3u);
  EXPECT_FLOAT_EQ(r.presence_penalty, 0.5f);
  EXPECT_FLOAT_EQ(r.frequency_penalty, -0.5f);
  EXPECT_FLOAT_EQ(r.repetition_penalty, 1.2f);
  EXPECT_EQ(r.stop, (std::vector<std::string>{"a", "bc"}));
  EXPECT_EQ(r.stop_token_ids, (std::vector<int32_t>{2, 4}));
  EXPECT_TRUE(r.ignore_eos);
  EXPECT_EQ(r.n, 2);
  EXPECT_EQ(r.logprobs, 3);
  EXPECT_TRUE(r.echo);
  EXPECT_TRUE(r.stream);
  EXPECT_TRUE(r.include_usage);
  // max_completion_tokens is the newer name of max_tokens; null means "not given"; top_k -1 means off.
  const GenerationRequest m = completion(R"({"prompt": "x", "max_completion_tokens": 9, "top_k": -1, "seed": null})");
  EXPECT_EQ(m.max_tokens, 9);
  EXPECT_EQ(m.top_k, 0);
  EXPECT_FALSE(m.seed.has_value());
  EXPECT_EQ(completion(R"({"prompt": "x", "max_tokens": 5.0})").max_tokens, 5);
  // A scoring request: the echoed prompt alone.
  EXPECT_EQ(completion(R"({"prompt": "x", "max_tokens": 0, "echo": true, "logprobs": 1})").max_tokens, 0);
}

TEST(ServerApi, BadBodies) {
  EXPECT_EQ(error_of("{").first, 400);
  EXPECT_EQ(error_of("").first, 400);
  EXPECT_EQ(error_of("[1]").first, 400);
  EXPECT_EQ(error_of("null").first, 400);
  EXPECT_EQ(error_of("{\"prompt\": \"x\"} trailing").first, 400);
}

TEST(ServerApi, BadFieldsNameTheField) {
  const std::pair<std::string, std::string> cases[] = {
      {R"({})", "prompt"},
      {R"({"prompt": ""})", "prompt"},
      {R"({"prompt": []})", "prompt"},
      {R"({"prompt": [[]]})", "prompt"},
      {R"({"prompt": 5})", "prompt"},
      {R"({"prompt": [1, "a"]})", "prompt"},
      {R"({"prompt": [-1]})", "prompt"},
      {R"({"prompt": [1.5]})", "prompt"},
      {R"({"prompt": [{"a": 1}]})", "prompt"},
      {R"({"prompt": "x", "max_tokens": 0})", "max_tokens"},
      {R"({"prompt": "x", "max_tokens": -3})", "max_tokens"},
      {R"({"prompt": "x", "max_tokens": "5"})", "max_tokens"},
      {R"({"prompt": "x", "max_tokens": 2.5})", "max_tokens"},
      {R"({"prompt": "x", "max_completion_tokens": 0})", "max_completion_tokens"},
      {R"({"prompt": "x", "temperature": -1})", "temperature"},
      {R"({"prompt": "x", "temperature": "hot"})", "temperature"},
      {R"({"prompt": "x", "top_p": 0})", "top_p"},
      {R"({"prompt": "x", "top_p": 1.5})", "top_p"},
      {R"({"prompt": "x", "top_k": -2})", "top_k"},
      {R"({"prompt": "x", "min_p": 2})", "min_p"},
      {R"({"prompt": "x", "n": 0})", "n"},
      {R"({"prompt": "x", "n": 100000})", "n"},
      {R"({"prompt": "x", "seed": "s"})", "seed"},
      {R"({"prompt": "x", "presence_penalty": 3})", "presence_penalty"},
      {R"({"prompt": "x", "frequency_penalty": -2.5})", "frequency_penalty"},
      {R"({"prompt": "x", "repetition_penalty": 0})", "repetition_penalty"},
      {R"({"prompt": "x", "stop": 5})", "stop"},
      {R"({"prompt": "x", "stop": [""]})", "stop"},
      {R"({"prompt": "x", "stop": ["a", 1]})", "stop"},
      {R"({"prompt": "x", "stop_token_ids": 3})", "stop_token_ids"},
      {R"({"prompt": "x", "ignore_eos": "yes"})", "ignore_eos"},
      {R"({"prompt": "x", "stream": 1})", "stream"},
      {R"({"prompt": "x", "stream_options": {"include_usage": true}})", "stream_options"},
      {R"({"prompt": "x", "stream": true, "stream_options": 3})", "stream_options"},
      {R"({"prompt": "x", "logprobs": 21})", "logprobs"},
      {R"({"prompt": "x", "logprobs": true})", "logprobs"},
      {R"({"prompt": "x", "echo": "no"})", "echo"},
      {R"({"prompt": "x", "model": 3})", "model"},
      {R"({"prompt": "x", "max_tokens": 1e300})", "max_tokens"},
      {R"({"prompt": "x", "max_tokens": 18446744073709551615})", "max_tokens"},
  };
  for (const auto& [body, param] : cases) {
    const auto [status, got] = error_of(body);
    EXPECT_EQ(status, 400) << body;
    EXPECT_EQ(got, param) << body;
  }
}

TEST(ServerApi, ChatRequests) {
  const GenerationRequest r = parse_chat_request(parse_json_body(
      R"({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
          "tools": [{"type": "function", "function": {"name": "f"}}], "chat_template_kwargs": {"enable_thinking": false},
          "logprobs": true, "top_logprobs": 2, "max_completion_tokens": 4})"));
  EXPECT_TRUE(r.chat);
  EXPECT_EQ(r.messages.size(), 2u);
  EXPECT_EQ(r.tools.size(), 1u);
  EXPECT_EQ(r.chat_template_kwargs["enable_thinking"], false);
  EXPECT_EQ(r.logprobs, 2);
  EXPECT_EQ(r.max_tokens, 4);
  const std::pair<std::string, std::string> bad[] = {
      {R"({})", "messages"},
      {R"({"messages": []})", "messages"},
      {R"({"messages": "hi"})", "messages"},
      {R"({"messages": [3]})", "messages"},
      {R"({"messages": [{"content": "x"}]})", "messages"},
      {R"({"messages": [{"role": "user", "content": 5}]})", "messages"},
      {R"({"messages": [{"role": "user", "content": [{"type": "text"}]}]})", "messages"},
      {R"({"messages": [{"role": "user", "content": "x"}], "tools": {}})", "tools"},
      {R"({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})", "top_logprobs"},
      {R"({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": []})", "chat_template_kwargs"},
      {R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0})", "max_tokens"},
      {R"({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0})", "max_completion_tokens"},
  };
  for (const auto& [body, param] : bad) {
    const auto [status, got] = error_of(body, /*chat=*/true);
    EXPECT_EQ(status, 400) << body;
    EXPECT_EQ(got, param) << body;
  }
}

TEST(ServerApi, ErrorShape) {
  const json e = ApiError(400, "'n' must be in [1, 128], got 0", "n").to_json();
  ASSERT_TRUE(e.contains("error"));
  EXPECT_EQ(e["error"]["message"], "'n' must be in [1, 128], got 0");
  EXPECT_EQ(e["error"]["type"], "BadRequestError");
  EXPECT_EQ(e["error"]["param"], "n");
  EXPECT_EQ(e["error"]["code"], 400);
  const json n = ApiError(503, "busy").to_json();
  EXPECT_TRUE(n["error"]["param"].is_null());
  EXPECT_EQ(n["error"]["type"], "ServiceUnavailableError");
  EXPECT_EQ(ApiError(404, "x").to_json()["error"]["type"], "NotFoundError");
  EXPECT_EQ(ApiError(401, "x").to_json()["error"]["type"], "AuthenticationError");
}

}  // namespace
}  // namespace chimera::server
