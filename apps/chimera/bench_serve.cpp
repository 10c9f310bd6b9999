// chimera bench serve: the flags of vLLM's `vllm bench serve` (same names and meanings) -> BenchServeOptions;
// the work is in src/bench_serve/.
#include <limits>

#include "commands.h"

namespace chimera::cli {

void add_bench_serve(CLI::App& app, bench_serve::BenchServeOptions& o, std::string& backend) {
  const CLI::Range kPositive(int64_t{1}, std::numeric_limits<int64_t>::max());
  app.add_option("--base-url", o.base_url, "Server base URL (default http://HOST:PORT), e.g. http://127.0.0.1:8000");
  app.add_option("--host", o.host, "Server host when --base-url is not given")->capture_default_str();
  app.add_option("--port", o.port, "Server port when --base-url is not given")
      ->check(CLI::Range(1, 65535))
      ->capture_default_str();
  app.add_option("--endpoint", o.endpoint, "API path: /v1/completions or /v1/chat/completions")->capture_default_str();
  app.add_option("--backend", backend, "openai / vllm (completions) or openai-chat (chat completions)")
      ->check(CLI::IsMember({"openai", "vllm", "openai-chat"}))
      ->capture_default_str();
  app.add_option("--model", o.model, "Model name sent in each request (default: the server's first model)");
  app.add_option("--served-model-name", o.served_model_name, "Name sent as 'model' when it differs from --model");
  app.add_option("--tokenizer", o.tokenizer,
                 "Model directory (or tokenizer.json) whose vocabulary the prompt ids come from (default: --model "
                 "when it is a directory)");
  app.add_option("--label", o.label, "Label of the result (file name prefix; default openai)");
  app.add_option("--dataset-name", o.dataset_name,
                 "Dataset: random, or multi-turn (a chat replay: every turn resends the conversation so far)")
      ->capture_default_str();
  app.add_option("--multi-turn-conversations", o.multi_turn_conversations, "multi-turn: conversations")
      ->check(kPositive)
      ->capture_default_str();
  app.add_option("--multi-turn-turns", o.multi_turn_turns, "multi-turn: turns per conversation")
      ->check(kPositive)
      ->capture_default_str();
  app.add_option("--prompt-format", o.prompt_format,
                 "Completions prompts as token-id lists (exact lengths) or as their decoded text")
      ->check(CLI::IsMember({"ids", "text"}))
      ->capture_default_str();
  app.add_option("--random-input-len", o.random_input_len, "Random dataset: input tokens per request")
      ->check(kPositive)
      ->capture_default_str();
  app.add_option("--random-output-len", o.random_output_len, "Random dataset: output tokens per request")
      ->check(kPositive)
      ->capture_default_str();
  app.add_option("--random-range-ratio", o.random_range_ratio,
                 "Random dataset: lengths drawn from [len * (1 - r), len * (1 + r)], r in [0, 1)")
      ->capture_default_str();
  app.add_option("--random-prefix-len", o.random_prefix_len,
                 "Random dataset: tokens of one random prefix shared by every prompt, before its own input")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--num-prompts", o.num_prompts, "Number of requests")->check(kPositive)->capture_default_str();
  app.add_option("--max-concurrency", o.max_concurrency, "Most requests in flight at once (default: unlimited)")
      ->check(kPositive);
  app.add_option("--request-rate", o.request_rate,
                 "Requests per second, Poisson arrivals (Gamma with --burstiness); inf: all at time 0")
      ->capture_default_str();
  app.add_option("--burstiness", o.burstiness, "Gamma shape of the arrival gaps: 1 Poisson, <1 burstier, >1 steadier")
      ->capture_default_str();
  app.add_flag("--ignore-eos", o.ignore_eos, "Send ignore_eos (the random dataset always does, as vLLM)");
  app.add_option("--seed", o.seed, "Seed of the dataset and of the arrival times")->capture_default_str();
  app.add_option("--temperature", o.temperature, "Sampling temperature sent with each request")->capture_default_str();
  app.add_option("--extra-body", o.extra_body, "JSON object merged into every request body");
  app.add_option("--header", o.headers, "Extra request header KEY=VALUE (repeatable)");
  app.add_option("--api-key", o.api_key, "Bearer token for the Authorization header")->envname("OPENAI_API_KEY");
  app.add_option("--percentile-metrics", o.percentile_metrics, "Metrics to report: ttft,tpot,itl,e2el")
      ->capture_default_str();
  app.add_option("--metric-percentiles", o.metric_percentiles, "Percentiles to report, comma-separated")
      ->capture_default_str();
  app.add_option("--ready-check-timeout-sec", o.ready_check_timeout_sec,
                 "Retry the initial test request this long before giving up; 0 skips it")
      ->capture_default_str();
  app.add_flag("--save-result", o.save_result, "Write the result as JSON (see --result-filename, --result-dir)");
  app.add_flag("--save-detailed", o.save_detailed, "Also save per-request lengths, TTFTs, ITLs, texts and errors");
  app.add_option("--result-dir", o.result_dir, "Directory of the result file");
  app.add_option("--result-filename", o.result_filename,
                 "Result file name (implies --save-result; default {label}-{rate}qps[-concurrencyN]-{model}-{date}"
                 ".json)");
  app.add_flag("--disable-tqdm")->description("Accepted for vLLM command lines; there is no progress bar");
}

int run_bench_serve(bench_serve::BenchServeOptions o, const std::string& backend) {
  if (backend == "openai-chat" && o.endpoint == "/v1/completions") o.endpoint = "/v1/chat/completions";
  return bench_serve::run_bench_serve(o, stdout);
}

}  // namespace chimera::cli
