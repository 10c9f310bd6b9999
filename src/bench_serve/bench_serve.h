// `chimera bench serve`: a load generator for any OpenAI-compatible server (chimera serve, vLLM, SGLang), with
// the flags, metrics, printed result block and saved JSON of vLLM's `vllm bench serve` (docs/bench_serve.md).
// Flow: validate the options -> draw the random dataset (token ids within the tokenizer's vocabulary) -> one
// test request (retried until --ready-check-timeout-sec) -> every request at its arrival time under
// --max-concurrency -> metrics -> the block on `out` -> the JSON file with --save-result.
#pragma once

#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

namespace chimera::bench_serve {

struct BenchServeOptions {
  std::string base_url;  // "" = http://host:port
  std::string host = "127.0.0.1";
  int32_t port = 8000;
  std::string endpoint = "/v1/completions";
  std::string model;              // "" = the first model of GET /v1/models
  std::string served_model_name;  // sent as "model" when set
  std::string tokenizer;          // DIR (with tokenizer.json) or a tokenizer.json; "" = --model when it is a DIR
  std::string label;
  std::string dataset_name = "random";
  std::string prompt_format = "ids";  // /v1/completions prompts: "ids" (token-id lists) or "text" (decoded)
  int64_t random_input_len = 1024;
  int64_t random_output_len = 128;
  double random_range_ratio = 0.0;
  int64_t random_prefix_len = 0;
  int64_t num_prompts = 1000;
  // --dataset-name multi-turn (dataset.h MultiTurnParams): conversations and turns per conversation (the request
  // count is their product; --random-input-len / --random-output-len / --random-prefix-len size the turns).
  int64_t multi_turn_conversations = 16;
  int64_t multi_turn_turns = 4;
  int64_t max_concurrency = 0;  // 0 = unlimited (vLLM's None)
  double request_rate = std::numeric_limits<double>::infinity();
  double burstiness = 1.0;
  bool ignore_eos = false;
  uint64_t seed = 0;
  double temperature = 0.0;
  std::string extra_body;            // a JSON object merged into every payload
  std::vector<std::string> headers;  // KEY=VALUE
  std::string api_key;
  std::string percentile_metrics = "ttft,tpot,itl";
  std::string metric_percentiles = "99";
  double ready_check_timeout_sec = 600.0;  // 0 = no test request
  bool save_result = false;
  bool save_detailed = false;
  std::string result_dir;
  std::string result_filename;
};

// Exit status: 0 when the run completed and at least one request succeeded (failed ones are counted and
// reported, as vLLM does); throws Error (kInvalidInput: bad options; kRuntime: the test request never
// succeeded, or every request failed) otherwise.
int run_bench_serve(const BenchServeOptions& opt, std::FILE* out);

}  // namespace chimera::bench_serve
