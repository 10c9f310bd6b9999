// Tool calls end to end through the real HTTP server: a test model (the runtime's Model interface) answers a
// chat with a scripted token sequence, the bundled tokenizer's encoding of Nemotron 3 Nano's published
// reply format (reasoning, then a <tool_call> block, then end of sequence). The chat is rendered by Nano's
// own template (tests/fixtures/chat_templates), the engine loop runs the model, the OpenAI routes run the
// nemotron_v3 reasoning and tool-call parsers, and a libcurl client reads `tool_calls`, `reasoning_content` and
// finish_reason "tool_calls", in one response and as SSE deltas.
#include <curl/curl.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "chat/chat_template.h"
#include "common/compare.h"
#include "core/error.h"
#include "io/model_config.h"
#include "runtime/engine.h"
#include "runtime/model.h"
#include "server/engine_loop.h"
#include "server/http_server.h"
#include "server/metrics.h"
#include "server/openai_server.h"
#include "tokenizer/tokenizer.h"

namespace chimera {
namespace {

using nlohmann::json;

// Emits `script` after a prompt of `prompt_len` tokens, then end of sequence: the logits row of position p puts
// all its mass on script[p + 1 - prompt_len]. The caches' geometry comes from the bundled model's config.
class ScriptedModel : public Model {
 public:
  ScriptedModel(ModelConfig config, std::vector<int32_t> script, int32_t prompt_len)
      : config_(std::move(config)), script_(std::move(script)), prompt_len_(prompt_len) {}
  const ModelConfig& config() const override { return config_; }
  Device device() const override { return Device::kCpu; }
  DType activation_dtype() const override { return DType::kF32; }
  Tensor forward(const ops::Context&, const StepBatch& b, ModelState&) const override {
    const int64_t V = config_.vocab_size;
    Tensor out = Tensor::zeros(DType::kF32, {static_cast<int64_t>(b.logit_rows.size()), V});
    for (size_t i = 0; i < b.logit_rows.size(); ++i) {
      const int32_t row = b.logit_rows[i];
      int32_t s = 0;
      while (b.cu_seqlens[static_cast<size_t>(s) + 1] <= row) ++s;
      const int64_t pos = b.context_lens[static_cast<size_t>(s)] + row - b.cu_seqlens[static_cast<size_t>(s)];
      const int64_t next = pos + 1 - prompt_len_;
      const int32_t tok = next >= 0 && next < static_cast<int64_t>(script_.size()) ? script_[static_cast<size_t>(next)]
                                                                                  : config_.eos_token_ids.at(0);
      out.f32()[static_cast<int64_t>(i) * V + tok] = 30.0f;
    }
    return out;
  }
  Tensor forward_device(const ops::Context&, const StepBatch&, ModelState&) const override {
    runtime_error("ScriptedModel runs on the CPU only");
  }

 private:
  ModelConfig config_;
  std::vector<int32_t> script_;
  int32_t prompt_len_;
};

size_t collect(char* data, size_t size, size_t n, void* out) {
  static_cast<std::string*>(out)->append(data, size * n);
  return size * n;
}

// One POST with a JSON body; returns (HTTP status, body).
std::pair<long, std::string> post(const std::string& url, const json& body) {
  CURL* c = curl_easy_init();
  std::string payload = body.dump(), response;
  curl_slist* headers = curl_slist_append(nullptr, "Content-Type: application/json");
  curl_easy_setopt(c, CURLOPT_URL, url.c_str());
  curl_easy_setopt(c, CURLOPT_HTTPHEADER, headers);
  curl_easy_setopt(c, CURLOPT_POSTFIELDS, payload.c_str());
  curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, collect);
  curl_easy_setopt(c, CURLOPT_WRITEDATA, &response);
  curl_easy_setopt(c, CURLOPT_TIMEOUT, 60L);
  const CURLcode rc = curl_easy_perform(c);
  long status = 0;
  curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &status);
  curl_slist_free_all(headers);
  curl_easy_cleanup(c);
  if (rc != CURLE_OK) return {0, curl_easy_strerror(rc)};
  return {status, response};
}

