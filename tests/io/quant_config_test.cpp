// ModelOpt quantization metadata (io/quant_config.h): the fixtures of tests/fixtures/quant/configs (modelled on
// NVIDIA's Nemotron 3 Nano FP8 and Super NVFP4 checkpoints), pattern rules, the NUL-suffixed names of ModelOpt 0.47,
// and clear errors.
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/compare.h"
#include "io/io_test_util.h"
#include "io/quant_config.h"

namespace chimera {
namespace {

using test::TempDir;
using test::write_file;
using json = nlohmann::json;

std::string fixture_dir(const std::string& name) { return test::source_path("tests/fixtures/quant/configs/" + name); }

constexpr ModuleQuant kBf16{WeightFormat::kUnquantized, 0};
constexpr ModuleQuant kFp8{WeightFormat::kFp8, 0};
constexpr ModuleQuant kNvfp4{WeightFormat::kNvfp4, 16};

TEST(QuantConfig, NanoFp8BothFiles) {
  const auto c = load_quant_config(fixture_dir("nano-fp8"));
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->algo, QuantAlgo::kFp8);
  EXPECT_EQ(c->kv_cache, KvCacheQuant::kFp8);
  EXPECT_EQ(c->group_size, 0);
  EXPECT_EQ(c->producer_version, "0.39.0");
  EXPECT_NE(c->source.find("hf_quant_config.json"), std::string::npos);
  EXPECT_NE(c->source.find("config.json"), std::string::npos);
  // Mamba layer 0 and MoE layer 1: quantized
  EXPECT_EQ(c->module_quant("backbone.layers.0.mixer.in_proj"), kFp8);
  EXPECT_EQ(c->module_quant("backbone.layers.0.mixer.out_proj"), kFp8);
  EXPECT_EQ(c->module_quant("backbone.layers.1.mixer.experts.7.up_proj"), kFp8);
  EXPECT_EQ(c->module_quant("backbone.layers.1.mixer.shared_experts.down_proj"), kFp8);
  // the router, every conv1d, lm_head: bf16
  EXPECT_EQ(c->module_quant("backbone.layers.1.mixer.gate"), kBf16);
  EXPECT_EQ(c->module_quant("backbone.layers.0.mixer.conv1d"), kBf16);
  EXPECT_EQ(c->module_quant("lm_head"), kBf16);
  // attention layer 5 and the Mamba layer 4 before it (pattern "backbone.layers.5.mixer*"): bf16; layer 50 is not 5
  EXPECT_EQ(c->module_quant("backbone.layers.5.mixer.q_proj"), kBf16);
  EXPECT_EQ(c->module_quant("backbone.layers.4.mixer.in_proj"), kBf16);
  EXPECT_EQ(c->module_quant("backbone.layers.42.mixer.o_proj"), kBf16);
  EXPECT_EQ(c->module_quant("backbone.layers.41.mixer.out_proj"), kBf16);
  EXPECT_EQ(c->module_quant("backbone.layers.50.mixer.in_proj"), kFp8);
  EXPECT_EQ(c->module_quant("backbone.layers.40.mixer.in_proj"), kFp8);
}

TEST(QuantConfig, SuperNvfp4MixedPrecisionWithNulSuffixedNames) {
  const auto c = load_quant_config(fixture_dir("super-nvfp4"));
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->algo, QuantAlgo::kMixedPrecision);
  EXPECT_EQ(c->kv_cache, KvCacheQuant::kFp8);
  EXPECT_EQ(c->group_size, 16);
  EXPECT_EQ(c->producer_version, "0.47.0");
  // the sentinel is gone from every name
  for (const auto& p : c->exclude_modules) EXPECT_EQ(p.find('\0'), std::string::npos) << p;
  EXPECT_NE(std::find(c->exclude_modules.begin(), c->exclude_modules.end(), "lm_head"), c->exclude_modules.end());
  EXPECT_EQ(c->module_quant("lm_head"), kBf16);
  EXPECT_TRUE(c->excluded("lm_head"));
  EXPECT_TRUE(c->excluded("backbone.layers.0.mixer.conv1d"));
  EXPECT_TRUE(c->excluded("backbone.layers.7.mixer.q_proj"));
  // routed experts NVFP4, shared experts and Mamba projections FP8, attention / router / conv1d bf16
  EXPECT_EQ(c->module_quant("backbone.layers.1.mixer.experts.0.up_proj"), kNvfp4);
  EXPECT_EQ(c->module_quant("backbone.layers.8.mixer.experts.7.down_proj"), kNvfp4);
  EXPECT_EQ(c->module_quant("backbone.layers.1.mixer.shared_experts.up_proj"), kFp8);
  EXPECT_EQ(c->module_quant("backbone.layers.1.mixer.fc1_latent_proj"), kFp8);
  EXPECT_EQ(c->module_quant("backbone.layers.0.mixer.in_proj"), kFp8);
  EXPECT_EQ(c->module_quant("backbone.layers.6.mixer.out_proj"), kFp8);
  EXPECT_EQ(c->module_quant("backbone.layers.7.mixer.q_proj"), kBf16);
  EXPECT_EQ(c->module_quant("backbone.layers.1.mixer.gate"), kBf16);
  EXPECT_EQ(c->module_quant("backbone.layers.0.mixer.conv1d"), kBf16);
  // not listed: unquantized; a parent of listed modules: their common format
  EXPECT_EQ(c->module_quant("backbone.embeddings"), kBf16);
  EXPECT_EQ(c->module_quant("backbone.layers.1.mixer.experts"), kNvfp4);
  EXPECT_EQ(c->module_quant("backbone.layers.1.mixer.experts.3"), kNvfp4);
  EXPECT_EQ(c->module_quant("backbone.layers.1.mixer.shared_experts"), kFp8);
  EXPECT_INVALID(c->module_quant("backbone.layers.1.mixer"), "backbone.layers.1.mixer", "different formats");
}

