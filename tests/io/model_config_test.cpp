#include "io/model_config.h"

#include <cmath>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/compare.h"
#include "io/io_test_util.h"

namespace chimera {
namespace {

using json = nlohmann::json;
using test::layer_counts;
using test::LayerCounts;
using test::TempDir;
using test::write_file;

ModelConfig load_fixture(const std::string& name) {
  const std::string path = test::source_path("tests/fixtures/configs/" + name);
  return parse_model_config(test::read_file(path), path);
}

// The smallest valid config; tests add or change fields.
json minimal() { return {{"model_type", "nemotron_h"}, {"hybrid_override_pattern", "M*-E"}}; }
ModelConfig parse(const json& j) { return parse_model_config(j.dump(), "cfg.json"); }

// ---- published configs (docs/model.md 9, sizes from 3.1) ----------------------------------------------

TEST(ModelConfigPublished, NemotronH8B) {
  const ModelConfig c = load_fixture("nemotron-h-8b.json");
  EXPECT_EQ(c.pattern(), "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-");
  EXPECT_EQ(c.num_hidden_layers(), 52);
  EXPECT_EQ(layer_counts(c), (LayerCounts{24, 4, 24, 0}));
  EXPECT_EQ(c.hidden_size, 4096);
  EXPECT_EQ(c.vocab_size, 131072);
  EXPECT_EQ(c.num_attention_heads, 32);
  EXPECT_EQ(c.num_key_value_heads, 8);
  EXPECT_EQ(c.head_dim, 128);  // from attention_head_dim
  EXPECT_EQ(c.intermediate_size, 21504);
  EXPECT_EQ(c.mamba_num_heads, 128);
  EXPECT_EQ(c.mamba_head_dim, 64);
  EXPECT_EQ(c.ssm_state_size, 128);
  EXPECT_EQ(c.n_groups, 8);
  EXPECT_EQ(c.conv_kernel, 4);
  EXPECT_EQ(c.chunk_size, 128);
  EXPECT_EQ(c.max_position_embeddings, 8192);
  EXPECT_FLOAT_EQ(c.layer_norm_epsilon, 1e-5f);
  EXPECT_EQ(c.mamba_inner(), 8192);
  EXPECT_EQ(c.conv_dim(), 10240);
  EXPECT_EQ(c.in_proj_dim(), 18560);
  EXPECT_EQ(c.num_attention_heads * c.head_dim, 4096);   // q_proj out
  EXPECT_EQ(c.num_key_value_heads * c.head_dim, 1024);   // k/v_proj out
  EXPECT_EQ(c.mamba_inner() / c.n_groups, 1024);         // gated-norm group size
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.torch_dtype, "bfloat16");
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{2});
  EXPECT_EQ(c.bos_token_id, 1);
  EXPECT_EQ(c.pad_token_id, 0);
  EXPECT_TRUE(c.use_conv_bias);
  EXPECT_FALSE(c.use_bias);
  EXPECT_EQ(c.num_nextn_predict_layers, 0);
  EXPECT_TRUE(c.mtp_layers.empty());
  EXPECT_TRUE(std::isinf(c.time_step_limit_max));
  EXPECT_EQ(c.time_step_limit_min, 0.0f);
}

TEST(ModelConfigPublished, Nemotron3Nano30BA3B) {
  const ModelConfig c = load_fixture("nemotron-3-nano-30b-a3b.json");
  EXPECT_EQ(c.num_hidden_layers(), 52);
  EXPECT_EQ(layer_counts(c), (LayerCounts{23, 6, 0, 23}));
  EXPECT_EQ(c.layers[5], LayerKind::kAttention);
  EXPECT_EQ(c.hidden_size, 2688);
  EXPECT_EQ(c.num_attention_heads, 32);
  EXPECT_EQ(c.num_key_value_heads, 2);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.mamba_num_heads, 64);
  EXPECT_EQ(c.mamba_head_dim, 64);
  EXPECT_EQ(c.mamba_inner(), 4096);
  EXPECT_EQ(c.conv_dim(), 6144);
  EXPECT_EQ(c.in_proj_dim(), 10304);
  EXPECT_EQ(c.num_key_value_heads * c.head_dim, 256);
  EXPECT_EQ(c.mamba_num_heads / c.n_groups, 8);
  EXPECT_EQ(c.n_routed_experts, 128);
  EXPECT_EQ(c.num_experts_per_tok, 6);
  EXPECT_EQ(c.moe_intermediate_size, 1856);
  EXPECT_EQ(c.moe_shared_expert_intermediate_size, 3712);
  EXPECT_EQ(c.n_shared_experts, 1);
  EXPECT_FALSE(c.moe_latent_size.has_value());
  EXPECT_EQ(c.moe_input_dim(), 2688);
  EXPECT_FLOAT_EQ(c.routed_scaling_factor, 2.5f);
  EXPECT_EQ(c.n_group, 1);
  EXPECT_EQ(c.topk_group, 1);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_FALSE(c.sliding_window.has_value());
  EXPECT_EQ(c.max_position_embeddings, 262144);
  EXPECT_FLOAT_EQ(c.layer_norm_epsilon, 1e-5f);
  EXPECT_FLOAT_EQ(c.time_step_floor, 1e-4f);
  EXPECT_EQ(c.mamba_ssm_cache_dtype, "float32");
}