std::string read_file(const std::filesystem::path& p) {
  std::ifstream f(p);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

const json kTools = json::parse(R"([{"type": "function", "function": {
  "name": "get_weather", "description": "The forecast of a city",
  "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                 "required": ["city"]}}}])");
const json kMessages = json::parse(R"([
  {"role": "system", "content": "You are a helpful assistant."},
  {"role": "user", "content": "What is the weather in Paris for the next 3 days?"}])");
// Nano's reply after its generation prompt "<|im_start|>assistant\n<think>\n": the reasoning, then a tool call
// in the format its template teaches.
constexpr const char* kReasoning = "The user wants a forecast, so I call get_weather.\n";
constexpr const char* kReply =
    "</think>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
    "</parameter>\n</function>\n</tool_call>\n";

class ToolCallsEndToEnd : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::filesystem::path dir = test::source_path("models/nemotron-h-tiny");
    config_ = load_model_config(dir);
    tokenizer_ = std::make_unique<Tokenizer>(Tokenizer::load(dir / "tokenizer.json"));
    template_ = std::make_unique<chat::ChatTemplate>(chat::ChatTemplate::from_string(
        read_file(test::source_path("tests/fixtures/chat_templates/nvidia-nemotron-3-nano-30b-a3b.jinja")), "<s>",
        "</s>", "nano"));
    // The prompt as the server renders and encodes it, so the model knows where its reply starts.
    const std::string prompt = template_->render(kMessages, kTools, true, json::object());
    ASSERT_NE(prompt.find("<function=example_function_name>"), std::string::npos) << "the template's tool format";
    prompt_len_ = static_cast<int32_t>(tokenizer_->encode(prompt, false).size());
    script_ = tokenizer_->encode(reply(), false);
    // The script decodes back to itself (the test is about the parsers, not the tokenizer).
    ASSERT_EQ(tokenizer_->decode(script_, false), reply());
    model_ = std::make_unique<ScriptedModel>(config_, script_, prompt_len_);

    EngineConfig ec;
    ec.cache.max_seqs = 4;
    ec.cache.max_model_len = 4096;
    ec.scheduler.max_num_seqs = 4;
    ec.scheduler.max_num_batched_tokens = 256;  // the prompt arrives in several prefill chunks
    engine_ = std::make_unique<Engine>(*model_, ops::Context{Device::kCpu, nullptr}, ec);
    metrics_ = std::make_unique<server::Metrics>("nano-script", ec.cache.max_model_len);
    loop_ = std::make_unique<server::EngineLoop>(*engine_, *metrics_, server::EngineLoopConfig{}, 4);
    server::ServerConfig sc;
    sc.served_model_name = "nano-script";
    sc.max_model_len = ec.cache.max_model_len;
    sc.vocab_size = config_.vocab_size;
    sc.reasoning_parser = "nemotron_v3";
    sc.tool_call_parser = "nemotron_v3";
    api_ = std::make_unique<server::OpenAiServer>(sc, tokenizer_.get(), template_.get(), *loop_, *metrics_);
    server::HttpServerConfig hc;
    hc.port = 0;
    hc.io_threads = 2;
    http_ = std::make_unique<server::HttpServer>(hc, [this](server::HttpRequest req,
                                                            std::shared_ptr<server::Responder> r) {
      api_->handle(std::move(req), std::move(r));
    });
    url_ = "http://127.0.0.1:" + std::to_string(http_->listen()) + "/v1/chat/completions";
    http_->start();
  }
  // The model's scripted reply.
  virtual std::string reply() const { return std::string(kReasoning) + kReply; }

  void TearDown() override {
    if (http_) http_->stop_accepting();
    if (loop_) loop_->stop();
    if (http_) http_->stop();
  }

  // skip_special_tokens: absent (the OpenAI default, true) or as given. </think> is a special token of the
  // bundled tokenizer and of Nano's, which the detokenizer drops when skipping them: the reasoning parser
  // finds it by token id either way.
  json request(bool stream, std::optional<bool> skip_special_tokens) const {
    json body = {{"model", "nano-script"}, {"messages", kMessages}, {"tools", kTools}, {"max_tokens", 200},
                 {"temperature", 0}};
    if (skip_special_tokens) body["skip_special_tokens"] = *skip_special_tokens;
    if (stream) body["stream"] = true;
    return body;
  }

  void expect_one_response(std::optional<bool> skip_special_tokens) const;
  void expect_streamed_deltas(std::optional<bool> skip_special_tokens) const;

  static void expect_call(const json& call) {
    EXPECT_EQ(call["type"], "function");
    EXPECT_EQ(call["id"].get<std::string>().rfind("call_", 0), 0u) << call.dump();
    EXPECT_EQ(call["function"]["name"], "get_weather");
    ASSERT_TRUE(call["function"]["arguments"].is_string());
    // The arguments are a JSON string, typed by the tool's schema: "days" is an integer.
    EXPECT_EQ(json::parse(call["function"]["arguments"].get<std::string>()), json({{"city", "Paris"}, {"days", 3}}));
  }

  ModelConfig config_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<chat::ChatTemplate> template_;
  int32_t prompt_len_ = 0;
  std::vector<int32_t> script_;
  std::unique_ptr<ScriptedModel> model_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<server::Metrics> metrics_;
  std::unique_ptr<server::EngineLoop> loop_;
  std::unique_ptr<server::OpenAiServer> api_;
  std::unique_ptr<server::HttpServer> http_;
  std::string url_;
};

