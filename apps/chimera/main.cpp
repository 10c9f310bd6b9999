// chimera: inference for Nemotron-H / Nemotron 3 hybrid Mamba-2 / attention / MoE models.
// Exit status: 0 success, 1 runtime error, 2 bad usage or bad input (flags, files, configs, tensors).
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <system_error>

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
  app.add_option("--threads", threads, "CPU threads for the reference backend (default 0: all cores)")
      ->check(CLI::Validator(
          [](std::string& v) {
            int n = 0;
            return CLI::detail::lexical_cast(v, n) && n >= 0 && n <= 4096
                       ? std::string()
                       : "--threads must be an integer from 0 (all cores) to 4096, got " + v;
          },
          "INT in [0, 4096]"));
  // CHIMERA_ALLREDUCE_STRATEGY as the flag's environment name (docs/style.md 8: flags and env -> one validated
  // config); chimera_bench reads it through runtime/kernel_env.h with the same parser.
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
  gen.allreduce_strategy = bench.allreduce_strategy = serve.allreduce_strategy =
      *dist::strategy_from_name(allreduce_strategy);

  try {
    int rc = 2;
    if (g->parsed()) rc = cli::run_generate(gen);
    if (i->parsed()) rc = cli::run_info(info);
    if (bs->parsed()) rc = cli::run_bench_serve(bench_serve_opt, bench_serve_backend);
    else if (b->parsed()) rc = cli::run_bench(bench);
    if (s->parsed()) rc = cli::run_serve(serve);
    // What a command printed must have reached standard output (a full disk, a closed pipe: exit 1).
    if (std::fflush(stdout) != 0 || std::ferror(stdout)) {
      fmt::print(stderr, "chimera: error: writing to standard output failed: {}\n", std::strerror(errno));
      return 1;
    }
    return rc;
  } catch (const std::filesystem::filesystem_error& e) {
    std::fflush(stdout);
    fmt::print(stderr, "\nchimera: error: {}\n", e.what());
    return 1;
  } catch (const std::system_error& e) {  // fmt::print reports a failed write to stdout this way
    fmt::print(stderr, "\nchimera: error: writing output failed: {}\n", e.what());
    return 1;
  } catch (const Error& e) {
    std::fflush(stdout);
    fmt::print(stderr, "\nchimera: error: {}\n", e.what());
    return e.exit_code();
  } catch (const std::exception& e) {
    std::fflush(stdout);
    fmt::print(stderr, "\nchimera: internal error: {}\n", e.what());
    return 1;
  }
}