TEST(ModelConfigPublished, Nemotron3Super120BA12B) {
  const ModelConfig c = load_fixture("nemotron-3-super-120b-a12b.json");
  EXPECT_EQ(c.num_hidden_layers(), 88);
  EXPECT_EQ(layer_counts(c), (LayerCounts{40, 8, 0, 40}));
  EXPECT_EQ(c.hidden_size, 4096);
  EXPECT_EQ(c.mamba_inner(), 8192);
  EXPECT_EQ(c.conv_dim(), 10240);
  EXPECT_EQ(c.in_proj_dim(), 18560);
  EXPECT_EQ(c.num_key_value_heads * c.head_dim, 256);
  EXPECT_EQ(c.n_routed_experts, 512);
  EXPECT_EQ(c.num_experts_per_tok, 22);
  EXPECT_EQ(c.moe_intermediate_size, 2688);
  EXPECT_EQ(c.moe_shared_expert_intermediate_size, 5376);
  ASSERT_TRUE(c.moe_latent_size.has_value());
  EXPECT_EQ(*c.moe_latent_size, 1024);
  EXPECT_EQ(c.moe_input_dim(), 1024);
  EXPECT_FLOAT_EQ(c.routed_scaling_factor, 5.0f);
  EXPECT_EQ(c.num_nextn_predict_layers, 1);
  EXPECT_EQ(c.mtp_layers, (std::vector<LayerKind>{LayerKind::kAttention, LayerKind::kMoe}));
}

// ---- defaults and aliases -----------------------------------------------------------------------------

TEST(ModelConfig, HfDefaults) {
  const ModelConfig c = parse(minimal());
  const ModelConfig d;  // the struct's initialisers are HF's defaults
  EXPECT_EQ(c.vocab_size, 131072);
  EXPECT_EQ(c.hidden_size, 4096);
  EXPECT_EQ(c.num_attention_heads, 32);
  EXPECT_EQ(c.num_key_value_heads, 8);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.intermediate_size, 21504);
  EXPECT_EQ(c.mamba_num_heads, 128);
  EXPECT_EQ(c.n_groups, 8);
  EXPECT_EQ(c.conv_kernel, 4);
  EXPECT_EQ(c.chunk_size, 128);
  EXPECT_EQ(c.n_routed_experts, 8);
  EXPECT_EQ(c.num_experts_per_tok, 2);
  EXPECT_EQ(c.moe_intermediate_size, 7688);
  EXPECT_FLOAT_EQ(c.layer_norm_epsilon, 1e-5f);
  EXPECT_FLOAT_EQ(c.time_step_min, 0.001f);
  EXPECT_FLOAT_EQ(c.time_step_max, 0.1f);
  EXPECT_FLOAT_EQ(c.time_step_floor, 1e-4f);
  EXPECT_EQ(c.eos_token_ids, d.eos_token_ids);
  EXPECT_EQ(c.pattern(), "M*-E");
}

struct AliasCase {
  const char* alias;
  json value;
  std::function<double(const ModelConfig&)> get;
  double want;
};