void ToolCallsEndToEnd::expect_one_response(std::optional<bool> skip_special_tokens) const {
  const auto [status, body] = post(url_, request(false, skip_special_tokens));
  ASSERT_EQ(status, 200) << body;
  const json r = json::parse(body);
  EXPECT_EQ(r["object"], "chat.completion");
  EXPECT_EQ(r["usage"]["prompt_tokens"], prompt_len_);
  EXPECT_EQ(r["usage"]["completion_tokens"], static_cast<int64_t>(script_.size()) + 1);  // and the EOS
  const json& choice = r["choices"][0];
  EXPECT_EQ(choice["finish_reason"], "tool_calls");
  const json& m = choice["message"];
  EXPECT_EQ(m["role"], "assistant");
  EXPECT_EQ(m["reasoning_content"], kReasoning);
  // Only whitespace around the call: no content (null, as vLLM's parsers leave it, or blank).
  EXPECT_TRUE(m["content"].is_null() || m["content"].get<std::string>().find_first_not_of(" \n") == std::string::npos)
      << m.dump();
  ASSERT_EQ(m["tool_calls"].size(), 1u) << m.dump();
  expect_call(m["tool_calls"][0]);
}

void ToolCallsEndToEnd::expect_streamed_deltas(std::optional<bool> skip_special_tokens) const {
  const auto [status, body] = post(url_, request(true, skip_special_tokens));
  ASSERT_EQ(status, 200) << body;
  std::istringstream lines(body);
  std::string line, reasoning, content;
  std::vector<json> calls, finishes;
  bool done = false;
  for (int n = 0; std::getline(lines, line);) {
    if (line.empty()) continue;
    ASSERT_EQ(line.rfind("data: ", 0), 0u) << line;
    ASSERT_FALSE(done) << "data after [DONE]";
    const std::string data = line.substr(6);
    if (data == "[DONE]") {
      done = true;
      continue;
    }
    const json chunk = json::parse(data);
    EXPECT_EQ(chunk["object"], "chat.completion.chunk");
    const json& choice = chunk["choices"][0];
    const json& delta = choice["delta"];
    if (n++ == 0) {
      EXPECT_EQ(delta["role"], "assistant");  // the first delta names the role, as OpenAI's
    }
    if (delta.contains("reasoning_content")) reasoning += delta["reasoning_content"].get<std::string>();
    if (delta.contains("content") && delta["content"].is_string()) content += delta["content"].get<std::string>();
    if (delta.contains("tool_calls")) {
      for (const json& c : delta["tool_calls"]) calls.push_back(c);
    }
    if (!choice["finish_reason"].is_null()) finishes.push_back(choice["finish_reason"]);
  }
  EXPECT_TRUE(done);
  EXPECT_EQ(reasoning, kReasoning);
  EXPECT_EQ(content.find_first_not_of(" \n"), std::string::npos) << content;
  // One call, sent whole in one delta with its index (OpenAI clients accumulate deltas by index).
  ASSERT_EQ(calls.size(), 1u);
  EXPECT_EQ(calls[0]["index"], 0);
  expect_call(calls[0]);
  EXPECT_EQ(finishes, std::vector<json>{"tool_calls"});
}

