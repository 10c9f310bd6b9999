// chimera: inference for Nemotron-H / Nemotron 3 hybrid Mamba-2 / attention / MoE models.
// Exit status: 0 success, 1 runtime error, 2 bad usage or bad input (flags, files, configs, tensors).
#include <cstdio>
#include <exception>

#include <fmt/core.h>

#include "commands.h"
#include "core/error.h"
#include "core/parallel.h"
#include "dist/strategy.h"

int main(int argc, char** argv) {
  using namespace chimera;
  CLI::App app{"chimera: an inference engine for Nemotron-H hybrid Mamba-2 / attention / MoE models"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "chimera 0.1.0");
  int threads = 0;
  app.add_option("--threads", threads, "CPU threads for the reference backend (default: all cores)")
      ->check(CLI::NonNegativeNumber);
  // The only place CHIMERA_ALLREDUCE_STRATEGY is read (docs/style.md 8: flags and env -> one validated config).
  std::string allreduce_strategy = "auto";
  app.add_option("--allreduce-strategy", allreduce_strategy,
                 "Tensor-parallel AllReduce strategy: auto, nccl, oneshot, twoshot")
      ->envname("CHIMERA_ALLREDUCE_STRATEGY")
      ->check([](const std::string& v) {
        return dist::strategy_from_name(v) ? std::string() : "expected auto, nccl, oneshot or twoshot";
      })
      ->capture_default_str();

  cli::GenerateOptions gen;
  cli::InfoOptions info;
  CLI::App* g = app.add_subcommand("generate", "Generate text from a prompt, streaming it as it is produced");
  cli::add_generate(*g, gen);
  CLI::App* i = app.add_subcommand("info", "Show a model's layer plan, parameter counts and memory needs");
  cli::add_info(*i, info);
  cli::BenchOptions bench;
  CLI::App* b = app.add_subcommand("bench", "End-to-end prefill and decode throughput, beside the batch-1 roofline");
  cli::add_bench(*b, bench);
  cli::ServeOptions serve;
  CLI::App* s = app.add_subcommand("serve", "An OpenAI-compatible HTTP server (completions, chat, metrics)");
  cli::add_serve(*s, serve);
  bench_serve::BenchServeOptions bench_serve_opt;
  std::string bench_serve_backend = "openai";
  CLI::App* bs = b->add_subcommand("serve", "Load-test an OpenAI-compatible server (vLLM's `vllm bench serve`)");
  cli::add_bench_serve(*bs, bench_serve_opt, bench_serve_backend);

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return 2;
  }
  if (threads > 0) set_num_threads(threads);
  gen.allreduce_strategy = *dist::strategy_from_name(allreduce_strategy);

  try {
    if (g->parsed()) return cli::run_generate(gen);
    if (i->parsed()) return cli::run_info(info);
    if (bs->parsed()) return cli::run_bench_serve(bench_serve_opt, bench_serve_backend);
    if (b->parsed()) return cli::run_bench(bench);
    if (s->parsed()) return cli::run_serve(serve);
  } catch (const Error& e) {
    std::fflush(stdout);
    fmt::print(stderr, "\nchimera: error: {}\n", e.what());
    return e.exit_code();
  } catch (const std::exception& e) {
    std::fflush(stdout);
    fmt::print(stderr, "\nchimera: internal error: {}\n", e.what());
    return 1;
  }
  return 2;
}
