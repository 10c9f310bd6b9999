// The chimera binary end to end: exit statuses (0 / 1 / 2), messages that name the culprit, streaming
// output and --logits-out, on the bundled default model and on broken copies of it.
#include <sys/wait.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "backends/device_api.h"
#include "common/compare.h"
#include "common/run_command.h"
#include "io/npy.h"
#include "io/safetensors.h"

namespace chimera {
namespace {

namespace fs = std::filesystem;

using test::RunOutput;
using test::run_shell;

RunOutput run_cli(const std::string& args) {
  return run_shell(std::string(CHIMERA_CLI_PATH) + " " + args + " 2>&1");
}

std::string default_model() { return test::source_path("models/nemotron-h-tiny"); }

class Cli : public ::testing::Test {
 protected:
  void SetUp() override {
    tmp_ = fs::temp_directory_path() /
           ("chimera_cli_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(tmp_);
    fs::create_directories(tmp_);
  }
  void TearDown() override { fs::remove_all(tmp_); }
  // A copy of the default model to break.
  fs::path copy_model() {
    const fs::path d = tmp_ / "model";
    fs::copy(default_model(), d, fs::copy_options::recursive);
    return d;
  }
  fs::path tmp_;
};

TEST_F(Cli, HelpExitsZeroAndListsFlags) {
  auto r = run_cli("--help");
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("generate"), std::string::npos);
  r = run_cli("generate --help");
  EXPECT_EQ(r.status, 0) << r.out;
  for (const char* flag : {"--prompt-ids", "--temperature", "--top-k", "--top-p", "--seed", "--logits-out",
                           "--device", "--max-tokens"}) {
    EXPECT_NE(r.out.find(flag), std::string::npos) << flag;
  }
  EXPECT_EQ(run_cli("info --help").status, 0);
}

TEST_F(Cli, BadUsageExitsTwo) {
  EXPECT_EQ(run_cli("").status, 2);
  EXPECT_EQ(run_cli("frobnicate").status, 2);
  EXPECT_EQ(run_cli("generate --no-such-flag").status, 2);
  auto r = run_cli("generate -p hi --device tpu");
  EXPECT_EQ(r.status, 2) << r.out;
  r = run_cli("generate -p hi --prompt-ids 1,2");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.out.find("exactly one of --prompt, --prompt-ids and --prompt-file"), std::string::npos) << r.out;
  r = run_cli("generate --prompt-ids 1,x,3");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.out.find("'x' is not a token id"), std::string::npos) << r.out;
  r = run_cli("generate --prompt-ids 1,999999");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.out.find("999999"), std::string::npos) << r.out;
  r = run_cli("generate -p hi --top-p 1.5");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.out.find("--top-p"), std::string::npos) << r.out;
}

// Without CUDA (build or GPU) --device cuda is a clear usage error naming why; with a GPU it generates.
TEST_F(Cli, CudaDeviceWithoutGpuExitsTwoAndSaysWhy) {
  auto r = run_cli("generate -p hi -n 4 --device cuda");
  if (device::cuda_available()) {
    EXPECT_EQ(r.status, 0) << r.out;
  } else {
    EXPECT_EQ(r.status, 2) << r.out;
    EXPECT_NE(r.out.find("--device cuda: " + device::describe_cuda()), std::string::npos) << r.out;
  }
}

TEST_F(Cli, DtypeOtherThanFloat32OnTheCpuIsAUsageError) {
  auto r = run_cli("generate -p hi --dtype bfloat16");
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find("--dtype bfloat16"), std::string::npos) << r.out;
  r = run_cli("generate -p hi -n 2 -q --dtype float32");
  EXPECT_EQ(r.status, 0) << r.out;
}