// The two metadata files exactly as ModelOpt 0.47.0 exported them (scripts/make_modelopt_fixtures.py, all_kinds
// with mtq.FP8_DEFAULT_CFG): NUL-suffixed names in both, config_groups in config.json, no KV cache quantization.
TEST(QuantConfig, ModelOpt047ExportFp8) {
  const auto c = load_quant_config(fixture_dir("modelopt-0.47-all_kinds-fp8"));
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->algo, QuantAlgo::kFp8);
  EXPECT_EQ(c->kv_cache, KvCacheQuant::kNone);
  EXPECT_EQ(c->producer_version, "0.47.0");
  EXPECT_EQ(c->exclude_modules.size(), 7u);
  EXPECT_EQ(c->module_quant("lm_head"), kBf16);
  EXPECT_EQ(c->module_quant("backbone.embeddings"), kBf16);
  EXPECT_EQ(c->module_quant("backbone.layers.0.mixer.conv1d"), kBf16);
  EXPECT_EQ(c->module_quant("backbone.layers.3.mixer.gate"), kBf16);
  // the export's FP8 tensors: Mamba, attention, MLP and per-expert projections
  EXPECT_EQ(c->module_quant("backbone.layers.0.mixer.in_proj"), kFp8);
  EXPECT_EQ(c->module_quant("backbone.layers.1.mixer.q_proj"), kFp8);
  EXPECT_EQ(c->module_quant("backbone.layers.2.mixer.up_proj"), kFp8);
  EXPECT_EQ(c->module_quant("backbone.layers.3.mixer.experts.4.down_proj"), kFp8);
  EXPECT_EQ(c->module_quant("backbone.layers.3.mixer.shared_experts.up_proj"), kFp8);
}

TEST(QuantConfig, UnquantizedCheckpointHasNone) {
  EXPECT_FALSE(load_quant_config(test::source_path("tests/fixtures/models/all_kinds")).has_value());
}

