// --tensor-parallel-size on bench, serve and info, through the real binary (generate's is in cli_test.cpp;
// serve's greedy text through the openai client is tests/server/test_tensor_parallel.py).
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "backends/device_api.h"
#include "common/compare.h"
#include "common/run_command.h"
#include "core/error.h"
#include "io/model_config.h"
#include "io/model_presets.h"
#include "io/safetensors.h"
#include "models/nemotron_h.h"
#include "models/nemotron_h_weights.h"
#include "models/tensor_parallel.h"

namespace chimera {
namespace {

namespace fs = std::filesystem;

// Under a time limit: a `serve` that wrongly started would wait for a signal forever.
test::RunOutput run_cli(const std::string& args) {
  return test::run_shell("timeout 120 " + std::string(CHIMERA_CLI_PATH) + " " + args + " 2>&1");
}

// The byte column of one row of info's memory plan ("  KV cache    0.19 GiB   201326592 B").
int64_t plan_bytes(const std::string& out, const std::string& row) {
  const size_t at = out.find("\n  " + row + " ", out.find("\nmemory plan"));
  if (at == std::string::npos) return -1;
  const std::string line = out.substr(at + 1, out.find('\n', at + 1) - at - 1);
  std::istringstream in(line.substr(line.find("GiB") + 3));
  int64_t bytes = -1;
  in >> bytes;
  return bytes;
}

nlohmann::json bench_json(const std::string& args, const fs::path& json) {
  fs::remove(json);
  auto r = run_cli("bench " + args + " --json-out " + json.string());
  EXPECT_EQ(r.status, 0) << r.out;
  std::ifstream f(json);
  return f.good() ? nlohmann::json::parse(f) : nlohmann::json::object();
}

TEST(CliTensorParallel, BenchAtTwoRanksGivesTheSameTokensAndNotesTheSize) {
  const std::string args =
      "--synthetic tiny --input-lens 16,40 --batch-sizes 1,3 --decode-context 8 --decode-steps 4 "
      "--warmup 1";
  const fs::path json = fs::temp_directory_path() / "chimera_cli_bench_tp.json";
  const nlohmann::json one = bench_json(args, json);
  const nlohmann::json two = bench_json(args + " --tensor-parallel-size 2", json);
  fs::remove(json);
  EXPECT_EQ(one["tensor_parallel_size"], 1);
  EXPECT_EQ(two["tensor_parallel_size"], 2);
  ASSERT_EQ(one["prefill"].size(), 2u);
  ASSERT_EQ(two["prefill"].size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(two["prefill"][i]["status"], "ok") << two["prefill"][i].dump();
    EXPECT_GE(one["prefill"][i]["first_token"].get<int>(), 0);
    EXPECT_EQ(two["prefill"][i]["first_token"], one["prefill"][i]["first_token"]) << i;
  }
  ASSERT_EQ(one["decode"].size(), 2u);
  ASSERT_EQ(two["decode"].size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(two["decode"][i]["status"], "ok") << two["decode"][i].dump();
    EXPECT_GT(one["decode"][i]["tokens_of_sequence_0"].size(), 4u);
    EXPECT_EQ(two["decode"][i]["tokens_of_sequence_0"], one["decode"][i]["tokens_of_sequence_0"]) << i;
  }
  auto r = run_cli(
      "bench --synthetic tiny --input-lens 8 --batch-sizes 1 --decode-context 4 --decode-steps 1 "
      "--tensor-parallel-size 2 --moe-split intermediate");
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("| tensor parallel 2, AllReduce host |"), std::string::npos) << r.out;
  // auto: the tiny preset's 128 expert columns over 2 ranks are narrow, so its experts split by expert.
  EXPECT_EQ(two["expert_parallel"], true) << two.dump();
  EXPECT_EQ(two["moe_split"], "auto") << two.dump();
}

TEST(CliTensorParallel, BenchWithTheExpertsSplitByExpertGivesTheSameTokens) {
  const std::string args = "--synthetic tiny --input-lens 16 --batch-sizes 1,3 --decode-context 8 --decode-steps 4";
  const fs::path json = fs::temp_directory_path() / "chimera_cli_bench_ep.json";
  const nlohmann::json one = bench_json(args, json);
  const nlohmann::json ep = bench_json(args + " --tensor-parallel-size 2 --moe-split expert", json);
  fs::remove(json);
  EXPECT_EQ(ep["expert_parallel"], true) << ep.dump();
  ASSERT_EQ(ep["decode"].size(), one["decode"].size());
  ASSERT_EQ(one["decode"].size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_GT(one["decode"][i]["tokens_of_sequence_0"].size(), 2u);
    EXPECT_EQ(ep["decode"][i]["tokens_of_sequence_0"], one["decode"][i]["tokens_of_sequence_0"]) << i;
  }
  EXPECT_EQ(ep["prefill"][0]["first_token"], one["prefill"][0]["first_token"]);
  auto r = run_cli("bench --synthetic tiny --input-lens 8 --batch-sizes 1 --decode-context 4 --decode-steps 1 "
                   "--tensor-parallel-size 2 --moe-split expert");
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("| tensor parallel 2 (experts by expert), AllReduce host |"), std::string::npos) << r.out;
}