// The bundled default model generates on the GPU in both dtypes; fp32 greedy output equals the CPU's.
TEST_F(Cli, GeneratesOnCudaFromTheBundledModel) {
  if (!device::cuda_available()) GTEST_SKIP() << device::describe_cuda();
  auto r = run_cli("generate -p \"Hello there\" -n 12 --ignore-eos --device cuda");
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_EQ(r.out.rfind("Hello there", 0), 0u) << r.out;
  EXPECT_NE(r.out.find("generated 12"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("cuda BF16"), std::string::npos) << r.out;
  auto cpu = run_cli("generate -p \"Hello there\" -n 12 --ignore-eos -q");
  auto gpu32 = run_cli("generate -p \"Hello there\" -n 12 --ignore-eos -q --device cuda --dtype float32");
  EXPECT_EQ(gpu32.status, 0) << gpu32.out;
  EXPECT_EQ(gpu32.out, cpu.out);
}

TEST_F(Cli, GeneratesTextFromTheBundledModel) {
  auto r = run_cli("generate -p \"Hello there\" -n 12 --ignore-eos");
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_EQ(r.out.rfind("Hello there", 0), 0u) << r.out;  // the prompt is echoed, then the continuation
  EXPECT_GT(r.out.size(), std::string("Hello there\n").size());
  EXPECT_NE(r.out.find("generated 12"), std::string::npos) << r.out;
  // Greedy is deterministic; seeded sampling is reproducible and differs from greedy.
  auto again = run_cli("generate -p \"Hello there\" -n 12 --ignore-eos -q");
  auto s1 = run_cli("generate -p \"Hello there\" -n 12 --ignore-eos -q --temperature 1 --seed 5");
  auto s2 = run_cli("generate -p \"Hello there\" -n 12 --ignore-eos -q --temperature 1 --seed 5");
  EXPECT_EQ(s1.out, s2.out);
  EXPECT_NE(s1.out, again.out);
}

TEST_F(Cli, LogitsOutHasARowPerPromptPositionAndStep) {
  // Without a tokenizer.json the CLI prints the generated ids, comma-separated.
  const fs::path d = copy_model();
  fs::remove(d / "tokenizer.json");
  const fs::path f = tmp_ / "l.npy";
  auto r = run_cli("generate -m " + d.string() + " --prompt-ids 1,100,200,300,400 -n 6 --ignore-eos -q --logits-out " +
                   f.string());
  ASSERT_EQ(r.status, 0) << r.out;
  const Tensor t = read_npy(f);
  ASSERT_EQ(t.ndim(), 2);
  EXPECT_EQ(t.dim(0), 5 + 6 - 1);
  EXPECT_EQ(t.dim(1), 4096);
  // Printed ids are the argmax of the rows from the last prompt position on.
  std::string printed = r.out.substr(0, r.out.find('\n'));
  int64_t best = 0;
  const float* row = t.f32() + 4 * t.dim(1);
  for (int64_t v = 1; v < t.dim(1); ++v) best = row[v] > row[best] ? v : best;
  EXPECT_EQ(printed.substr(0, printed.find(',')), std::to_string(best)) << r.out;
  EXPECT_EQ(std::count(printed.begin(), printed.end(), ','), 5) << r.out;
  // A text prompt needs the tokenizer: without it the CLI says so and exits 2.
  r = run_cli("generate -m " + d.string() + " -p hello");
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find("no tokenizer.json"), std::string::npos) << r.out;
}

// Deterministic output end to end: the same generate command twice writes byte-identical --logits-out files, greedy
// and seeded sampling, on the CPU and (skipped without a GPU) on CUDA in bf16 and float32 with CUDA graphs.
TEST_F(Cli, GenerateTwiceWritesTheSameLogitBytes) {
  const std::string model = test::source_path("tests/fixtures/models/super_like");
  struct Run {
    const char* device_flags;
    bool gpu;
  };
  for (const Run& run : {Run{"", false}, Run{"--device cuda --dtype bfloat16", true},
                         Run{"--device cuda --dtype float32", true}}) {
    if (run.gpu && !device::cuda_available()) continue;
    for (const char* sampling : {"", "--temperature 0.8 --top-k 20 --seed 7"}) {
      SCOPED_TRACE(std::string(run.device_flags) + " " + sampling);
      std::string bytes[2];
      for (int i = 0; i < 2; ++i) {
        const fs::path f = tmp_ / ("logits" + std::to_string(i) + ".npy");
        const auto r = run_cli("generate -m " + model + " --prompt-ids 3,141,59,26,5 -n 5 --ignore-eos -q " +
                               run.device_flags + " " + sampling + " --logits-out " + f.string());
        ASSERT_EQ(r.status, 0) << r.out;
        std::ifstream in(f, std::ios::binary);
        bytes[i].assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
      }
      ASSERT_FALSE(bytes[0].empty());
      EXPECT_TRUE(bytes[0] == bytes[1]) << "the two --logits-out files differ";
    }
  }
  if (!device::cuda_available()) {
    std::printf("Cli.GenerateTwiceWritesTheSameLogitBytes: CPU checked, CUDA runs left out: %s\n",
                device::describe_cuda().c_str());
  }
}