TEST(QuantConfig, PatternRules) {
  // exact
  EXPECT_TRUE(module_pattern_matches("lm_head", "lm_head"));
  EXPECT_FALSE(module_pattern_matches("lm_head", "lm_head_2"));
  // prefix at a '.' boundary only
  EXPECT_TRUE(module_pattern_matches("backbone.layers.3", "backbone.layers.3.mixer.in_proj"));
  EXPECT_FALSE(module_pattern_matches("backbone.layers.3", "backbone.layers.30.mixer.in_proj"));
  EXPECT_FALSE(module_pattern_matches("layers.3", "backbone.layers.3.mixer.in_proj"));
  // wildcards over the whole name: '*' crosses dots
  EXPECT_TRUE(module_pattern_matches("*mixer.conv1d*", "backbone.layers.0.mixer.conv1d"));
  EXPECT_TRUE(module_pattern_matches("*.experts.*", "backbone.layers.1.mixer.experts.12.up_proj"));
  EXPECT_FALSE(module_pattern_matches("*.experts.*", "backbone.layers.1.mixer.shared_experts.up_proj"));
  EXPECT_TRUE(module_pattern_matches("backbone.layers.4.mixer*", "backbone.layers.4.mixer.in_proj"));
  EXPECT_FALSE(module_pattern_matches("backbone.layers.4.mixer*", "backbone.layers.41.mixer.in_proj"));
  EXPECT_TRUE(module_pattern_matches("backbone.layers.?.mixer.in_proj", "backbone.layers.7.mixer.in_proj"));
  EXPECT_FALSE(module_pattern_matches("backbone.layers.?.mixer.in_proj", "backbone.layers.17.mixer.in_proj"));
  EXPECT_TRUE(module_pattern_matches("backbone.layers.[0-2].*", "backbone.layers.2.mixer.in_proj"));
  EXPECT_FALSE(module_pattern_matches("backbone.layers.[0-2].*", "backbone.layers.3.mixer.in_proj"));
  EXPECT_TRUE(module_pattern_matches("backbone.layers.[!0-2].*", "backbone.layers.3.mixer.in_proj"));
  EXPECT_TRUE(module_pattern_matches("a[b", "a[b"));  // an unclosed '[' is a literal
  EXPECT_TRUE(module_pattern_matches("*", "anything.at.all"));
  EXPECT_FALSE(module_pattern_matches("", "lm_head"));
  EXPECT_TRUE(module_pattern_matches("**a*b**", "xxaxxbxx"));
  EXPECT_FALSE(module_pattern_matches("*a*b", "xxaxxbxxa"));
}

TEST(QuantConfig, NulSuffixedNames) {
  using namespace std::string_literals;
  EXPECT_EQ(parse_module_pattern("lm_head.\0backbone.pt_name_sentinel"s), "lm_head");
  EXPECT_EQ(parse_module_pattern("backbone.layers.3.mixer.\0backbone.pt_name_sentinel*"s), "backbone.layers.3.mixer*");
  EXPECT_EQ(parse_module_pattern("backbone.layers.3.\0backbone.pt_name_sentinel.*"s), "backbone.layers.3.*");
  EXPECT_EQ(parse_module_pattern("lm_head"), "lm_head");
  EXPECT_EQ(parse_module_pattern("*mixer.conv1d*"), "*mixer.conv1d*");
}

// One hf_quant_config.json in a fresh directory.
std::string with_hf(const TempDir& d, const json& j) {
  write_file(d / "hf_quant_config.json", j.dump());
  return (d / "hf_quant_config.json").string();
}

json fp8_hf() {
  return {{"producer", {{"name", "modelopt"}, {"version", "0.47.0"}}},
          {"quantization", {{"quant_algo", "FP8"}, {"kv_cache_quant_algo", nullptr}, {"exclude_modules", json::array({"lm_head"})}}}};
}

TEST(QuantConfig, Fp8WithoutKvCacheAndLowerCaseAlgo) {
  TempDir d;
  json j = fp8_hf();
  j["quantization"]["quant_algo"] = "fp8";
  with_hf(d, j);
  const auto c = load_quant_config(d.path());
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->algo, QuantAlgo::kFp8);
  EXPECT_EQ(c->kv_cache, KvCacheQuant::kNone);
}

TEST(QuantConfig, Nvfp4GroupSizeDefaultsTo16AndOnly16) {
  TempDir d;
  json j = fp8_hf();
  j["quantization"]["quant_algo"] = "NVFP4";
  with_hf(d, j);
  EXPECT_EQ(load_quant_config(d.path())->group_size, 16);
  EXPECT_EQ(load_quant_config(d.path())->module_quant("backbone.layers.0.mixer.in_proj"), kNvfp4);
  j["quantization"]["group_size"] = 32;
  const std::string f = with_hf(d, j);
  EXPECT_INVALID(load_quant_config(d.path()), f, "quantization.group_size", "32", "supported: 16");
  j["quantization"]["group_size"] = "16";
  with_hf(d, j);
  EXPECT_INVALID(load_quant_config(d.path()), "quantization.group_size", "positive integer");
}

