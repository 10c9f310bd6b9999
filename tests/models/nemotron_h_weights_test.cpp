// The weights module (models/nemotron_h_weights.h): bad quantized checkpoints are kInvalidInput errors naming the
// tensor; the name table's counts; quantization at load (ModelOptions::quantize) against the dense model.
#include "models/nemotron_h_weights.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <gtest/gtest.h>

#include "common/compare.h"
#include "core/error.h"
#include "io/model_presets.h"
#include "io/safetensors.h"
#include "models/model_fixtures.h"
#include "runtime/memory_plan.h"
#include "runtime/roofline.h"
#include "models/nemotron_h.h"

namespace chimera {
namespace {

namespace fs = std::filesystem;

Tensor scalar(float v) { return Tensor::from_f32({}, std::vector<float>{v}); }

// A copy of ModelOpt's all_kinds-mixed checkpoint (FP8 Mamba / shared-expert projections, NVFP4 MLP and routed
// experts, dense attention) to break one piece at a time.
class BadQuantCheckpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    const fs::path src = test::source_path("tests/fixtures/quant/models/all_kinds-mixed");
    ASSERT_TRUE(fs::exists(src / "hf_quant_config.json")) << "missing fixture " << src;
    dir_ = fs::temp_directory_path() /
           ("chimera_badquant_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    fs::copy_file(src / "config.json", dir_ / "config.json");
    fs::copy_file(src / "hf_quant_config.json", dir_ / "hf_quant_config.json");
    const Checkpoint ck = Checkpoint::open(src);
    for (const auto& n : ck.names()) tensors_.emplace_back(n, ck.tensor(n).clone());
  }
  void TearDown() override { fs::remove_all(dir_); }

  Tensor& tensor(const std::string& name) {
    for (auto& [n, t] : tensors_) {
      if (n == name) return t;
    }
    ADD_FAILURE() << "no tensor " << name;
    return tensors_[0].second;
  }
  void erase(const std::string& name) {
    const auto it = std::find_if(tensors_.begin(), tensors_.end(), [&](const auto& p) { return p.first == name; });
    ASSERT_NE(it, tensors_.end()) << name;
    tensors_.erase(it);
  }

  // Writes tensors_ and returns the error message of loading the model (empty if it loaded).
  std::string load_error() {
    write_safetensors(dir_ / "model.safetensors", tensors_);
    try {
      const ModelConfig c = load_model_config(dir_);
      const Checkpoint ck = Checkpoint::open(dir_);
      NemotronH::load(c, ck);
    } catch (const Error& e) {
      EXPECT_EQ(e.exit_code(), 2) << e.what();
      return e.what();
    }
    return "";
  }