TEST_F(Cli, DumpActivationsWritesEachLayersInputAndTheExperts) {
  // super_like: Mamba, MoE and attention layers ("MEM*EME"), 16 experts top-3, hidden 64.
  const fs::path model = test::source_path("tests/fixtures/models/super_like");
  const fs::path dir = tmp_ / "dump";
  const std::vector<int32_t> ids = {3, 141, 59, 26};
  const std::string gen = "generate -m " + model.string() + " --prompt-ids 3,141,59,26 -n 4 --ignore-eos -q";
  auto r = run_cli(gen + " --dump-activations " + dir.string());
  ASSERT_EQ(r.status, 0) << r.out;
  const RunOutput plain = run_cli(gen);  // dumping changes nothing that is computed
  ASSERT_EQ(plain.status, 0) << plain.out;
  EXPECT_EQ(r.out, plain.out);
  const std::string pattern = "MEM*EME";
  Tensor before;  // the previous layer's input: each layer adds its mixer's output, so consecutive inputs differ
  for (size_t i = 0; i < pattern.size(); ++i) {
    const Tensor in = read_npy(dir / ("step0_layer" + std::to_string(i) + "_input.npy"));
    ASSERT_EQ(in.shape(), (Shape{4, 64})) << "layer " << i;
    if (before) {
      EXPECT_FALSE(test::bit_equal(in, before)) << "layer " << i << "'s input equals layer " << i - 1 << "'s";
    }
    before = in;
    const fs::path experts = dir / ("step0_layer" + std::to_string(i) + "_experts.npy");
    ASSERT_EQ(fs::exists(experts), pattern[i] == 'E') << experts;
    if (pattern[i] == 'E') {
      const Tensor e = read_npy(experts);
      ASSERT_EQ(e.shape(), (Shape{4, 3}));
      for (int64_t j = 0; j < e.numel(); ++j) EXPECT_TRUE(e.i32()[j] >= 0 && e.i32()[j] < 16) << e.i32()[j];
    }
  }
  // Layer 0's input is the embedding of the prompt ids; only the prefill step is dumped.
  const Tensor in0 = read_npy(dir / "step0_layer0_input.npy");
  const Checkpoint ckpt = Checkpoint::open(model);
  const Tensor emb = ckpt.tensor("model.embeddings.weight");
  for (size_t t = 0; t < ids.size(); ++t) {
    for (int64_t d = 0; d < 64; ++d) {
      const int64_t got = static_cast<int64_t>(t) * 64 + d, want = static_cast<int64_t>(ids[t]) * 64 + d;
      ASSERT_EQ(in0.f32()[got], emb.f32()[want]) << "token " << t << " dim " << d;
    }
  }
  EXPECT_FALSE(fs::exists(dir / "step1_layer0_input.npy"));
  // A directory that cannot be made, or a file in its place, is a usage error naming the flag.
  std::ofstream(tmp_ / "file") << "x";
  for (const auto& [path, why] : {std::pair{tmp_ / "file" / "sub", "cannot be created"},
                                  std::pair{tmp_ / "file", "exists and is not a directory"}}) {
    r = run_cli("generate -m " + model.string() + " --prompt-ids 3,141 -n 1 -q --dump-activations " + path.string());
    EXPECT_EQ(r.status, 2) << r.out;
    EXPECT_NE(r.out.find("--dump-activations"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find(why), std::string::npos) << r.out;
  }
}

TEST_F(Cli, InfoShowsPlanParamsAndMemory) {
  auto r = run_cli("info");
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("MEM*EM-E"), std::string::npos) << r.out;
  for (const char* s : {"mamba", "attention", "mlp", "moe", "total", "bf16", "KV cache"}) {
    EXPECT_NE(r.out.find(s), std::string::npos) << s << "\n" << r.out;
  }
}

TEST_F(Cli, MissingModelDirectoryExitsTwo) {
  auto r = run_cli("generate -m /nonexistent/model -p hi");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.out.find("/nonexistent/model"), std::string::npos) << r.out;
}

TEST_F(Cli, TruncatedCheckpointExitsTwoNamingTheFile) {
  const fs::path d = copy_model();
  fs::resize_file(d / "model.safetensors", fs::file_size(d / "model.safetensors") / 2);
  auto r = run_cli("generate -m " + d.string() + " -p hi");
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find("model.safetensors"), std::string::npos) << r.out;
}