TEST(QuantConfig, W4A16Nvfp4) {
  TempDir d;
  json j = fp8_hf();
  j["quantization"]["quant_algo"] = "W4A16_NVFP4";
  with_hf(d, j);
  EXPECT_EQ(load_quant_config(d.path())->module_quant("x.y"), (ModuleQuant{WeightFormat::kNvfp4W4A16, 16}));
}

TEST(QuantConfig, ErrorsNameTheFileAndField) {
  TempDir d;
  json j = fp8_hf();
  j["quantization"]["quant_algo"] = "INT4_AWQ";
  std::string f = with_hf(d, j);
  EXPECT_INVALID(load_quant_config(d.path()), f, "quantization.quant_algo", "INT4_AWQ", "supported: FP8, NVFP4");

  j = fp8_hf();
  j["quantization"].erase("quant_algo");
  with_hf(d, j);
  EXPECT_INVALID(load_quant_config(d.path()), "quantization.quant_algo", "missing");

  j = fp8_hf();
  j["quantization"]["quant_algo"] = 8;
  with_hf(d, j);
  EXPECT_INVALID(load_quant_config(d.path()), "quantization.quant_algo", "must be a string");

  j = fp8_hf();
  j["quantization"]["exclude_modules"] = "lm_head";
  with_hf(d, j);
  EXPECT_INVALID(load_quant_config(d.path()), "quantization.exclude_modules", "list of strings");

  j = fp8_hf();
  j["quantization"]["exclude_modules"] = json::array({"lm_head", 3});
  with_hf(d, j);
  EXPECT_INVALID(load_quant_config(d.path()), "quantization.exclude_modules[1]", "must be a string");

  j = fp8_hf();
  j["quantization"]["kv_cache_quant_algo"] = "INT8";
  with_hf(d, j);
  EXPECT_INVALID(load_quant_config(d.path()), "quantization.kv_cache_quant_algo", "INT8");

  j = fp8_hf();
  j["producer"]["name"] = "llm-compressor";
  with_hf(d, j);
  EXPECT_INVALID(load_quant_config(d.path()), "producer.name", "llm-compressor", "supported: modelopt");

  j = fp8_hf();
  j.erase("quantization");
  with_hf(d, j);
  EXPECT_INVALID(load_quant_config(d.path()), f, "'quantization' is missing");

  write_file(d / "hf_quant_config.json", "{\"quantization\": ");
  EXPECT_INVALID(load_quant_config(d.path()), f);

  j = fp8_hf();
  j["quantization"]["quant_algo"] = "MIXED_PRECISION";
  with_hf(d, j);
  EXPECT_INVALID(load_quant_config(d.path()), "MIXED_PRECISION", "quantized_layers");

  j["quantization"]["quantized_layers"] = {{"a.b", {{"quant_algo", "MIXED_PRECISION"}}}};
  with_hf(d, j);
  EXPECT_INVALID(load_quant_config(d.path()), "quantization.quantized_layers.a.b.quant_algo", "MIXED_PRECISION");

  j["quantization"]["quantized_layers"] = {{"a.b", "NVFP4"}};
  with_hf(d, j);
  EXPECT_INVALID(load_quant_config(d.path()), "quantization.quantized_layers.a.b", "must be an object");

  j = fp8_hf();
  j["quantization"]["quantized_layers"] = {{"a.b", {{"quant_algo", "NVFP4"}}}};
  with_hf(d, j);
  EXPECT_INVALID(load_quant_config(d.path()), "quantized_layers", "quant_algo is FP8");
}

json nano_like_config(const json& qc) {
  return {{"model_type", "nemotron_h"}, {"time_step_limit", {0.0, 1.0}}, {"quantization_config", qc}};
}