TEST(CliTensorParallel, InfoPrintsThePerRankPlanDividedWhereItShards) {
  // Tiny: 2 KV heads, 8 Mamba heads in 2 groups. At 2 ranks every KV and Mamba state byte halves; at 4 the KV
  // heads are replicated (one per rank: half the bytes), the Mamba heads quartered.
  const std::string cmd = "info --synthetic tiny --dtype float32 --max-num-seqs 4 --max-model-len 256";
  auto one = run_cli(cmd);
  auto two = run_cli(cmd + " --tensor-parallel-size 2");
  auto four = run_cli(cmd + " --tensor-parallel-size 4");
  ASSERT_EQ(one.status, 0) << one.out;
  ASSERT_EQ(two.status, 0) << two.out;
  ASSERT_EQ(four.status, 0) << four.out;
  EXPECT_NE(two.out.find("memory plan per rank of --tensor-parallel-size 2 (F32"), std::string::npos) << two.out;
  EXPECT_NE(two.out.find("  2 ranks "), std::string::npos) << two.out;
  // What --moe-split auto picks: the tiny preset's 128 expert columns are narrow at any size, its 16 experts divide.
  EXPECT_NE(two.out.find("routed experts split by expert: 8 whole experts a rank (--moe-split auto)"),
            std::string::npos)
      << two.out;
  const auto nano = run_cli("info --synthetic nemotron-3-nano-30b-a3b --tensor-parallel-size 2");
  EXPECT_NE(nano.out.find("routed experts split by intermediate column: 928 of 1856 a rank"), std::string::npos)
      << nano.out;
  const int64_t kv = plan_bytes(one.out, "KV cache"), mamba = plan_bytes(one.out, "Mamba state");
  ASSERT_GT(kv, 0) << one.out;
  ASSERT_GT(mamba, 0) << one.out;
  EXPECT_EQ(plan_bytes(two.out, "KV cache"), kv / 2) << two.out;
  EXPECT_EQ(plan_bytes(two.out, "Mamba state"), mamba / 2) << two.out;
  EXPECT_EQ(plan_bytes(four.out, "KV cache"), kv / 2) << four.out;
  // The weights per rank are the sharded byte counts: rank 0's tensors as the synthetic source cuts them by the
  // name table's shard column (the MTP head is not in the plan).
  const ModelConfig c = model_preset("tiny");
  for (const auto& [size, out] : {std::pair{2, two.out}, {4, four.out}}) {
    ModelOptions options;
    options.dtype = DType::kF32;  // info --dtype float32: every weight 4 bytes on either side
    options.tp = {0, size};
    const NemotronH rank0 = NemotronH::synthetic(c, options, 0);
    int64_t sharded = 0;
    for (const auto& [kind, k] : weight_summary(c, rank0.weights())) sharded += kind == "mtp" ? 0 : k.bytes;
    EXPECT_EQ(plan_bytes(out, "weights"), sharded) << size << "\n" << out;
    EXPECT_LT(sharded, plan_bytes(one.out, "weights"));
  }
}