TEST(ModelConfig, EveryLegacyAlias) {
  const std::vector<AliasCase> cases = {
      {"attention_head_dim", 64, [](const ModelConfig& c) { return double(c.head_dim); }, 64},
      {"rms_norm_eps", 1e-6, [](const ModelConfig& c) { return double(c.layer_norm_epsilon); }, double(1e-6f)},
      {"norm_eps", 2e-6, [](const ModelConfig& c) { return double(c.layer_norm_epsilon); }, double(2e-6f)},
      {"mamba_n_groups", 4, [](const ModelConfig& c) { return double(c.n_groups); }, 4},
      {"mamba_d_conv", 3, [](const ModelConfig& c) { return double(c.conv_kernel); }, 3},
      {"mamba_expand", 3, [](const ModelConfig& c) { return double(c.expand); }, 3},
      {"mamba_chunk_size", 64, [](const ModelConfig& c) { return double(c.chunk_size); }, 64},
      {"mamba_conv_bias", false, [](const ModelConfig& c) { return double(c.use_conv_bias); }, 0},
      {"mamba_dt_min", 0.002, [](const ModelConfig& c) { return double(c.time_step_min); }, double(0.002f)},
      {"mamba_dt_max", 0.2, [](const ModelConfig& c) { return double(c.time_step_max); }, double(0.2f)},
      {"mamba_dt_init_floor", 0.001, [](const ModelConfig& c) { return double(c.time_step_floor); }, double(0.001f)},
      {"mamba_dt_limit", json::array({0.5, 8.0}),
       [](const ModelConfig& c) { return double(c.time_step_limit_min + 100 * c.time_step_limit_max); }, 800.5},
  };
  for (const auto& tc : cases) {
    SCOPED_TRACE(tc.alias);
    json j = minimal();
    j[tc.alias] = tc.value;
    EXPECT_EQ(tc.get(parse(j)), tc.want);
  }
  json j = minimal();
  j["dtype"] = "float16";
  EXPECT_EQ(parse(j).torch_dtype, "float16");
  j.erase("dtype");
  j["torch_dtype"] = "float32";
  EXPECT_EQ(parse(j).torch_dtype, "float32");
}

TEST(ModelConfig, AliasesThatDisagreeAreRejected) {
  json j = minimal();
  j["layer_norm_epsilon"] = 1e-5;
  j["rms_norm_eps"] = 1e-6;
  EXPECT_INVALID(parse(j), "cfg.json", "'layer_norm_epsilon'", "'rms_norm_eps'", "disagree");
  j["rms_norm_eps"] = 1e-5;  // both present and equal: fine (old Nemotron-H configs do this)
  EXPECT_FLOAT_EQ(parse(j).layer_norm_epsilon, 1e-5f);
}

TEST(ModelConfig, TimeStepLimitWithInfinityAndNull) {
  // Python's json.dump writes the HF default (0.0, inf) as [0.0, Infinity].
  const std::string text = R"({"model_type": "nemotron_h", "hybrid_override_pattern": "M",
                               "note": "Infinity inside a string stays", "time_step_limit": [0.0, Infinity]})";
  const ModelConfig c = parse_model_config(text, "cfg.json");
  EXPECT_EQ(c.time_step_limit_min, 0.0f);
  EXPECT_TRUE(std::isinf(c.time_step_limit_max) && c.time_step_limit_max > 0);
  json j = minimal();
  j["time_step_limit"] = json::array({0.1, nullptr});
  const ModelConfig d = parse(j);
  EXPECT_FLOAT_EQ(d.time_step_limit_min, 0.1f);
  EXPECT_TRUE(std::isinf(d.time_step_limit_max));
  // transformers 5.x's own config serialiser writes the infinity as {"__float__": "Infinity"}.
  j["time_step_limit"] = json::array({0.0, json{{"__float__", "Infinity"}}});
  const ModelConfig e = parse(j);
  EXPECT_TRUE(std::isinf(e.time_step_limit_max) && e.time_step_limit_max > 0);
  j["time_step_limit"] = json::array({0.0, json{{"__float__", "big"}}});
  EXPECT_INVALID(parse(j), "cfg.json", "'time_step_limit'", "a number");
  j["time_step_limit"] = json::array({0.1});
  EXPECT_INVALID(parse(j), "cfg.json", "'time_step_limit'", "[min, max]");
}

TEST(ModelConfig, EosTokenIdIntOrList) {
  json j = minimal();
  j["eos_token_id"] = 7;
  EXPECT_EQ(parse(j).eos_token_ids, std::vector<int64_t>{7});
  j["eos_token_id"] = {2, 11};
  EXPECT_EQ(parse(j).eos_token_ids, (std::vector<int64_t>{2, 11}));
  j["eos_token_id"] = "2";
  EXPECT_INVALID(parse(j), "cfg.json", "'eos_token_id'", "an integer or a list of integers");
}

// ---- the layer pattern --------------------------------------------------------------------------------