// A reply with another special token (<|im_start|>, id 3) in its content: skip_special_tokens still decides
// that one, while the think tags split the same way whatever it says.
class ReasoningEndToEnd : public ToolCallsEndToEnd {
 protected:
  std::string reply() const override { return "Think <b>.\n</think>\nHi<|im_start|> there."; }

  // (reasoning_content, content) of one response, then of the streamed deltas joined.
  std::pair<std::pair<json, json>, std::pair<std::string, std::string>> split(std::optional<bool> skip) const {
    std::pair<std::pair<json, json>, std::pair<std::string, std::string>> out;
    auto [status, body] = post(url_, request(false, skip));
    EXPECT_EQ(status, 200) << body;
    const json m = json::parse(body)["choices"][0]["message"];
    out.first = {m["reasoning_content"], m["content"]};
    std::tie(status, body) = post(url_, request(true, skip));
    EXPECT_EQ(status, 200) << body;
    std::istringstream lines(body);
    for (std::string line; std::getline(lines, line);) {
      if (line.rfind("data: {", 0) != 0) continue;
      const json delta = json::parse(line.substr(6))["choices"][0]["delta"];
      if (delta.contains("reasoning_content")) out.second.first += delta["reasoning_content"].get<std::string>();
      if (delta.contains("content") && delta["content"].is_string()) {
        out.second.second += delta["content"].get<std::string>();
      }
    }
    return out;
  }
};

TEST_F(ReasoningEndToEnd, TagsSplitWhateverSkipSpecialTokensSays) {
  for (std::optional<bool> skip : {std::optional<bool>(), std::optional<bool>(true), std::optional<bool>(false)}) {
    SCOPED_TRACE(skip ? (*skip ? "skip_special_tokens true" : "skip_special_tokens false") : "default");
    const std::string content = skip == false ? "\nHi<|im_start|> there." : "\nHi there.";
    const auto [whole, streamed] = split(skip);
    EXPECT_EQ(whole.first, "Think <b>.\n");
    EXPECT_EQ(whole.second, content);
    EXPECT_EQ(streamed.first, "Think <b>.\n");
    EXPECT_EQ(streamed.second, content);
  }
}

TEST_F(ToolCallsEndToEnd, OneResponseCarriesToolCallsAndReasoning) { expect_one_response(std::nullopt); }
TEST_F(ToolCallsEndToEnd, OneResponseSkippingSpecialTokens) { expect_one_response(true); }
TEST_F(ToolCallsEndToEnd, OneResponseKeepingSpecialTokens) { expect_one_response(false); }
TEST_F(ToolCallsEndToEnd, StreamedDeltasCarryToolCallsAndReasoning) { expect_streamed_deltas(std::nullopt); }
TEST_F(ToolCallsEndToEnd, StreamedDeltasSkippingSpecialTokens) { expect_streamed_deltas(true); }
TEST_F(ToolCallsEndToEnd, StreamedDeltasKeepingSpecialTokens) { expect_streamed_deltas(false); }

}  // namespace
}  // namespace chimera