TEST_F(Cli, UnknownLayerCharacterExitsTwoNamingTheField) {
  const fs::path d = copy_model();
  std::ifstream in(d / "config.json");
  std::string cfg((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  in.close();
  const auto at = cfg.find("MEM*EM-E");
  ASSERT_NE(at, std::string::npos);
  cfg.replace(at, 8, "MEM*EMXE");
  std::ofstream(d / "config.json") << cfg;
  auto r = run_cli("info -m " + d.string());
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find("hybrid_override_pattern"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("'X'"), std::string::npos) << r.out;
}

TEST_F(Cli, MalformedTokenizerExitsTwoNamingTheFile) {
  const fs::path d = copy_model();
  std::ofstream(d / "tokenizer.json") << "{\"model\": ";
  auto r = run_cli("generate -m " + d.string() + " -p hi");
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find("tokenizer.json"), std::string::npos) << r.out;
}


// ---- hostile input: the CLI refuses, caps with a notice, or reports lost output ---------------------

// Runs `chimera ARGS` with its stdout sent to `stdout_to` and returns stderr (and the exit status).
RunOutput run_cli_stdout_to(const std::string& args, const std::string& stdout_to) {
  return run_shell(std::string(CHIMERA_CLI_PATH) + " " + args + " 2>&1 >" + stdout_to);
}

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void write_text(const fs::path& p, const std::string& s) { std::ofstream(p, std::ios::binary | std::ios::trunc) << s; }

bool has(const RunOutput& r, const std::string& piece) { return r.out.find(piece) != std::string::npos; }

TEST_F(Cli, FullStdoutExitsNonZeroWithAMessage) {
  if (!fs::exists("/dev/full")) GTEST_SKIP() << "no /dev/full";
  auto r = run_cli_stdout_to("generate -p hi -n 4 -q", "/dev/full");
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_TRUE(has(r, "standard output")) << r.out;
  r = run_cli_stdout_to("info", "/dev/full");
  EXPECT_EQ(r.status, 1) << r.out;
  EXPECT_TRUE(has(r, "standard output") || has(r, "writing output failed")) << r.out;
}

TEST_F(Cli, UnwritableLogitsOutFailsBeforeGenerating) {
  const auto t0 = std::chrono::steady_clock::now();
  auto r = run_cli("generate -p hi -n 100000 --ignore-eos --logits-out " + (tmp_ / "no/such/dir/x.npy").string());
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_TRUE(has(r, "--logits-out")) << r.out;
  EXPECT_FALSE(has(r, "[chimera] prompt")) << "generation ran: " << r.out;
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 30.0);
  r = run_cli("generate -p hi -n 2 --logits-out " + tmp_.string());  // a directory
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_TRUE(has(r, "is a directory")) << r.out;
}

TEST_F(Cli, ThreadsOutOfRangeSaysTheRange) {
  auto r = run_cli("--threads -3 generate -p hi -n 1");
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_TRUE(has(r, "0 (all cores) to 4096")) << r.out;
  EXPECT_FALSE(has(r, "1.79769")) << r.out;
  EXPECT_FALSE(has(r, "e+308")) << r.out;
}

TEST_F(Cli, PromptIdsWithATrailingCommaAreRejected) {
  for (const char* ids : {"1,2,", "1,2, ", ",1", "1,,2"}) {
    auto r = run_cli(std::string("generate -n 1 --prompt-ids '") + ids + "'");
    EXPECT_EQ(r.status, 2) << ids << ": " << r.out;
    EXPECT_TRUE(has(r, "empty entry")) << ids << ": " << r.out;
  }
}

TEST_F(Cli, MaxModelLenBeyondHostMemoryExitsTwo) {
  auto r = run_cli("generate -p hi -n 1 --max-model-len 2000000000");
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_TRUE(has(r, "host")) << r.out;
  EXPECT_TRUE(has(r, "KV")) << r.out;
}

TEST_F(Cli, InfoWithOverflowingLimitsSaysSo) {
  auto r = run_cli("info --max-num-seqs 2147483647 --max-model-len 2147483647");
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_TRUE(has(r, "KV cache overflows")) << r.out;
}