TEST(ModelConfig, LayersBlockTypeNewAndLegacyNames) {
  json j = {{"model_type", "nemotron_h"},
            {"layers_block_type", {"linear_attention", "full_attention", "mlp", "moe", "mamba", "attention"}}};
  const ModelConfig c = parse(j);
  EXPECT_EQ(c.pattern(), "M*-EM*");
  j["hybrid_override_pattern"] = "M*-EM*";  // both forms, agreeing
  EXPECT_EQ(parse(j).pattern(), "M*-EM*");
  j["hybrid_override_pattern"] = "M*-EMM";
  EXPECT_INVALID(parse(j), "cfg.json", "'hybrid_override_pattern'", "'layers_block_type'", "disagree");
  j.erase("hybrid_override_pattern");
  j["layers_block_type"] = {"mamba", "mamba2"};
  EXPECT_INVALID(parse(j), "cfg.json", "'layers_block_type'", "\"mamba2\"", "position 1");
  j["layers_block_type"] = "M*";
  EXPECT_INVALID(parse(j), "cfg.json", "'layers_block_type'", "list of strings");
}

TEST(ModelConfig, UnknownPatternCharacter) {
  json j = minimal();
  j["hybrid_override_pattern"] = "MM*X-";
  EXPECT_INVALID(parse(j), "cfg.json", "'hybrid_override_pattern'", "'X'", "position 3");
  EXPECT_INVALID(parse_layer_pattern("M|M", "hybrid_override_pattern"), "'hybrid_override_pattern'", "'|'",
                 "position 1");
  EXPECT_EQ(parse_layer_pattern("E-*M", "p"),
            (std::vector<LayerKind>{LayerKind::kMoe, LayerKind::kMlp, LayerKind::kAttention, LayerKind::kMamba}));
}

TEST(ModelConfig, LayerKindNames) {
  EXPECT_EQ(layer_kind_char(LayerKind::kMamba), 'M');
  EXPECT_EQ(layer_kind_char(LayerKind::kAttention), '*');
  EXPECT_EQ(layer_kind_char(LayerKind::kMlp), '-');
  EXPECT_EQ(layer_kind_char(LayerKind::kMoe), 'E');
  EXPECT_STREQ(layer_kind_name(LayerKind::kMamba), "mamba");
  EXPECT_STREQ(layer_kind_name(LayerKind::kAttention), "attention");
  EXPECT_STREQ(layer_kind_name(LayerKind::kMlp), "mlp");
  EXPECT_STREQ(layer_kind_name(LayerKind::kMoe), "moe");
}

TEST(ModelConfig, NumHiddenLayersMustMatchPattern) {
  json j = minimal();
  j["num_hidden_layers"] = 4;
  EXPECT_EQ(parse(j).num_hidden_layers(), 4);
  j["num_hidden_layers"] = 5;
  EXPECT_INVALID(parse(j), "cfg.json", "num_hidden_layers is 5", "has 4 layers");
}

TEST(ModelConfig, MissingOrEmptyPattern) {
  EXPECT_INVALID(parse(json{{"model_type", "nemotron_h"}}), "cfg.json", "'hybrid_override_pattern'",
                 "'layers_block_type'");
  json j = minimal();
  j["hybrid_override_pattern"] = "";
  EXPECT_INVALID(parse(j), "cfg.json", "empty");
}

TEST(ModelConfig, MtpPatternForms) {
  json j = minimal();
  j["num_nextn_predict_layers"] = 1;
  j["mtp_layers_block_type"] = {"full_attention", "moe"};
  EXPECT_EQ(parse(j).mtp_layers, (std::vector<LayerKind>{LayerKind::kAttention, LayerKind::kMoe}));
  j["mtp_hybrid_override_pattern"] = "*-";
  EXPECT_INVALID(parse(j), "cfg.json", "'mtp_hybrid_override_pattern'", "'mtp_layers_block_type'", "disagree");
  j.erase("mtp_layers_block_type");
  j["mtp_hybrid_override_pattern"] = "*?";
  EXPECT_INVALID(parse(j), "cfg.json", "'mtp_hybrid_override_pattern'", "'?'", "position 1");
}

// ---- bad input ----------------------------------------------------------------------------------------

TEST(ModelConfig, MalformedJson) {
  EXPECT_INVALID(parse_model_config("{\"model_type\": \"nemotron_h\",", "cfg.json"), "cfg.json", "not valid JSON");
  EXPECT_INVALID(parse_model_config("[1]", "cfg.json"), "cfg.json", "must be a JSON object");
}

