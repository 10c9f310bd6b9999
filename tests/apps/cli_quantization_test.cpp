// chimera --quantization and chimera info on quantized models, through the real binary.
#include <string>

#include <gtest/gtest.h>

#include "common/compare.h"
#include "common/run_command.h"

namespace chimera {
namespace {

test::RunOutput run_cli(const std::string& args) {
  return test::run_shell(std::string(CHIMERA_CLI_PATH) + " " + args + " 2>&1");
}

TEST(CliQuantization, GenerateQuantizesTheBundledModelAtLoad) {
  for (const char* q : {"fp8", "nvfp4"}) {
    auto r = run_cli(std::string("generate --quantization ") + q + " -p 'Hello world' -n 4 --ignore-eos");
    EXPECT_EQ(r.status, 0) << r.out;
    EXPECT_NE(r.out.find("generated 4"), std::string::npos) << r.out;
  }
}

TEST(CliQuantization, UnknownFormatAndAQuantizedCheckpointAreBadInput) {
  auto r = run_cli("generate --quantization int4 -p hi -n 1");
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find("--quantization"), std::string::npos) << r.out;
  const std::string fp8 = test::source_path("tests/fixtures/quant/models/all_kinds-fp8");
  r = run_cli("generate -m " + fp8 + " --quantization nvfp4 --prompt-ids 1,2 -n 1");
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.out.find("already quantized"), std::string::npos) << r.out;
}

TEST(CliQuantization, InfoShowsEachKindsFormatAndBytes) {
  const std::string mixed = test::source_path("tests/fixtures/quant/models/all_kinds-mixed");
  auto r = run_cli("info -m " + mixed);
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("weights by kind"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("fp8+nvfp4"), std::string::npos) << r.out;  // the MoE layers
  r = run_cli("info --synthetic nemotron-3-nano-30b-a3b --quantization fp8");
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("linear layers fp8"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("moe         fp8"), std::string::npos) << r.out;
}

TEST(CliQuantization, GenerateRunsAModelOptCheckpoint) {
  const std::string nvfp4 = test::source_path("tests/fixtures/quant/models/super_like-nvfp4");
  auto r = run_cli("generate -m " + nvfp4 + " --prompt-ids 5,6,7 -n 3 --ignore-eos");
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("generated 3"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace chimera