TEST_F(Cli, ModelPathNamingAFileSaysItIsAFile) {
  const std::string cfg = (fs::path(default_model()) / "config.json").string();
  auto r = run_cli("generate -m " + cfg + " -p hi");
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_TRUE(has(r, "is a file")) << r.out;
  EXPECT_FALSE(has(r, "does not exist")) << r.out;
}

TEST_F(Cli, ConfigOrTokenizerThatIsADirectorySaysSo) {
  for (const char* name : {"config.json", "tokenizer.json", "generation_config.json"}) {
    const fs::path d = copy_model();
    fs::remove(d / name);
    fs::create_directories(d / name);
    auto r = run_cli("generate -m " + d.string() + " -p hi -n 1");
    EXPECT_EQ(r.status, 2) << name << ": " << r.out;
    EXPECT_TRUE(has(r, (d / name).string())) << r.out;
    EXPECT_TRUE(has(r, "is a directory")) << name << ": " << r.out;
    fs::remove_all(d);
  }
}

TEST_F(Cli, PromptLongerThanMaxModelLenIsAnError) {
  auto r = run_cli("generate -p 'one two three four five six seven' -n 1 --max-model-len 4");
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_TRUE(has(r, "longer than --max-model-len 4")) << r.out;
  // max_position_embeddings binds when it is the smaller limit.
  const fs::path d = copy_model();
  std::string cfg = read_text(d / "config.json");
  const auto at = cfg.find("\"max_position_embeddings\": 4096");
  ASSERT_NE(at, std::string::npos);
  cfg.replace(at, 31, "\"max_position_embeddings\": 4");
  write_text(d / "config.json", cfg);
  r = run_cli("generate -m " + d.string() + " -p 'one two three four five six seven' -n 1");
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_TRUE(has(r, "max_position_embeddings 4")) << r.out;
}

TEST_F(Cli, MaxTokensBeyondTheCapGetsANotice) {
  auto r = run_cli("generate --prompt-ids 1,2,3 -n 10000000 --ignore-eos --max-model-len 8");
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_TRUE(has(r, "-n 10000000 capped to 5")) << r.out;
  EXPECT_TRUE(has(r, "generated 5")) << r.out;
}

TEST_F(Cli, PromptFileAndStandardInput) {
  const auto ref = run_cli("generate -p 'The quick brown fox' -n 4 -q");
  ASSERT_EQ(ref.status, 0) << ref.out;
  write_text(tmp_ / "prompt.txt", "The quick brown fox");
  auto r = run_cli("generate --prompt-file " + (tmp_ / "prompt.txt").string() + " -n 4 -q");
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_EQ(r.out, ref.out);
  r = run_cli("generate --prompt-file - -n 4 -q < " + (tmp_ / "prompt.txt").string());
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_EQ(r.out, ref.out);
  r = run_cli("generate --prompt-file " + (tmp_ / "absent.txt").string() + " -n 1");
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_TRUE(has(r, "absent.txt")) << r.out;
  r = run_cli("generate --prompt-file " + (tmp_ / "prompt.txt").string() + " -p hi -n 1");
  EXPECT_EQ(r.status, 2) << r.out;
}

TEST_F(Cli, TokenizerSmallerThanTheModelVocabularyFailsAtLoad) {
  const fs::path d = copy_model();
  std::string cfg = read_text(d / "config.json");
  const auto at = cfg.find("\"vocab_size\": 4096");
  ASSERT_NE(at, std::string::npos);
  cfg.replace(at, 18, "\"vocab_size\": 8192");
  write_text(d / "config.json", cfg);
  auto r = run_cli("generate -m " + d.string() + " -p hi -n 4");
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_TRUE(has(r, "tokenizer.json has 4096 token ids")) << r.out;
  EXPECT_TRUE(has(r, "config.json says vocab_size 8192")) << r.out;
  EXPECT_FALSE(has(r, "[chimera] prompt")) << r.out;
}

TEST_F(Cli, EosOutsideTheVocabularyFailsAtLoad) {
  const fs::path d = copy_model();
  write_text(d / "generation_config.json", R"({"bos_token_id": 1, "eos_token_id": [2, 99999]})");
  auto r = run_cli("generate -m " + d.string() + " -p hi -n 4");
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_TRUE(has(r, "generation_config.json")) << r.out;
  EXPECT_TRUE(has(r, "eos_token_id 99999")) << r.out;
}