TEST(CliTensorParallel, InfoPrintsAModelOptCheckpointsPerRankBytesAsTheRankHoldsThem) {
  // A ModelOpt checkpoint's weights are counted as stored, each tensor by rank 0's share of it (NVFP4 bytes and
  // block scales cut with their columns, scalar scales whole): the bytes of rank 0's model loaded from the file
  // (its dense tensors are F32 there, as info --dtype float32 counts them).
  for (const std::string name : {"all_kinds-nvfp4", "super_like-mixed"}) {
    const std::string dir = test::source_path("tests/fixtures/quant/models/" + name);
    const ModelConfig c = load_model_config(dir);
    const Checkpoint ck = Checkpoint::open(dir);
    const std::string cmd = "info -m " + dir + " --dtype float32 --max-num-seqs 1 --max-model-len 64";
    auto one = run_cli(cmd);
    ASSERT_EQ(one.status, 0) << one.out;
    for (const int size : {2, 4}) {
      ModelOptions options{Device::kCpu, DType::kF32};
      options.tp = {0, size};
      try {
        rank_config(c, options.tp);
      } catch (const Error&) {
        continue;  // the fixture's sizes do not split
      }
      std::optional<NemotronH> rank0;
      try {
        rank0.emplace(NemotronH::load(c, ck, options));
      } catch (const Error&) {
        continue;  // an NVFP4 cut inside a 16-column block: the rank cannot be made
      }
      int64_t held = 0;
      for (const auto& [kind, k] : weight_summary(c, rank0->weights())) held += kind == "mtp" ? 0 : k.bytes;
      auto r = run_cli(cmd + " --tensor-parallel-size " + std::to_string(size));
      ASSERT_EQ(r.status, 0) << r.out;
      EXPECT_EQ(plan_bytes(r.out, "weights"), held) << name << " at " << size << "\n" << r.out;
      EXPECT_LT(held, plan_bytes(one.out, "weights")) << name;
    }
  }
}

TEST(CliTensorParallel, SizesThatDoNotSplitNameTheConfigField) {
  // 4096 / 3 does not divide; at 8 the vocabulary does (512) but the 4 attention heads do not.
  for (const char* sub : {"info", "bench --input-lens 8 --batch-sizes 1", "generate --prompt-ids 1 -n 1"}) {
    auto r = run_cli(std::string(sub) + " --synthetic tiny --tensor-parallel-size 3");
    EXPECT_EQ(r.status, 2) << sub << "\n" << r.out;
    EXPECT_NE(r.out.find("--tensor-parallel-size 3: config.json vocab_size = 4096 is not divisible"), std::string::npos)
        << sub << "\n"
        << r.out;
    r = run_cli(std::string(sub) + " --synthetic tiny --tensor-parallel-size 8");
    EXPECT_EQ(r.status, 2) << sub << "\n" << r.out;
    EXPECT_NE(r.out.find("config.json num_attention_heads = 4 is not divisible"), std::string::npos) << sub << "\n"
                                                                                                     << r.out;
  }
  auto r = run_cli("serve --synthetic tiny --port 0 --tensor-parallel-size 3");
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find("vocab_size = 4096 is not divisible"), std::string::npos) << r.out;
  r = run_cli("info --synthetic tiny --tensor-parallel-size 0");
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find("--tensor-parallel-size must be >= 1, got 0"), std::string::npos) << r.out;
}

TEST(CliTensorParallel, MoreRanksThanGpusIsAClearError) {
  // One GPU per rank; checked before the device itself, so a CPU build says the same.
  const int gpus = device::device_count();
  const int ranks = gpus + 1 < 2 ? 2 : gpus + 1;
  for (const char* sub : {"generate --prompt-ids 1 -n 1", "bench --input-lens 8 --batch-sizes 1", "serve --port 0"}) {
    auto r = run_cli(fmt::format("{} --synthetic tiny --device cuda --tensor-parallel-size {}", sub, ranks));
    EXPECT_EQ(r.status, 2) << sub << "\n" << r.out;
    EXPECT_NE(r.out.find(fmt::format("--tensor-parallel-size {}: needs {} GPUs (one per rank), this machine has {}",
                                     ranks, ranks, gpus)),
              std::string::npos)
        << sub << "\n"
        << r.out;
  }
}

TEST(CliTensorParallel, GenerateChecksTheMemoryPlanOfEveryRank) {
  // 2e9 tokens of KV cache fit on no host, with two ranks as with one.
  auto r = run_cli(
      "generate --synthetic tiny --max-model-len 2000000000 --prompt-ids 1,2 -n 1 "
      "--tensor-parallel-size 2");
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find("needs "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("but the host (2 ranks of "), std::string::npos) << r.out;
}

}  // namespace
}  // namespace chimera