TEST(ModelConfig, WrongTypes) {
  json j = minimal();
  j["hidden_size"] = "big";
  EXPECT_INVALID(parse(j), "cfg.json", "'hidden_size'", "an integer", "\"big\"");
  j = minimal();
  j["hidden_size"] = 40.5;
  EXPECT_INVALID(parse(j), "cfg.json", "'hidden_size'", "an integer");
  j = minimal();
  j["use_conv_bias"] = 1;
  EXPECT_INVALID(parse(j), "cfg.json", "'use_conv_bias'", "a boolean");
  j = minimal();
  j["layer_norm_epsilon"] = "small";
  EXPECT_INVALID(parse(j), "cfg.json", "'layer_norm_epsilon'", "a number");
  j = minimal();
  j["hybrid_override_pattern"] = 5;
  EXPECT_INVALID(parse(j), "cfg.json", "'hybrid_override_pattern'", "a string");
}

TEST(ModelConfig, OtherModelTypes) {
  json j = minimal();
  j["model_type"] = "llama";
  EXPECT_INVALID(parse(j), "cfg.json", "model_type 'llama'", "supported: nemotron_h");
  j.erase("model_type");
  EXPECT_INVALID(parse(j), "cfg.json", "'model_type'", "nemotron_h");
}

TEST(ModelConfig, Validation) {
  const std::vector<std::pair<json, std::vector<std::string>>> cases = {
      {{{"hidden_size", 0}}, {"'hidden_size'", "positive"}},
      {{{"vocab_size", -3}}, {"'vocab_size'", "positive"}},
      {{{"mamba_num_heads", 12}, {"n_groups", 8}}, {"mamba_num_heads (12)", "n_groups (8)"}},
      {{{"num_attention_heads", 12}, {"num_key_value_heads", 8}}, {"num_attention_heads (12)", "(8)"}},
      {{{"n_routed_experts", 4}, {"num_experts_per_tok", 6}}, {"num_experts_per_tok (6)", "n_routed_experts (4)"}},
      {{{"n_routed_experts", 6}, {"n_group", 4}, {"topk_group", 1}}, {"n_routed_experts (6)", "n_group (4)"}},
      {{{"mlp_hidden_act", "gelu"}}, {"'mlp_hidden_act'", "'gelu'", "relu2"}},
      {{{"mamba_hidden_act", "relu"}}, {"'mamba_hidden_act'", "'relu'", "silu"}},
      {{{"sliding_window", 0}}, {"'sliding_window'"}},
  };
  for (const auto& [patch, pieces] : cases) {
    SCOPED_TRACE(patch.dump());
    json j = minimal();
    j.update(patch);
    try {
      parse(j);
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidInput);
      EXPECT_NE(std::string(e.what()).find("cfg.json"), std::string::npos) << e.what();
      for (const auto& p : pieces) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
    }
  }
  // More experts per token than experts is only an error when the model has MoE layers.
  json dense = minimal();
  dense["hybrid_override_pattern"] = "M*-";
  dense["n_routed_experts"] = 4;
  dense["num_experts_per_tok"] = 6;
  EXPECT_EQ(parse(dense).num_hidden_layers(), 3);
}

TEST(ModelConfig, NullMeansNotSet) {
  json j = minimal();
  j["sliding_window"] = nullptr;
  j["moe_latent_size"] = nullptr;
  j["pad_token_id"] = nullptr;
  const ModelConfig c = parse(j);
  EXPECT_FALSE(c.sliding_window.has_value());
  EXPECT_FALSE(c.moe_latent_size.has_value());
  EXPECT_EQ(c.pad_token_id, 0);
  j["sliding_window"] = 4096;
  EXPECT_EQ(parse(j).sliding_window.value_or(0), 4096);
}

// ---- load_model_config (directory) ----------------------------------------------------------------

TEST(ModelConfigLoad, ReadsConfigAndGenerationConfig) {
  TempDir dir;
  write_file(dir / "config.json", minimal().dump());
  EXPECT_EQ(load_model_config(dir.path()).eos_token_ids, std::vector<int64_t>{2});
  write_file(dir / "generation_config.json",
             R"({"bos_token_id": 5, "eos_token_id": [2, 11], "pad_token_id": 9, "temperature": 1.0})");
  const ModelConfig c = load_model_config(dir.path());
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{2, 11}));
  EXPECT_EQ(c.bos_token_id, 5);
  EXPECT_EQ(c.pad_token_id, 9);
  write_file(dir / "generation_config.json", R"({"eos_token_id": 11})");
  EXPECT_EQ(load_model_config(dir.path()).eos_token_ids, std::vector<int64_t>{11});
}

