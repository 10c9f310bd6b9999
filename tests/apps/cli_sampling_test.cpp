// `chimera generate` and the sampling parameters end to end: the new flags, their validation (exit 2 naming the
// field), stop token ids, and non-finite logits from a poisoned copy of the bundled model (exit 1, the message on
// stderr, nothing but the prompt on stdout).
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "backends/device_api.h"
#include "common/compare.h"
#include "io/safetensors.h"

namespace chimera {
namespace {

namespace fs = std::filesystem;

struct Output {
  int status = -1;
  std::string text;
};

// Runs the CLI with `args`; `streams` picks what is captured: "2>&1" both, "2>/dev/null" stdout, "2>&1 >/dev/null"
// stderr.
Output run(const std::string& args, const std::string& streams) {
  const std::string cmd = std::string(CHIMERA_CLI_PATH) + " " + args + " " + streams;
  FILE* pipe = popen(cmd.c_str(), "r");
  Output r;
  if (!pipe) {
    ADD_FAILURE() << "popen failed";
    return r;
  }
  std::array<char, 4096> buf{};
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), pipe)) > 0) r.text.append(buf.data(), n);
  const int st = pclose(pipe);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

std::vector<int32_t> parse_ids(const std::string& line) {
  std::vector<int32_t> ids;
  std::stringstream ss(line);
  std::string item;
  while (std::getline(ss, item, ',')) ids.push_back(std::stoi(item));
  return ids;
}

class CliSampling : public ::testing::Test {
 protected:
  void SetUp() override {
    tmp_ = fs::temp_directory_path() /
           ("chimera_cli_sampling_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(tmp_);
    fs::create_directories(tmp_);
  }
  void TearDown() override { fs::remove_all(tmp_); }
  // A copy of the bundled model; without its tokenizer the CLI prints token ids.
  fs::path copy_model(bool with_tokenizer) {
    const fs::path d = tmp_ / "model";
    fs::copy(test::source_path("models/nemotron-h-tiny"), d, fs::copy_options::recursive);
    if (!with_tokenizer) fs::remove(d / "tokenizer.json");
    return d;
  }
  fs::path tmp_;
};

TEST_F(CliSampling, NewFlagsAreListedAndValidated) {
  const Output help = run("generate --help", "2>&1");
  for (const char* flag : {"--min-p", "--presence-penalty", "--frequency-penalty", "--repetition-penalty",
                           "--stop-token-ids"}) {
    EXPECT_NE(help.text.find(flag), std::string::npos) << flag;
  }
  const std::string model = "-m " + test::source_path("models/nemotron-h-tiny");
  struct Bad {
    const char* args;
    const char* field;
  };
  for (const Bad b : {Bad{"--min-p 2", "min_p"}, Bad{"--presence-penalty 3", "presence_penalty"},
                      Bad{"--frequency-penalty -2.5", "frequency_penalty"},
                      Bad{"--repetition-penalty 0", "repetition_penalty"},
                      Bad{"--stop-token-ids 5,-1", "stop_token_ids"}, Bad{"--stop-token-ids 4096", "stop_token_ids"}}) {
    const Output r = run("generate " + model + " -p hi -n 2 " + b.args, "2>&1");
    EXPECT_EQ(r.status, 2) << b.args << ": " << r.text;
    EXPECT_NE(r.text.find(b.field), std::string::npos) << b.args << ": " << r.text;
  }
  const Output ok = run("generate " + model +
                            " -p hi -n 4 -q --temperature 0.8 --min-p 0.1 --presence-penalty 0.5 "
                            "--frequency-penalty 0.5 --repetition-penalty 1.2 --seed 3",
                        "2>&1");
  EXPECT_EQ(ok.status, 0) << ok.text;
}

TEST_F(CliSampling, StopTokenIdsEndTheOutputAfterTheStopToken) {
  const fs::path d = copy_model(false);
  const std::string base = "generate -m " + d.string() + " --prompt-ids 1,20,30,40 -n 10 --ignore-eos -q";
  const Output free = run(base, "2>/dev/null");
  ASSERT_EQ(free.status, 0) << free.text;
  const std::vector<int32_t> ids = parse_ids(free.text);
  ASSERT_EQ(ids.size(), 10u) << free.text;
  const int32_t stop = ids[4];
  size_t first = 0;
  while (ids[first] != stop) ++first;
  const Output stopped = run(base + " --stop-token-ids " + std::to_string(stop), "2>/dev/null");
  ASSERT_EQ(stopped.status, 0) << stopped.text;
  EXPECT_EQ(parse_ids(stopped.text), std::vector<int32_t>(ids.begin(), ids.begin() + first + 1)) << stopped.text;
}

// The final norm's weight all NaN: every logit is NaN from the first step. The command fails with exit 1 and the
// message, after printing the prompt and no generated text.
TEST_F(CliSampling, NonFiniteLogitsExitOneWithTheMessage) {
  const fs::path d = copy_model(true);
  {
    const auto file = SafetensorsFile::open(d / "model.safetensors");
    std::vector<std::pair<std::string, Tensor>> tensors;
    for (const std::string& n : file->names()) {
      Tensor t = file->tensor(n).clone();
      if (n == "backbone.norm_f.weight") {
        ASSERT_EQ(t.dtype(), DType::kBF16);
        for (int64_t i = 0; i < t.numel(); ++i) t.data_as<uint16_t>()[i] = 0x7fc0;  // bf16 NaN
      }
      tensors.emplace_back(n, std::move(t));
    }
    const std::map<std::string, std::string> meta = file->metadata();
    fs::remove(d / "model.safetensors");  // the mapping stays valid until `file` goes
    write_safetensors(d / "model.safetensors", tensors, meta);
  }
  std::vector<std::string> devices{"cpu"};
  if (device::cuda_available()) devices.push_back("cuda");
  for (const std::string& dev : devices) {
    SCOPED_TRACE(dev);
    const std::string args = "generate -m " + d.string() + " -p \"Hello there\" -n 8 --device " + dev;
    const Output err = run(args, "2>&1 >/dev/null");
    EXPECT_EQ(err.status, 1) << err.text;
    EXPECT_NE(err.text.find("non-finite logits at step 0 of sequence 0"), std::string::npos) << err.text;
    const Output out = run(args, "2>/dev/null");
    EXPECT_EQ(out.status, 1);
    EXPECT_EQ(out.text, "Hello there\n");
  }
}

}  // namespace
}  // namespace chimera