  fs::path dir_;
  std::vector<std::pair<std::string, Tensor>> tensors_;
};

TEST_F(BadQuantCheckpoint, IntactCopyLoads) { EXPECT_EQ(load_error(), ""); }

TEST_F(BadQuantCheckpoint, Nvfp4BlockScaleOfWrongShapeIsNamed) {
  tensor("backbone.layers.2.mixer.up_proj.weight_scale") = Tensor::zeros(DType::kF8E4M3, {96, 3});
  const std::string e = load_error();
  EXPECT_NE(e.find("backbone.layers.2.mixer.up_proj.weight_scale"), std::string::npos) << e;
  EXPECT_NE(e.find("[96, 3]"), std::string::npos) << e;
  EXPECT_NE(e.find("[96, 4]"), std::string::npos) << e;
}

TEST_F(BadQuantCheckpoint, Fp8ScaleThatIsNotAScalarIsNamed) {
  tensor("backbone.layers.0.mixer.in_proj.weight_scale") = Tensor::from_f32({2}, std::vector<float>{1.0f, 1.0f});
  const std::string e = load_error();
  EXPECT_NE(e.find("backbone.layers.0.mixer.in_proj.weight_scale"), std::string::npos) << e;
  EXPECT_NE(e.find("scalar"), std::string::npos) << e;
}

TEST_F(BadQuantCheckpoint, NonPositiveScaleIsNamed) {
  tensor("backbone.layers.3.mixer.experts.5.down_proj.weight_scale_2") = scalar(0.0f);
  const std::string e = load_error();
  EXPECT_NE(e.find("backbone.layers.3.mixer.experts.5.down_proj.weight_scale_2"), std::string::npos) << e;
  EXPECT_NE(e.find("positive finite"), std::string::npos) << e;
}

TEST_F(BadQuantCheckpoint, MissingScaleIsNamed) {
  erase("backbone.layers.4.mixer.out_proj.weight_scale");
  const std::string e = load_error();
  EXPECT_NE(e.find("missing"), std::string::npos) << e;
  EXPECT_NE(e.find("backbone.layers.4.mixer.out_proj.weight_scale"), std::string::npos) << e;
}

TEST_F(BadQuantCheckpoint, QuantizedTensorWhereTheConfigSaysDenseIsNamed) {
  tensor("backbone.layers.1.mixer.q_proj.weight") = Tensor::zeros(DType::kF8E4M3, {64, 64});
  const std::string e = load_error();
  EXPECT_NE(e.find("backbone.layers.1.mixer.q_proj.weight"), std::string::npos) << e;
  EXPECT_NE(e.find("unquantized"), std::string::npos) << e;
}

TEST_F(BadQuantCheckpoint, DenseTensorWhereTheConfigSaysFp8IsNamed) {
  tensor("backbone.layers.0.mixer.in_proj.weight") = Tensor::zeros(DType::kF32, {328, 64});
  const std::string e = load_error();
  EXPECT_NE(e.find("backbone.layers.0.mixer.in_proj.weight"), std::string::npos) << e;
  EXPECT_NE(e.find("F8_E4M3"), std::string::npos) << e;
  EXPECT_NE(e.find("fp8"), std::string::npos) << e;
}

TEST_F(BadQuantCheckpoint, ScaleTensorOfADenseModuleIsUnexpected) {
  tensors_.emplace_back("backbone.layers.1.mixer.o_proj.weight_scale", scalar(1.0f));
  const std::string e = load_error();
  EXPECT_NE(e.find("unexpected"), std::string::npos) << e;
  EXPECT_NE(e.find("backbone.layers.1.mixer.o_proj.weight_scale"), std::string::npos) << e;
}

TEST_F(BadQuantCheckpoint, UnknownQuantAlgoIsNamed) {
  std::ifstream in(dir_ / "hf_quant_config.json");
  std::stringstream ss;
  ss << in.rdbuf();
  std::string text = ss.str();
  const auto at = text.find("\"MIXED_PRECISION\"");
  ASSERT_NE(at, std::string::npos);
  text.replace(at, std::string("\"MIXED_PRECISION\"").size(), "\"INT4_AWQ\"");
  std::ofstream(dir_ / "hf_quant_config.json") << text;
  const std::string e = load_error();
  EXPECT_NE(e.find("quant_algo"), std::string::npos) << e;
  EXPECT_NE(e.find("INT4_AWQ"), std::string::npos) << e;
}

TEST_F(BadQuantCheckpoint, Nvfp4WithAnOddInputSizeIsNamed) {
  // intermediate_size 41: the NVFP4 MLP down_proj has in = 41 (odd, and not a multiple of 16).
  std::ifstream in(dir_ / "config.json");
  nlohmann::json cfg = nlohmann::json::parse(in);
  cfg["intermediate_size"] = 41;
  std::ofstream(dir_ / "config.json") << cfg.dump();
  for (const char* l : {"2", "5"}) {
    const std::string p = std::string("backbone.layers.") + l + ".mixer.up_proj.";
    tensor(p + "weight") = Tensor::zeros(DType::kU8, {41, 32});
    tensor(p + "weight_scale") = Tensor::zeros(DType::kF8E4M3, {41, 4});
  }
  const std::string e = load_error();
  EXPECT_NE(e.find("backbone.layers.2.mixer.down_proj"), std::string::npos) << e;
  EXPECT_NE(e.find("in = 41"), std::string::npos) << e;
}

TEST_F(BadQuantCheckpoint, KvCacheScalesAreKeptAndCheckedAsScalars) {
  tensors_.emplace_back("backbone.layers.1.mixer.k_proj.k_scale", scalar(0.5f));
  tensors_.emplace_back("backbone.layers.1.mixer.v_proj.v_scale", scalar(0.25f));
  write_safetensors(dir_ / "model.safetensors", tensors_);
  const ModelConfig c = load_model_config(dir_);
  const Checkpoint ck = Checkpoint::open(dir_);
  const NemotronH m = NemotronH::load(c, ck);
  EXPECT_EQ(m.weights().layers[1].attention.k_scale, 0.5f);
  EXPECT_EQ(m.weights().layers[1].attention.v_scale, 0.25f);
  EXPECT_EQ(m.weights().layers[7].attention.k_scale, 0.0f);  // none in the file: 0
  tensor("backbone.layers.1.mixer.v_proj.v_scale") = Tensor::from_f32({2}, std::vector<float>{1.0f, 1.0f});
  const std::string e = load_error();
  EXPECT_NE(e.find("backbone.layers.1.mixer.v_proj.v_scale"), std::string::npos) << e;
}

TEST(WeightsModule, SummaryCountsLogicalParametersAndStoredBytes) {
  const fs::path dir = test::source_path("tests/fixtures/quant/models/all_kinds-mixed");
  const ModelConfig c = load_model_config(dir);
  const Checkpoint ck = Checkpoint::open(dir);
  const NemotronH m = NemotronH::load(c, ck);
  const auto s = weight_summary(c, m.weights());
  // Parameters: the same as the dense model of this config (a quantized weight counts N x K).
  int64_t total = 0;
  for (const auto& [kind, k] : s) total += k.parameters;
  EXPECT_EQ(total, parameter_count(c));
  EXPECT_EQ(m.parameter_counts(), parameter_counts(c));
  // Bytes as stored: the Mamba layers' in_proj / out_proj are FP8 (1 byte a weight + two F32 scalars).
  const int64_t D = c.hidden_size, Di = c.mamba_inner(), H = c.mamba_num_heads, Cd = c.conv_dim();
  const int64_t fp8 = c.in_proj_dim() * D + D * Di + 4 * 4;
  const int64_t f32 = 4 * (D + Cd * c.conv_kernel + (c.use_conv_bias ? Cd : 0) + 3 * H + Di);
  const auto n_mamba = std::count(c.layers.begin(), c.layers.end(), LayerKind::kMamba);
  EXPECT_EQ(s.at("mamba").bytes, n_mamba * (fp8 + f32));
  EXPECT_EQ(s.at("mamba").formats, "fp8");
  EXPECT_EQ(s.at("moe").formats, "fp8+nvfp4");
  EXPECT_EQ(s.at("attention").formats, "dense");
  EXPECT_EQ(s.at("lm_head").formats, "dense");
}

// --quantization at load on the bundled model (models/nemotron-h-tiny) beside its fp32 run: the layers are quantized
// (FP8 with dynamic activation scales, NVFP4 weight-only), lm_head stays dense, the parameter count is unchanged, the logits are finite and moved. How far they
// move is reported, not bounded: the bundled model has random weights, and a random model's logits respond to a
// weight perturbation chaotically (the MoE routers' choices flip), so no bound derived from the weight rounding holds
// at the output. The exactness of the quantizers is tested where a reference exists: ModelOptQuantizeAtLoad in
// nemotron_h_quant_test.cpp reproduces ModelOpt's own weights-only logits to fp32 summation order.
TEST(WeightsModule, QuantizeAtLoadOnTheBundledModel) {
  const fs::path dir = test::source_path("models/nemotron-h-tiny");
  const ModelConfig c = load_model_config(dir);
  const Checkpoint ck = Checkpoint::open(dir);
  const NemotronH dense = NemotronH::load(c, ck);
  for (const ops::WeightFormat f : {ops::WeightFormat::kFp8, ops::WeightFormat::kNvfp4}) {
    SCOPED_TRACE(ops::weight_format_name(f));
    ModelOptions o;
    o.quantize = f;
    const NemotronH q = NemotronH::load(c, ck, o);
    EXPECT_EQ(q.weights().layers[0].mamba.in_proj.format, f);
    // No calibration: FP8 layers (experts too) quantize their activations dynamically, NVFP4 runs weight-only.
    const ops::ActQuant want = f == ops::WeightFormat::kFp8 ? ops::ActQuant::kDynamic : ops::ActQuant::kNone;
    EXPECT_EQ(q.weights().layers[0].mamba.in_proj.act, want);
    int moe = 0;
    for (const LayerWeights& L : q.weights().layers) {
      if (L.kind != LayerKind::kMoe) continue;
      EXPECT_EQ(L.moe.experts_up.act, want);
      EXPECT_EQ(L.moe.experts_down.act, want);
      ++moe;
    }
    EXPECT_GT(moe, 0);
    EXPECT_EQ(q.weights().lm_head.format, ops::WeightFormat::kDense);  // ModelOpt's default exclusion
    EXPECT_EQ(q.parameter_counts(), dense.parameter_counts());
    const std::vector<int32_t> prompt = {5, 17, 42, 99, 3, 64, 7, 128, 11, 200};
    const test::RunResult a = test::run_prompt(dense, prompt, 1, 4096), b = test::run_prompt(q, prompt, 1, 4096);
    ASSERT_EQ(a.logits.size(), b.logits.size());
    double max_ref = 0.0, max_err = 0.0;
    for (size_t i = 0; i < a.logits.size(); ++i) {
      max_ref = std::max(max_ref, std::fabs(static_cast<double>(a.logits[i])));
      max_err = std::max(max_err, std::fabs(static_cast<double>(a.logits[i]) - b.logits[i]));
    }
    std::printf("[ quantize ] %s at load: max|logit - dense| / max|dense| = %.3e\n", ops::weight_format_name(f),
                max_err / max_ref);
    EXPECT_GT(max_err, 0.0);  // the weights did change
    for (const float v : b.logits) ASSERT_TRUE(std::isfinite(v));
  }
}

TEST(WeightsModule, QuantizeAtLoadRejectsAQuantizedCheckpoint) {
  const fs::path dir = test::source_path("tests/fixtures/quant/models/all_kinds-fp8");
  const ModelConfig c = load_model_config(dir);
  const Checkpoint ck = Checkpoint::open(dir);
  ModelOptions o;
  o.quantize = ops::WeightFormat::kNvfp4;
  try {
    NemotronH::load(c, ck, o);
    FAIL() << "loaded";
  } catch (const Error& e) {
    EXPECT_EQ(e.exit_code(), 2);
    EXPECT_NE(std::string(e.what()).find("already quantized"), std::string::npos) << e.what();
  }
}

TEST(WeightsModule, SyntheticQuantizedModelRuns) {
  ModelConfig c = model_preset("tiny");
  ModelOptions o;
  o.quantize = ops::WeightFormat::kFp8;
  const NemotronH m = NemotronH::synthetic(c, o, 1);
  const auto s = weight_summary(c, m.weights());
  EXPECT_EQ(s.at("mamba").formats, "fp8");
  const test::RunResult r = test::run_prompt(m, {1, 2, 3, 4}, 2, 4096);
  ASSERT_FALSE(r.logits.empty());
  for (float v : r.logits) ASSERT_TRUE(std::isfinite(v));
}

// memory_plan's weight_bytes (from the config alone) equals what the name table counts for a model quantized at load,
// kind by kind (fp32 synthetic weights: the plan's fp32 parameters then need no special case).
TEST(WeightsModule, MemoryPlanCountsQuantizedBytesAsTheModelStoresThem) {
  const ModelConfig c = model_preset("tiny");
  for (const ops::WeightFormat f : {ops::WeightFormat::kDense, ops::WeightFormat::kFp8, ops::WeightFormat::kNvfp4}) {
    SCOPED_TRACE(ops::weight_format_name(f));
    ModelOptions o;
    o.dtype = DType::kF32;
    o.quantize = f;
    const NemotronH m = NemotronH::synthetic(c, o, 3);
    const auto plan = weight_bytes(c, DType::kF32, f);
    for (const auto& [kind, k] : weight_summary(c, m.weights())) EXPECT_EQ(plan.at(kind), k.bytes) << kind;
    int64_t total = 0;
    for (const auto& [kind, b] : plan) total += b;
    EXPECT_EQ(plan_memory(c, DType::kF32, DType::kF32, MemoryLimits{}, f).weights, static_cast<size_t>(total));
  }
}

// The stored-bytes roofline equals runtime/roofline.h's for dense fp32 weights (every parameter 4 bytes), and FP8 /
// NVFP4 at load shrink it by the linear layers' share.
TEST(WeightsModule, DecodeBytesPerTokenIsTheRooflineInStoredBytes) {
  const ModelConfig c = model_preset("tiny");
  ModelOptions o;
  o.dtype = DType::kF32;
  const NemotronH dense = NemotronH::synthetic(c, o, 3);
  const DecodeRoofline r = batch1_decode_roofline(c, DType::kF32, 4.2e12);
  EXPECT_DOUBLE_EQ(decode_bytes_per_token(c, dense.weights()), r.bytes_per_token);
  o.quantize = ops::WeightFormat::kFp8;
  const double fp8 = decode_bytes_per_token(c, NemotronH::synthetic(c, o, 3).weights());
  o.quantize = ops::WeightFormat::kNvfp4;
  const double nvfp4 = decode_bytes_per_token(c, NemotronH::synthetic(c, o, 3).weights());
  EXPECT_LT(fp8, r.bytes_per_token);
  EXPECT_LT(nvfp4, fp8);
}

}  // namespace
}  // namespace chimera