TEST_F(Cli, DuplicatedConfigKeyAndHugeNumbersExitTwoNamingTheFile) {
  const fs::path d = copy_model();
  const std::string cfg = read_text(d / "config.json");
  write_text(d / "config.json", "{\"hidden_size\": 64, " + cfg.substr(cfg.find('{') + 1));
  auto r = run_cli("info -m " + d.string());
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_TRUE(has(r, "config.json")) << r.out;
  EXPECT_TRUE(has(r, "'hidden_size' appears twice")) << r.out;
  write_text(d / "config.json", "{\"rms_norm_eps\": 1e400, " + cfg.substr(cfg.find('{') + 1));
  r = run_cli("info -m " + d.string());
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_TRUE(has(r, "config.json")) << r.out;
  EXPECT_TRUE(has(r, "outside the range of a double")) << r.out;
  EXPECT_FALSE(has(r, "internal error")) << r.out;
}

TEST_F(Cli, IndexShardOutsideTheModelDirectoryIsRefused) {
  const fs::path d = copy_model();
  fs::rename(d / "model.safetensors", d / "model-00001-of-00001.safetensors");
  for (const std::string& shard : {std::string("../../../../etc/passwd"), std::string("/etc/passwd"),
                                   (fs::path(default_model()) / "model.safetensors").string()}) {
    nlohmann::json idx = {{"weight_map", {{"backbone.embeddings.weight", shard}}}};
    write_text(d / "model.safetensors.index.json", idx.dump());
    auto r = run_cli("info -m " + d.string());
    EXPECT_EQ(r.status, 2) << shard << ": " << r.out;
    EXPECT_TRUE(has(r, "backbone.embeddings.weight")) << r.out;
    EXPECT_TRUE(has(r, shard)) << r.out;
    EXPECT_FALSE(has(r, "header length")) << "read the file: " << r.out;
  }
}

// ---- synthetic models ------------------------------------------------------------------------------

TEST(CliSynthetic, TinyGeneratesTextOnTheCpu) {
  // tiny borrows the bundled model's tokenizer (same vocabulary), so a text prompt works.
  auto r = run_cli("generate --synthetic tiny -p 'Hello world' -n 6 --ignore-eos");
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("Hello world"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("generated 6"), std::string::npos) << r.out;
  // Deterministic: the same command twice gives the same text.
  auto again = run_cli("generate --synthetic tiny -p 'Hello world' -n 6 --ignore-eos -q");
  auto once = run_cli("generate --synthetic tiny -p 'Hello world' -n 6 --ignore-eos -q");
  EXPECT_EQ(again.out, once.out);
  // Another weight seed, other text.
  auto other = run_cli("generate --synthetic tiny --synthetic-seed 5 -p 'Hello world' -n 6 --ignore-eos -q");
  EXPECT_EQ(other.status, 0) << other.out;
  EXPECT_NE(other.out, once.out);
}

TEST(CliSynthetic, TensorParallelGeneratesTheSameTokens) {
  // --tensor-parallel-size 2 and 4: the tiny preset sharded over ranks that are threads; greedy, so the same text.
  const std::string cmd = "generate --synthetic tiny --prompt-ids 1,17,300,42 -n 8 --ignore-eos --temperature 0 -q";
  auto one = run_cli(cmd);
  ASSERT_EQ(one.status, 0) << one.out;
  for (const char* n : {"2", "4"}) {
    auto r = run_cli(cmd + " --tensor-parallel-size " + n);
    EXPECT_EQ(r.status, 0) << r.out;
    EXPECT_EQ(r.out, one.out) << "--tensor-parallel-size " << n;
  }
  auto bad = run_cli("generate --synthetic tiny --prompt-ids 1 -n 1 --tensor-parallel-size 3");
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.out.find("vocab_size = 4096 is not divisible"), std::string::npos) << bad.out;
}

TEST(CliSynthetic, OtherVocabSizesGetASyntheticByteLevelTokenizer) {
  // Nano's 131072 ids fit no bundled tokenizer: a byte-level one of that size encodes the text prompt (one id per
  // byte) and decodes whatever the random weights pick. One layer keeps it to the embedding and the LM head.
  auto r = run_cli("generate --synthetic nemotron-3-nano-30b-a3b --num-layers 1 -p 'Hello' -n 4 --ignore-eos");
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_EQ(r.out.rfind("Hello", 0), 0u) << r.out;
  EXPECT_NE(r.out.find("prompt 5 tokens, generated 4"), std::string::npos) << r.out;
  const std::string text = r.out.substr(5, r.out.find('\n') - 5);
  EXPECT_FALSE(text.empty()) << r.out;
}