TEST(QuantConfig, ConfigJsonAlone) {
  TempDir d;
  // Python's Infinity literal in the same file is accepted, as load_model_config accepts it
  std::string text = nano_like_config({{"quant_method", "modelopt"},
                                       {"quant_algo", "NVFP4"},
                                       {"ignore", json::array({"lm_head", "*mixer.conv1d*"})},
                                       {"kv_cache_scheme", {{"dynamic", false}, {"num_bits", 8}, {"type", "float"}}}})
                         .dump();
  const std::string one = "1.0]";
  text.replace(text.find(one), one.size(), "Infinity]");
  write_file(d / "config.json", text);
  const auto c = load_quant_config(d.path());
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(c->algo, QuantAlgo::kNvfp4);
  EXPECT_EQ(c->kv_cache, KvCacheQuant::kFp8);
  EXPECT_EQ(c->module_quant("backbone.layers.2.mixer.conv1d"), kBf16);
  EXPECT_EQ(c->module_quant("backbone.layers.2.mixer.in_proj"), kNvfp4);
}

TEST(QuantConfig, ConfigJsonErrors) {
  TempDir d;
  const std::string f = (d / "config.json").string();
  write_file(d / "config.json", nano_like_config({{"quant_method", "gptq"}, {"bits", 4}}).dump());
  EXPECT_INVALID(load_quant_config(d.path()), f, "quantization_config.quant_method", "gptq", "supported: modelopt");
  write_file(d / "config.json", nano_like_config({{"quant_algo", "FP8"}}).dump());
  EXPECT_INVALID(load_quant_config(d.path()), f, "quantization_config.quant_method", "missing");
  write_file(d / "config.json",
             nano_like_config({{"quant_method", "modelopt"}, {"quant_algo", "FP8"}, {"kv_cache_scheme", "fp8"}}).dump());
  EXPECT_INVALID(load_quant_config(d.path()), "quantization_config.kv_cache_scheme", "must be an object");
  write_file(d / "config.json", nano_like_config({{"quant_method", "modelopt"},
                                                  {"quant_algo", "FP8"},
                                                  {"kv_cache_scheme", {{"type", "int"}, {"num_bits", 8}}}})
                                    .dump());
  EXPECT_INVALID(load_quant_config(d.path()), "quantization_config.kv_cache_scheme", "unsupported");
  write_file(d / "config.json", nano_like_config({{"quant_method", "modelopt"}, {"quant_algo", "FP8"}, {"ignore", 1}})
                                    .dump());
  EXPECT_INVALID(load_quant_config(d.path()), "quantization_config.ignore", "list of strings");
  write_file(d / "config.json", nano_like_config("FP8").dump());
  EXPECT_INVALID(load_quant_config(d.path()), "'quantization_config' must be an object");
}

TEST(QuantConfig, BothFilesMustAgree) {
  TempDir d;
  const std::string hf = with_hf(d, fp8_hf());
  const std::string cfg = (d / "config.json").string();
  const json agree = {{"quant_method", "modelopt"}, {"quant_algo", "FP8"}, {"ignore", json::array({"lm_head"})}};
  write_file(d / "config.json", nano_like_config(agree).dump());
  ASSERT_TRUE(load_quant_config(d.path()).has_value());

  json qc = agree;
  qc["quant_algo"] = "NVFP4";
  write_file(d / "config.json", nano_like_config(qc).dump());
  EXPECT_INVALID(load_quant_config(d.path()), hf, cfg, "disagree on quant_algo", "FP8 vs NVFP4");

  qc = agree;
  qc["ignore"] = json::array({"lm_head", "*mixer.conv1d*"});
  write_file(d / "config.json", nano_like_config(qc).dump());
  EXPECT_INVALID(load_quant_config(d.path()), "disagree on the excluded modules", "*mixer.conv1d*");

  qc = agree;
  qc["kv_cache_scheme"] = {{"num_bits", 8}, {"type", "float"}};
  write_file(d / "config.json", nano_like_config(qc).dump());
  EXPECT_INVALID(load_quant_config(d.path()), "disagree on the KV cache", "none vs FP8");

  // the same names, one with ModelOpt 0.47's sentinel: they agree
  qc = agree;
  qc["ignore"] = json::array({std::string("lm_head.\0backbone.pt_name_sentinel", 34)});
  write_file(d / "config.json", nano_like_config(qc).dump());
  EXPECT_TRUE(load_quant_config(d.path()).has_value());
}

}  // namespace
}  // namespace chimera
