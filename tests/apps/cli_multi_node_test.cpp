// `chimera generate | bench --nnodes N --node-rank R --master-addr A --master-port P` through the real binary: the
// tensor-parallel ranks spread over processes on 127.0.0.1 (dist::HostGroup, models/remote_ranks.h) print what one
// process prints, on the CPU and on CUDA, and a node that never starts ends node 0 with an error naming it (serve's
// is tests/server/test_tensor_parallel.py).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "backends/device_api.h"
#include "common/free_port.h"
#include "common/run_command.h"
#include "io/npy.h"

namespace chimera {
namespace {

namespace fs = std::filesystem;

const std::string kCli = CHIMERA_CLI_PATH;

test::RunOutput run_cli(const std::string& args) {
  return test::run_shell("timeout 120 " + kCli + " " + args);
}

// Nodes 1..nnodes-1 in the background, node 0 in the foreground: the result has node 0's stdout and exit status.
test::RunOutput run_nodes(const std::string& args, int nnodes) {
  const std::string common = "timeout 120 " + kCli + " " + args + " --nnodes " + std::to_string(nnodes) +
                             " --master-addr 127.0.0.1" + " --master-port " + std::to_string(test::free_port()) +
                             " --dist-timeout 20";
  std::string script = "pids=''; ";
  for (int k = 1; k < nnodes; ++k) {
    script += common + " --node-rank " + std::to_string(k) + " > /tmp/chimera_node_$$_" + std::to_string(k) +
              " 2>&1 & pids=\"$pids $!\"; ";
  }
  // A worker that fails makes the status 99 (its output then goes to stderr, into the test's log).
  script += common + " --node-rank 0; rc=$?; for p in $pids; do wait $p || rc=99; done; " +
            "[ $rc = 99 ] && cat /tmp/chimera_node_$$_* >&2; rm -f /tmp/chimera_node_$$_*; exit $rc";
  return test::run_shell("bash -c '" + script + "'");
}

TEST(CliMultiNode, TwoNodesPrintTheTokensOfOneProcess) {
  // The bundled KJV model has every layer kind (Mamba-2, attention, MLP, MoE) and an MTP head; greedy.
  const std::string cmd = "generate -m " + std::string(CHIMERA_SOURCE_DIR) +
                          "/models/nemotron-h-kjv -p \"In the beginning\" -n 16 --ignore-eos --temperature 0 -q";
  const auto one = run_cli(cmd);
  ASSERT_EQ(one.status, 0) << one.out;
  ASSERT_EQ(one.out.rfind("In the beginning", 0), 0u) << one.out;
  const auto threads = run_cli(cmd + " --tensor-parallel-size 2");
  EXPECT_EQ(threads.out, one.out);
  for (int tp : {2, 4}) {
    const auto nodes = run_nodes(cmd + " --tensor-parallel-size " + std::to_string(tp), 2);
    EXPECT_EQ(nodes.status, 0) << nodes.out;
    EXPECT_EQ(nodes.out, one.out) << "--tensor-parallel-size " << tp << " --nnodes 2";
  }
  // Speculative decoding runs the MTP head's steps on every node too.
  const std::string spec = cmd + " --speculative-config '\\''{\"method\": \"mtp\", \"num_speculative_tokens\": 2}'\\''";
  const auto spec_nodes = run_nodes(spec + " --tensor-parallel-size 2", 2);
  EXPECT_EQ(spec_nodes.status, 0) << spec_nodes.out;
  EXPECT_EQ(spec_nodes.out, one.out) << "speculative, --nnodes 2";
}

TEST(CliMultiNode, BenchOverTwoNodesGivesTheTokensOfOneProcess) {
  // bench makes one engine (and caches) per case: node 0 sends the other node each new caches' layout.
  const fs::path json = fs::temp_directory_path() / ("chimera_bench_nodes_" + std::to_string(::getpid()) + ".json");
  const std::string cmd =
      "bench --synthetic tiny --input-lens 16,40 --batch-sizes 1,3 --decode-context 8 --decode-steps 4 --warmup 1 "
      "--tensor-parallel-size 2 --json-out " +
      json.string();
  const auto read = [&] {
    std::ifstream f(json);
    return f.good() ? nlohmann::json::parse(f) : nlohmann::json::object();
  };
  fs::remove(json);
  const auto threads = run_cli(cmd);
  ASSERT_EQ(threads.status, 0) << threads.out;
  const nlohmann::json want = read();
  fs::remove(json);
  const auto nodes = run_nodes(cmd, 2);
  ASSERT_EQ(nodes.status, 0) << nodes.out;
  const nlohmann::json got = read();
  fs::remove(json);
  ASSERT_EQ(got["decode"].size(), want["decode"].size()) << got.dump();
  ASSERT_GE(want["decode"].size(), 2u) << want.dump();
  for (size_t i = 0; i < want["decode"].size(); ++i) {
    EXPECT_EQ(got["decode"][i]["tokens_of_sequence_0"], want["decode"][i]["tokens_of_sequence_0"]) << i;
  }
}

// CUDA ranks in two processes, one rank each on GPU 0 (the machine may have one GPU): their collectives go through
// host memory over the HostGroup. fp32: the tokens of one rank, the logits within fp32 summation-order noise.
TEST(CliMultiNode, CudaRanksInTwoProcessesGiveTheTokensOfOneRank) {
  if (!device::cuda_available()) GTEST_SKIP() << "no CUDA device";
  const fs::path dir = fs::temp_directory_path() / ("chimera_cuda_nodes_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string cmd = "generate -m " + std::string(CHIMERA_SOURCE_DIR) +
                          "/models/nemotron-h-kjv -p \"In the beginning\" -n 12 --ignore-eos --temperature 0 -q "
                          "--device cuda --dtype float32 --logits-out ";
  const auto one = run_cli(cmd + (dir / "one.npy").string());
  ASSERT_EQ(one.status, 0) << one.out;
  const auto nodes = run_nodes(cmd + (dir / "nodes.npy").string() + " --tensor-parallel-size 2", 2);
  ASSERT_EQ(nodes.status, 0) << nodes.out;
  EXPECT_EQ(nodes.out, one.out);
  const Tensor a = read_npy(dir / "one.npy"), b = read_npy(dir / "nodes.npy");
  ASSERT_EQ(a.shape(), b.shape());
  float max_diff = 0, max_abs = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    max_diff = std::max(max_diff, std::fabs(a.f32()[i] - b.f32()[i]));
    max_abs = std::max(max_abs, std::fabs(a.f32()[i]));
  }
  EXPECT_LE(max_diff, 1e-3f * std::max(1.0f, max_abs)) << "max |logit| " << max_abs;
  fs::remove_all(dir);
}

// Two processes with a GPU each (CUDA_VISIBLE_DEVICES): the ranks find their GPUs distinct and form one NCCL clique
// from rank 0's unique id sent over TCP. fp32: the tokens of one rank.
TEST(CliMultiNode, CudaRanksOnTwoGpusInTwoProcessesUseNccl) {
  if (device::device_count() < 2) GTEST_SKIP() << "needs 2 GPUs";
  const std::string cmd = "generate -m " + std::string(CHIMERA_SOURCE_DIR) +
                          "/models/nemotron-h-kjv -p \"In the beginning\" -n 8 --ignore-eos --temperature 0 -q "
                          "--device cuda --dtype float32";
  const auto one = run_cli(cmd);
  ASSERT_EQ(one.status, 0) << one.out;
  const std::string common = "timeout 120 " + kCli + " " + cmd + " --tensor-parallel-size 2 --nnodes 2 --master-port " +
                             std::to_string(test::free_port()) + " --dist-timeout 30";
  const auto r = test::run_shell("bash -c 'CUDA_VISIBLE_DEVICES=1 " + common +
                                 " --node-rank 1 >/dev/null 2>&1 & CUDA_VISIBLE_DEVICES=0 " + common +
                                 " --node-rank 0; rc=$?; wait $! || rc=99; exit $rc'");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_EQ(r.out, one.out);
}

// Every node must run its ranks on the same device kind: node 0 on CUDA, node 1 on the CPU is a clear error on both.
TEST(CliMultiNode, NodesOnDifferentDevicesAreAnError) {
  if (!device::cuda_available()) GTEST_SKIP() << "no CUDA device";
  const std::string port = std::to_string(test::free_port());
  const std::string common = "timeout 60 " + kCli +
                             " generate --synthetic tiny --prompt-ids 1,2 -n 2 --tensor-parallel-size 2 --nnodes 2 "
                             "--master-port " +
                             port + " --dist-timeout 20";
  const auto r = test::run_shell("bash -c '" + common + " --node-rank 1 --device cpu > /tmp/chimera_mixed_$$ 2>&1 & " +
                                 common + " --node-rank 0 --device cuda 2>&1; rc=$?; wait; cat /tmp/chimera_mixed_$$; " +
                                 "rm -f /tmp/chimera_mixed_$$; exit $rc'");
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find("every node needs the same --device"), std::string::npos) << r.out;
}

TEST(CliMultiNode, ANodeThatNeverStartsEndsNodeZeroNamingIt) {
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = run_cli(
      "generate --synthetic tiny --prompt-ids 1,2 -n 2 --tensor-parallel-size 2 --nnodes 2 "
      "--node-rank 0 --master-port " +
      std::to_string(test::free_port()) + " --dist-timeout 0.5 2>&1");
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_NE(r.out.find("node 1 (rank 1) did not join within 500 ms"), std::string::npos) << r.out;
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 20.0);
}

TEST(CliMultiNode, BadNodeFlagsAreInvalidInput) {
  auto r = run_cli("generate --synthetic tiny --prompt-ids 1 -n 1 --tensor-parallel-size 3 --nnodes 2 2>&1");
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find("--nnodes 2: --tensor-parallel-size 3"), std::string::npos) << r.out;
  r = run_cli("generate --synthetic tiny --prompt-ids 1 -n 1 --tensor-parallel-size 2 --nnodes 2 --node-rank 2 2>&1");
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find("--node-rank 2"), std::string::npos) << r.out;
  r = run_cli("generate --synthetic tiny --prompt-ids 1 -n 1 --tensor-parallel-size 2 --nnodes 2 --master-port 0 2>&1");
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find("--master-port 0"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace chimera
