#include "bench_serve/bench_serve.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <thread>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "bench_serve/client.h"
#include "bench_serve/dataset.h"
#include "bench_serve/metrics.h"
#include "core/error.h"
#include "tokenizer/tokenizer.h"

namespace chimera::bench_serve {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// Python's str(float): "inf", "2.0", "0.25" (the names vLLM writes into file names and its log).
std::string py_float(double v) {
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  if (v == std::floor(v) && std::fabs(v) < 1e16) return fmt::format("{:.1f}", v);
  return fmt::format("{}", v);
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, sep)) {
    item.erase(0, item.find_first_not_of(" \t"));
    item.erase(item.find_last_not_of(" \t") + 1);
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

std::vector<double> parse_percentiles(const std::string& s) {
  std::vector<double> out;
  for (const std::string& item : split(s, ',')) {
    size_t used = 0;
    double p = -1.0;
    try {
      p = std::stod(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != item.size() || !(p >= 0.0 && p <= 100.0)) {
      invalid_input("--metric-percentiles: '{}' is not a percentile in [0, 100]", item);
    }
    out.push_back(p);
  }
  if (out.empty()) invalid_input("--metric-percentiles is empty");
  return out;
}

// "99" for 99.0, "99.9" for 99.9: vLLM's label of a percentile.
std::string percentile_word(double p) {
  if (p == std::floor(p)) return fmt::format("{}", static_cast<int64_t>(p));
  return fmt::format("{}", p);
}

fs::path tokenizer_file(const std::string& flag_value, const char* flag) {
  fs::path p(flag_value);
  if (fs::is_directory(p)) p /= "tokenizer.json";
  if (!fs::is_regular_file(p)) invalid_input("{} {}: no tokenizer.json there", flag, flag_value);
  return p;
}

std::string local_date() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  localtime_r(&now, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y%m%d-%H%M%S", &tm);
  return buf;
}

void print_row(std::FILE* out, const std::string& label, const std::string& value) {
  fmt::print(out, "{:<40} {:<10}\n", label, value);
}
std::string f2(double v) {
  return fmt::format("{:.2f}", v);
}

}  // namespace

int run_bench_serve(const BenchServeOptions& opt, std::FILE* out) {
  // ---- options -> one validated configuration ----
  if (opt.dataset_name != "random" && opt.dataset_name != "multi-turn") {
    invalid_input("--dataset-name {}: expected random or multi-turn", opt.dataset_name);
  }
  std::string base_url = opt.base_url.empty() ? fmt::format("http://{}:{}", opt.host, opt.port) : opt.base_url;
  while (!base_url.empty() && base_url.back() == '/') base_url.pop_back();
  if (base_url.rfind("http://", 0) != 0 && base_url.rfind("https://", 0) != 0) {
    invalid_input("--base-url {}: expected http://HOST:PORT or https://...", opt.base_url);
  }
  if (opt.endpoint.empty() || opt.endpoint.front() != '/' || opt.endpoint.size() < 12 ||
      opt.endpoint.compare(opt.endpoint.size() - 11, 11, "completions") != 0) {
    invalid_input(
        "--endpoint {}: expected an OpenAI completions path such as /v1/completions or "
        "/v1/chat/completions",
        opt.endpoint);
  }
  if (opt.prompt_format != "ids" && opt.prompt_format != "text") {
    invalid_input("--prompt-format {}: expected ids or text", opt.prompt_format);
  }
  ClientConfig cfg;
  cfg.api_url = base_url + opt.endpoint;
  cfg.chat = opt.endpoint.size() >= 16 && opt.endpoint.compare(opt.endpoint.size() - 16, 16, "chat/completions") == 0;
  cfg.api_key = opt.api_key;
  cfg.max_concurrency = opt.max_concurrency;
  if (opt.max_concurrency < 0) invalid_input("--max-concurrency must be >= 1, got {}", opt.max_concurrency);
  for (const std::string& h : opt.headers) {
    const size_t eq = h.find('=');
    if (eq == std::string::npos || eq == 0) invalid_input("--header {}: expected KEY=VALUE", h);
    cfg.headers.push_back(h.substr(0, eq) + ": " + h.substr(eq + 1));
  }
  json extra = json::object();
  if (!opt.extra_body.empty()) {
    extra = json::parse(opt.extra_body, nullptr, false);
    if (extra.is_discarded() || !extra.is_object())
      invalid_input("--extra-body: not a JSON object: {}", opt.extra_body);
  }
  json sampling = {{"temperature", opt.temperature}};
  sampling.update(extra);
  const std::vector<double> percentiles = parse_percentiles(opt.metric_percentiles);
  const std::vector<std::string> selected = split(opt.percentile_metrics, ',');
  for (const std::string& m : selected) {
    if (m != "ttft" && m != "tpot" && m != "itl" && m != "e2el") {
      invalid_input("--percentile-metrics: unknown metric '{}' (ttft, tpot, itl, e2el)", m);
    }
  }
  if (!(opt.ready_check_timeout_sec >= 0.0)) invalid_input("--ready-check-timeout-sec must be >= 0");

  std::string tokenizer_flag = "--tokenizer", tokenizer_value = opt.tokenizer;
  if (tokenizer_value.empty() && !opt.model.empty() && fs::is_directory(opt.model)) {
    tokenizer_flag = "--model";
    tokenizer_value = opt.model;
  }
  if (tokenizer_value.empty()) {
    invalid_input("--tokenizer DIR is needed: the random dataset draws prompt token ids from its vocabulary");
  }
  const Tokenizer tok = Tokenizer::load(tokenizer_file(tokenizer_value, tokenizer_flag.c_str()));
  std::vector<int32_t> allowed;
  for (int64_t id = 0; id < tok.vocab_size(); ++id) {
    if (!tok.is_special(static_cast<int32_t>(id))) allowed.push_back(static_cast<int32_t>(id));
  }
  std::vector<SampleRequest> samples;
  std::vector<int64_t> previous_turn;  // multi-turn: each request's previous turn
  if (opt.dataset_name == "random") {
    RandomDatasetParams dp;
    dp.num_prompts = opt.num_prompts;
    dp.input_len = opt.random_input_len;
    dp.output_len = opt.random_output_len;
    dp.range_ratio = opt.random_range_ratio;
    dp.prefix_len = opt.random_prefix_len;
    dp.seed = opt.seed;
    samples = random_dataset(dp, allowed);
  } else {
    MultiTurnParams mp;
    mp.conversations = opt.multi_turn_conversations;
    mp.turns = opt.multi_turn_turns;
    mp.input_len = opt.random_input_len;
    mp.output_len = opt.random_output_len;
    mp.prefix_len = opt.random_prefix_len;
    mp.seed = opt.seed;
    for (MultiTurnRequest& r : multi_turn_dataset(mp, allowed)) {
      samples.push_back(std::move(r.sample));
      previous_turn.push_back(r.after);
    }
  }
  // A different stream of the same seed: the arrival times do not shift when the dataset's draws change.
  const std::vector<double> arrivals = arrival_times(static_cast<int64_t>(samples.size()), opt.request_rate,
                                                     opt.burstiness, opt.seed ^ 0x9e3779b97f4a7c15ull);

  std::string model_id = opt.model;
  if (model_id.empty()) {
    fmt::print(out, "Model not specified, fetching first model from server...\n");
    model_id = first_model_id(base_url, cfg);
    fmt::print(out, "Using model: {}\n", model_id);
  }
  const std::string model_name = opt.served_model_name.empty() ? model_id : opt.served_model_name;
  // As vLLM: the random dataset always sets ignore_eos on OpenAI-compatible backends, so every request
  // generates its drawn output length.
  const bool ignore_eos = opt.ignore_eos || opt.dataset_name == "random" || opt.dataset_name == "multi-turn";

  std::vector<PreparedRequest> requests(samples.size());
  for (size_t i = 0; i < samples.size(); ++i) {
    const bool as_text = cfg.chat || opt.prompt_format == "text";
    const std::string text = as_text ? tok.decode(samples[i].prompt_ids) : std::string();
    const std::vector<int32_t> none;
    requests[i].body = make_payload(model_name, cfg.chat, as_text ? none : samples[i].prompt_ids, text,
                                    samples[i].output_len, ignore_eos, sampling)
                           .dump();
    requests[i].prompt_len = samples[i].prompt_len;
    if (!previous_turn.empty()) requests[i].after = previous_turn[i];
  }

  // ---- the test request ----
  if (opt.ready_check_timeout_sec > 0.0) {
    fmt::print(out, "Starting initial single prompt test run...\n");
    std::fflush(out);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(opt.ready_check_timeout_sec);
    ClientConfig one = cfg;
    one.max_concurrency = 1;
    while (true) {
      RunResult r = run_requests(one, {requests[0]}, {0.0});
      const RequestOutput& o = r.outputs[0];
      if (o.success) break;
      // Only a server that is not up yet is waited for: no response, or a gateway / unavailable status.
      // Any other answer (a 4xx, a 500, a malformed stream) will not change by retrying.
      const bool starting = o.http_status == 0 || o.http_status == 502 || o.http_status == 503 || o.http_status == 504;
      if (!starting || std::chrono::steady_clock::now() + std::chrono::seconds(1) >= deadline) {
        if (!starting) runtime_error("the initial test request to {} failed: {}", cfg.api_url, o.error);
        runtime_error("the initial test request to {} failed within --ready-check-timeout-sec {}: {}", cfg.api_url,
                      py_float(opt.ready_check_timeout_sec), o.error);
      }
      std::this_thread::sleep_for(std::chrono::seconds(1));
    }
    fmt::print(out, "Initial test run completed.\n");
  } else {
    fmt::print(out, "Skipping endpoint ready check.\n");
  }
  fmt::print(out, "Starting main benchmark run...\n");
  fmt::print(out, "Traffic request rate: {}\n", py_float(opt.request_rate));
  fmt::print(out, "Burstiness factor: {} ({})\n", py_float(opt.burstiness),
             opt.burstiness == 1.0 ? "Poisson process" : "Gamma distribution");
  fmt::print(out, "Maximum request concurrency: {}\n",
             opt.max_concurrency > 0 ? std::to_string(opt.max_concurrency) : "None");
  std::fflush(out);

  // ---- the run ----
  // The server's speculative-decoding counters around the run (its /metrics; none: no such block).
  const std::optional<std::string> metrics_before = scrape_metrics(base_url, cfg);
  RunResult run = run_requests(cfg, requests, arrivals);
  const std::optional<std::string> metrics_after = scrape_metrics(base_url, cfg);
  for (RequestOutput& o : run.outputs) {
    // No usage block: count the text's tokens, as vLLM does.
    if (o.success && o.output_tokens == 0) {
      o.output_tokens = static_cast<int64_t>(tok.encode(o.generated_text).size());
      if (o.output_tokens == 0) o.output_tokens = o.content_chunks;
    }
  }
  const BenchmarkMetrics m = compute_metrics(run.outputs, run.duration_s, percentiles);

  // ---- vLLM's result block ----
  fmt::print(out, "{:=^50}\n", " Serving Benchmark Result ");
  print_row(out, "Successful requests:", std::to_string(m.completed));
  print_row(out, "Failed requests:", std::to_string(m.failed));
  if (opt.max_concurrency > 0) print_row(out, "Maximum request concurrency:", std::to_string(opt.max_concurrency));
  if (!std::isinf(opt.request_rate)) print_row(out, "Request rate configured (RPS):", f2(opt.request_rate));
  print_row(out, "Benchmark duration (s):", f2(run.duration_s));
  print_row(out, "Total input tokens:", std::to_string(m.total_input));
  print_row(out, "Total generated tokens:", std::to_string(m.total_output));
  print_row(out, "Request throughput (req/s):", f2(m.request_throughput));
  print_row(out, "Output token throughput (tok/s):", f2(m.output_throughput));
  print_row(out, "Peak output token throughput (tok/s):", f2(m.max_output_tokens_per_s));
  print_row(out, "Peak concurrent requests:", f2(static_cast<double>(m.max_concurrent_requests)));
  print_row(out, "Total token throughput (tok/s):", f2(m.total_token_throughput));

  json result;
  result["date"] = local_date();
  result["endpoint_type"] = "openai";
  result["backend"] = "openai";
  result["label"] = opt.label.empty() ? json(nullptr) : json(opt.label);
  result["model_id"] = model_id;
  result["tokenizer_id"] = tokenizer_value;
  result["num_prompts"] = static_cast<int64_t>(samples.size());
  result["request_rate"] = std::isinf(opt.request_rate) ? json("inf") : json(opt.request_rate);
  result["burstiness"] = opt.burstiness;
  result["max_concurrency"] = opt.max_concurrency > 0 ? json(opt.max_concurrency) : json(nullptr);
  result["base_url"] = base_url;
  result["endpoint"] = opt.endpoint;
  result["dataset_name"] = opt.dataset_name;
  result["prompt_format"] = cfg.chat ? "text" : opt.prompt_format;
  result["random_input_len"] = opt.random_input_len;
  result["random_output_len"] = opt.random_output_len;
  result["random_range_ratio"] = opt.random_range_ratio;
  result["random_prefix_len"] = opt.random_prefix_len;
  result["ignore_eos"] = ignore_eos;
  result["seed"] = opt.seed;
  result["duration"] = run.duration_s;
  result["completed"] = m.completed;
  result["failed"] = m.failed;
  result["total_input_tokens"] = m.total_input;
  result["total_output_tokens"] = m.total_output;
  result["request_throughput"] = m.request_throughput;
  result["request_goodput"] = nullptr;
  result["output_throughput"] = m.output_throughput;
  result["total_token_throughput"] = m.total_token_throughput;
  result["max_output_tokens_per_s"] = m.max_output_tokens_per_s;
  result["max_concurrent_requests"] = m.max_concurrent_requests;
  if (opt.save_detailed) {
    json input_lens = json::array(), output_lens = json::array(), ttfts = json::array(), itls = json::array(),
         texts = json::array(), errors = json::array();
    for (const RequestOutput& o : run.outputs) {
      input_lens.push_back(o.prompt_len);
      output_lens.push_back(o.success ? o.output_tokens : 0);
      ttfts.push_back(o.ttft);
      itls.push_back(o.itl);
      texts.push_back(o.generated_text);
      errors.push_back(o.error);
    }
    result["input_lens"] = input_lens;
    result["output_lens"] = output_lens;
    result["ttfts"] = ttfts;
    result["itls"] = itls;
    result["generated_texts"] = texts;
    result["errors"] = errors;
  }

  struct Section {
    const char* key;
    const char* name;
    const char* header;
    const MetricStats* stats;
  };
  const Section sections[] = {{"ttft", "TTFT", "Time to First Token", &m.ttft},
                              {"tpot", "TPOT", "Time per Output Token (excl. 1st token)", &m.tpot},
                              {"itl", "ITL", "Inter-token Latency", &m.itl},
                              {"e2el", "E2EL", "End-to-end Latency", &m.e2el}};
  for (const Section& s : sections) {
    if (std::find(selected.begin(), selected.end(), s.key) == selected.end()) continue;
    fmt::print(out, "{:-^50}\n", s.header);
    print_row(out, fmt::format("Mean {} (ms):", s.name), f2(s.stats->mean_ms));
    print_row(out, fmt::format("Median {} (ms):", s.name), f2(s.stats->median_ms));
    result[fmt::format("mean_{}_ms", s.key)] = s.stats->mean_ms;
    result[fmt::format("median_{}_ms", s.key)] = s.stats->median_ms;
    result[fmt::format("std_{}_ms", s.key)] = s.stats->std_ms;
    for (const auto& [p, v] : s.stats->percentiles_ms) {
      print_row(out, fmt::format("P{} {} (ms):", percentile_word(p), s.name), f2(v));
      result[fmt::format("p{}_{}_ms", percentile_word(p), s.key)] = v;
    }
  }
  if (metrics_before && metrics_after) {
    const SpecDecodeCounters before = parse_spec_decode_counters(*metrics_before);
    const SpecDecodeCounters after = parse_spec_decode_counters(*metrics_after);
    if (after.present) {
      const SpecDecodeResult sd = spec_decode_delta(before, after);
      fmt::print(out, "{:-^50}\n", "Speculative Decoding");
      print_row(out, "Acceptance rate (%):", f2(100.0 * sd.acceptance_rate));
      print_row(out, "Acceptance length:", f2(sd.acceptance_length));
      print_row(out, "Drafts:", fmt::format("{:.0f}", sd.drafts));
      print_row(out, "Draft tokens:", fmt::format("{:.0f}", sd.draft_tokens));
      print_row(out, "Accepted tokens:", fmt::format("{:.0f}", sd.accepted_tokens));
      std::string per;
      for (double r : sd.per_position_rate) per += (per.empty() ? "" : ", ") + f2(100.0 * r);
      print_row(out, "Per-position acceptance (%):", per);
      result["spec_decode_acceptance_rate"] = 100.0 * sd.acceptance_rate;
      result["spec_decode_acceptance_length"] = sd.acceptance_length;
      result["spec_decode_num_drafts"] = sd.drafts;
      result["spec_decode_draft_tokens"] = sd.draft_tokens;
      result["spec_decode_accepted_tokens"] = sd.accepted_tokens;
      json per_pos = json::array();
      for (double r : sd.per_position_rate) per_pos.push_back(100.0 * r);
      result["spec_decode_per_position_acceptance_rates"] = per_pos;
    }
  }
  if (metrics_before && metrics_after) {
    const PrefixCacheCounters before = parse_prefix_cache_counters(*metrics_before);
    const PrefixCacheCounters after = parse_prefix_cache_counters(*metrics_after);
    if (after.present) {
      const double queries = after.queries - before.queries, hits = after.hits - before.hits;
      fmt::print(out, "{:-^50}\n", "Prefix Cache");
      print_row(out, "Queried tokens:", fmt::format("{:.0f}", queries));
      print_row(out, "Hit tokens:", fmt::format("{:.0f}", hits));
      print_row(out, "Hit rate (%):", f2(queries > 0 ? 100.0 * hits / queries : 0.0));
      result["prefix_cache_queries"] = queries;
      result["prefix_cache_hits"] = hits;
      result["prefix_cache_hit_rate"] = queries > 0 ? 100.0 * hits / queries : 0.0;
    }
  }
  fmt::print(out, "{}\n", std::string(50, '='));

  // The distinct failure messages, most frequent first, so a broken server is diagnosed from the output.
  if (m.failed > 0) {
    std::map<std::string, int64_t> counts;
    for (const RequestOutput& o : run.outputs) {
      if (!o.success) ++counts[o.error];
    }
    std::vector<std::pair<int64_t, std::string>> by_count;
    for (const auto& [msg, c] : counts) by_count.emplace_back(c, msg);
    std::sort(by_count.begin(), by_count.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    fmt::print(out, "{} of {} requests failed:\n", m.failed, run.outputs.size());
    for (size_t i = 0; i < std::min<size_t>(by_count.size(), 5); ++i) {
      fmt::print(out, "  {} x {}\n", by_count[i].first, by_count[i].second);
    }
  }
  std::fflush(out);

  if (opt.save_result || !opt.result_filename.empty()) {
    std::string name = opt.result_filename;
    if (name.empty()) {
      std::string base_model =
          model_id.substr(model_id.find_last_of('/') == std::string::npos ? 0 : model_id.find_last_of('/') + 1);
      name = fmt::format("{}-{}qps{}-{}-{}.json", opt.label.empty() ? "openai" : opt.label, py_float(opt.request_rate),
                         opt.max_concurrency > 0 ? fmt::format("-concurrency{}", opt.max_concurrency) : "", base_model,
                         result["date"].get<std::string>());
    }
    fs::path path(name);
    if (!opt.result_dir.empty()) {
      fs::create_directories(opt.result_dir);
      path = fs::path(opt.result_dir) / path;
    }
    std::ofstream f(path);
    if (!f) runtime_error("--result-filename {}: cannot write", path.string());
    f << result.dump() << "\n";
    if (!f) runtime_error("--result-filename {}: write failed", path.string());
    fmt::print(out, "Saved the result to {}\n", path.string());
  }

  if (m.completed == 0) {
    runtime_error("all {} requests failed; the first error: {}", run.outputs.size(),
                  run.outputs.empty() ? std::string() : run.outputs[0].error);
  }
  return 0;
}

}  // namespace chimera::bench_serve