TEST(CliSynthetic, NumLayersTruncates) {
  auto r = run_cli("info --synthetic nemotron-3-super-120b-a12b --num-layers 9");
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("pattern    MEMEMEM*E\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("9 layers"), std::string::npos) << r.out;
  r = run_cli("generate --synthetic tiny --num-layers 2 --prompt-ids 1,2,3 -n 2 --ignore-eos");
  EXPECT_EQ(r.status, 0) << r.out;
  r = run_cli("generate --synthetic tiny --num-layers 9 --prompt-ids 1,2,3 -n 2");
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find("--num-layers: 9 is out of range, the model has 8 layers"), std::string::npos) << r.out;
  r = run_cli("generate --num-layers 2 --prompt-ids 1,2,3 -n 2");
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find("--num-layers needs --synthetic"), std::string::npos) << r.out;
}

TEST(CliSynthetic, UnknownPresetIsABadInput) {
  auto r = run_cli("generate --synthetic gpt-5 --prompt-ids 1");
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find("unknown preset 'gpt-5'"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("nemotron-3-nano-30b-a3b"), std::string::npos) << r.out;
}

TEST(CliSynthetic, InfoPrintsThePublishedShapesAndTheMemoryPlan) {
  auto r = run_cli("info --synthetic nemotron-3-nano-30b-a3b --max-num-seqs 8 --max-model-len 4096");
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("pattern    MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(" 31577940288\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("memory plan (BF16, 8 sequences x 4096 tokens"), std::string::npos) << r.out;
  const size_t kv = r.out.find("  KV cache  ");  // 6 KiB/token x 8 x 4096 = 0.1875 GiB
  ASSERT_NE(kv, std::string::npos) << r.out;
  EXPECT_EQ(r.out.substr(kv, r.out.find('\n', kv) - kv).find("0.19 GiB") != std::string::npos, true) << r.out;
}