TEST(ModelConfigLoad, Errors) {
  TempDir dir;
  EXPECT_INVALID(load_model_config(dir.path()), (dir / "config.json").string(), "does not exist");
  write_file(dir / "config.json", "{oops");
  EXPECT_INVALID(load_model_config(dir.path()), (dir / "config.json").string(), "not valid JSON");
  write_file(dir / "config.json", minimal().dump());
  write_file(dir / "generation_config.json", R"({"eos_token_id": [2, "x"]})");
  EXPECT_INVALID(load_model_config(dir.path()), (dir / "generation_config.json").string(), "'eos_token_id'");
  write_file(dir / "generation_config.json", "{");
  EXPECT_INVALID(load_model_config(dir.path()), (dir / "generation_config.json").string(), "not valid JSON");
}

}  // namespace
}  // namespace chimera

// ---- hostile configs -------------------------------------------------------------------------------

namespace chimera {
namespace {

TEST(ModelConfigHostile, NumberOutsideADoubleNamesTheFile) {
  TempDir dir;
  json j = minimal();
  write_file(dir / "config.json", j.dump().substr(0, j.dump().size() - 1) + R"(, "rms_norm_eps": 1e400})");
  EXPECT_INVALID(load_model_config(dir.path()), (dir / "config.json").string(), "outside the range of a double");
}

TEST(ModelConfigHostile, DuplicatedKeyIsRejected) {
  EXPECT_INVALID(parse_model_config(R"({"model_type": "nemotron_h", "hybrid_override_pattern": "M*",
                                        "hidden_size": 64, "hidden_size": 128})",
                                    "cfg.json"),
                 "cfg.json", "key 'hidden_size' appears twice");
}

TEST(ModelConfigHostile, SizesAreBounded) {
  for (const char* field : {"hidden_size", "intermediate_size", "n_routed_experts", "mamba_num_heads", "head_dim"}) {
    json j = minimal();
    j[field] = int64_t{1} << 40;
    EXPECT_INVALID(parse(j), "cfg.json", field, "above the supported maximum");
  }
  json j = minimal();
  j["vocab_size"] = int64_t{1} << 40;
  EXPECT_INVALID(parse(j), "vocab_size", "above the supported maximum");
}

TEST(ModelConfigHostile, EosAndBosOutsideTheVocabularyAreRejected) {
  json j = minimal();
  j["vocab_size"] = 100;
  j["eos_token_id"] = 100;
  EXPECT_INVALID(parse(j), "cfg.json", "eos_token_id 100", "[0, 100)");
  j["eos_token_id"] = json::array({2, -1});
  EXPECT_INVALID(parse(j), "cfg.json", "eos_token_id");
  j["eos_token_id"] = 2;
  j["bos_token_id"] = 1000;
  EXPECT_INVALID(parse(j), "cfg.json", "bos_token_id 1000");
  j["bos_token_id"] = 1;
  ModelConfig c = parse(j);
  EXPECT_INVALID(apply_generation_config(c, R"({"eos_token_id": [2, 5000]})", "generation_config.json"),
                 "generation_config.json", "eos_token_id 5000");
}

TEST(ModelConfigHostile, GenerationConfigJsonErrorsNameTheFile) {
  TempDir dir;
  write_file(dir / "config.json", minimal().dump());
  write_file(dir / "generation_config.json", R"({"eos_token_id": 1e400})");
  EXPECT_INVALID(load_model_config(dir.path()), "generation_config.json", "outside the range of a double");
  write_file(dir / "generation_config.json", R"({"eos_token_id": 2, "eos_token_id": 3})");
  EXPECT_INVALID(load_model_config(dir.path()), "generation_config.json", "appears twice");
  write_file(dir / "generation_config.json", R"({"eos_token_id": )");
  EXPECT_INVALID(load_model_config(dir.path()), "generation_config.json", "not valid JSON");
}

TEST(ModelConfigHostile, ConfigPathThatIsADirectorySaysSo) {
  TempDir dir;
  std::filesystem::create_directories(dir / "config.json");
  EXPECT_INVALID(load_model_config(dir.path()), "config.json", "is a directory");
  std::filesystem::remove(dir / "config.json");
  EXPECT_INVALID(load_model_config(dir.path()), "config.json", "does not exist");
}

}  // namespace
}  // namespace chimera