TEST(CliSynthetic, TooLargeForTheDeviceFailsBeforeAllocating) {
  // On the CPU a synthetic model is checked against the host's available memory; 2e9 tokens of KV cache
  // (6 KiB each for Nano) fit on no machine.
  auto r = run_cli("generate --synthetic nemotron-3-nano-30b-a3b --max-model-len 2000000000 --prompt-ids 1,2 -n 1");
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find("needs "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("(weights "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(", KV "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(", Mamba state "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(", workspace "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("free"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace chimera

namespace chimera {
namespace {

// chimera bench on a synthetic tiny model on the CPU: the table, the JSON and its fields, positive rates.
TEST(CliBench, TinyOnTheCpuPrintsTheTableAndWritesJson) {
  const fs::path json = fs::temp_directory_path() / "chimera_cli_bench.json";
  fs::remove(json);
  auto r = run_cli("bench --synthetic tiny --device cpu --input-lens 16,40 --batch-sizes 1,2 --decode-context 8 "
                   "--decode-steps 4 --no-pdl --json-out " + json.string());
  ASSERT_EQ(r.status, 0) << r.out;
  for (const char* s : {"chimera bench | synthetic tiny (8 layers)", "| PDL off |", "roofline   batch-1 decode",
                        "prefill (1 sequence", "TTFT ms", "decode (8-token prefill", "TPOT ms", "vs roofline"}) {
    EXPECT_NE(r.out.find(s), std::string::npos) << s << "\n" << r.out;
  }
  std::ifstream f(json);
  ASSERT_TRUE(f.good()) << json;
  const nlohmann::json j = nlohmann::json::parse(f);  // throws on invalid JSON
  for (const char* k : {"date", "commit", "device", "model", "dtype", "weight_dtype", "settings", "roofline", "prefill",
                        "decode"}) {
    EXPECT_TRUE(j.contains(k)) << k;
  }
  EXPECT_EQ(j["model"]["name"], "tiny");
  EXPECT_EQ(j["dtype"], "F32");
  EXPECT_EQ(j["settings"]["pdl"], false);  // the CPU never launches kernels; --no-pdl is accepted anyway
  EXPECT_GT(j["roofline"]["batch1_tokens_per_s"].get<double>(), 0);
  EXPECT_GT(j["roofline"]["active_params"].get<int64_t>(), 0);
  ASSERT_EQ(j["prefill"].size(), 2u);
  EXPECT_EQ(j["prefill"][0]["input_len"], 16);
  EXPECT_EQ(j["prefill"][1]["input_len"], 40);
  for (const auto& p : j["prefill"]) {
    EXPECT_EQ(p["status"], "ok") << p.dump();
    EXPECT_GT(p["tokens_per_s"].get<double>(), 0);
    EXPECT_GT(p["ttft_ms"].get<double>(), 0);
  }
  ASSERT_EQ(j["decode"].size(), 2u);
  EXPECT_EQ(j["decode"][0]["batch_size"], 1);
  EXPECT_EQ(j["decode"][1]["batch_size"], 2);
  for (const auto& d : j["decode"]) {
    EXPECT_EQ(d["status"], "ok") << d.dump();
    EXPECT_GT(d["tokens_per_s"].get<double>(), 0);
    EXPECT_GT(d["tpot_ms"].get<double>(), 0);
    EXPECT_EQ(d["partial_steps"], 0) << d.dump();  // every timed step decoded the whole batch
    EXPECT_GE(d["mean_context_at_start"].get<double>(), 8.0);
  }
  EXPECT_GT(j["decode"][0]["roofline_ratio"].get<double>(), 0);
  EXPECT_FALSE(j["decode"][1].contains("roofline_ratio"));
  fs::remove(json);
}

// With speculation the JSON splits each timed step into the backbone's verify part and the head's drafts, both
// inside the step; the table line says so too. The bundled trained model has an MTP head.
TEST(CliBench, SpeculationSplitsTheStepIntoVerifyAndDrafts) {
  const fs::path json = fs::temp_directory_path() / "chimera_cli_bench_spec.json";
  fs::remove(json);
  auto r = run_cli("bench -m " + test::source_path("models/nemotron-h-kjv") +
                   " --device cpu "
                   "--input-lens 16 --batch-sizes 1,2 --decode-context 8 --decode-steps 4 --speculative-config "
                   "'{\"method\": \"mtp\", \"num_speculative_tokens\": 2}' --json-out " +
                   json.string());
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("speculative K = 2: step "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(" ms (verify "), std::string::npos) << r.out;
  std::ifstream f(json);
  ASSERT_TRUE(f.good()) << json;
  const nlohmann::json j = nlohmann::json::parse(f);
  ASSERT_EQ(j["decode"].size(), 2u);
  for (const auto& d : j["decode"]) {
    ASSERT_EQ(d["status"], "ok") << d.dump();
    const nlohmann::json& sp = d["speculative"];
    const double verify = sp["verify_ms"].get<double>(), drafts = sp["draft_ms"].get<double>();
    EXPECT_GT(verify, 0) << d.dump();
    EXPECT_GT(drafts, 0) << d.dump();
    EXPECT_LE(verify + drafts, d["step_ms"].get<double>()) << d.dump();
  }
  fs::remove(json);
}

TEST(CliBench, SizesThatDoNotFitAreSkippedNotFailed) {
  // 2e9 tokens of KV cache fit on no host: reported as skipped, the run still succeeds.
  auto r = run_cli("bench --synthetic tiny --input-lens 2000000000,8 --batch-sizes 1 --decode-context 4 "
                   "--decode-steps 1 --warmup 0");
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("skipped (needs "), std::string::npos) << r.out;
}

TEST(CliBench, BadFlagsExitTwoNamingTheFlag) {
  for (const char* args : {"bench --synthetic tiny --input-lens 16,abc", "bench --synthetic tiny --batch-sizes 0",
                           "bench --synthetic tiny --decode-steps 0", "bench --synthetic tiny --warmup x",
                           "bench --synthetic tiny --bandwidth-gbs 0", "bench --synthetic tiny --device tpu",
                           "bench --synthetic tiny --decode-context 0"}) {
    auto r = run_cli(args);
    EXPECT_EQ(r.status, 2) << args << "\n" << r.out;
    const std::string a(args);
    const std::string flag = a.substr(a.rfind("--"), a.find(' ', a.rfind("--")) - a.rfind("--"));
    EXPECT_NE(r.out.find(flag), std::string::npos) << flag << "\n" << r.out;
  }
  auto r = run_cli("bench --synthetic tiny --dtype bfloat16");
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find("--dtype bfloat16"), std::string::npos) << r.out;
  r = run_cli("bench --synthetic tiny --no-such-flag");
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find("--no-such-flag"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace chimera
