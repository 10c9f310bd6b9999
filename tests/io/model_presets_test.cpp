// The synthetic-model presets parse to the published shapes of docs/model.md section 9, and --num-layers keeps
// the first N layers of the pattern.
#include <gtest/gtest.h>

#include "core/error.h"
#include "io/io_test_util.h"
#include "io/model_presets.h"

namespace chimera {
namespace {

using test::layer_counts;
using test::LayerCounts;

TEST(ModelPresets, NemotronH8B) {
  const ModelConfig c = model_preset("nemotron-h-8b");
  EXPECT_EQ(c.num_hidden_layers(), 52);
  EXPECT_EQ(layer_counts(c), (LayerCounts{24, 4, 24, 0}));
  EXPECT_EQ(c.pattern(), "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-");
  EXPECT_EQ(c.hidden_size, 4096);
  EXPECT_EQ(c.vocab_size, 131072);
  EXPECT_EQ(c.num_attention_heads, 32);
  EXPECT_EQ(c.num_key_value_heads, 8);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.intermediate_size, 21504);
  EXPECT_EQ(c.mamba_num_heads, 128);
  EXPECT_EQ(c.mamba_head_dim, 64);
  EXPECT_EQ(c.ssm_state_size, 128);
  EXPECT_EQ(c.n_groups, 8);
  EXPECT_EQ(c.conv_kernel, 4);
  EXPECT_EQ(c.max_position_embeddings, 8192);
}

TEST(ModelPresets, Nemotron3Nano30B) {
  const ModelConfig c = model_preset("nemotron-3-nano-30b-a3b");
  EXPECT_EQ(c.num_hidden_layers(), 52);
  EXPECT_EQ(layer_counts(c), (LayerCounts{23, 6, 0, 23}));
  EXPECT_EQ(c.pattern(), "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME");
  EXPECT_EQ(c.hidden_size, 2688);
  EXPECT_EQ(c.num_attention_heads, 32);
  EXPECT_EQ(c.num_key_value_heads, 2);
  EXPECT_EQ(c.mamba_num_heads, 64);
  EXPECT_EQ(c.mamba_head_dim, 64);
  EXPECT_EQ(c.n_routed_experts, 128);
  EXPECT_EQ(c.num_experts_per_tok, 6);
  EXPECT_EQ(c.moe_intermediate_size, 1856);
  EXPECT_EQ(c.moe_shared_expert_intermediate_size, 3712);
  EXPECT_FALSE(c.moe_latent_size.has_value());
  EXPECT_FLOAT_EQ(c.routed_scaling_factor, 2.5f);
  EXPECT_EQ(c.max_position_embeddings, 262144);
}

TEST(ModelPresets, Nemotron3Super120B) {
  const ModelConfig c = model_preset("nemotron-3-super-120b-a12b");
  EXPECT_EQ(c.num_hidden_layers(), 88);
  EXPECT_EQ(layer_counts(c), (LayerCounts{40, 8, 0, 40}));
  EXPECT_EQ(c.hidden_size, 4096);
  EXPECT_EQ(c.num_key_value_heads, 2);
  EXPECT_EQ(c.mamba_num_heads, 128);
  EXPECT_EQ(c.n_routed_experts, 512);
  EXPECT_EQ(c.num_experts_per_tok, 22);
  EXPECT_EQ(c.moe_intermediate_size, 2688);
  EXPECT_EQ(c.moe_shared_expert_intermediate_size, 5376);
  ASSERT_TRUE(c.moe_latent_size.has_value());
  EXPECT_EQ(*c.moe_latent_size, 1024);
  EXPECT_FLOAT_EQ(c.routed_scaling_factor, 5.0f);
  EXPECT_EQ(c.num_nextn_predict_layers, 1);
  ASSERT_EQ(c.mtp_layers.size(), 2u);
  EXPECT_EQ(c.mtp_layers[0], LayerKind::kAttention);
  EXPECT_EQ(c.mtp_layers[1], LayerKind::kMoe);
}

TEST(ModelPresets, TinyHasEveryLayerKind) {
  const ModelConfig c = model_preset("tiny");
  const LayerCounts k = layer_counts(c);
  EXPECT_GT(k.mamba, 0);
  EXPECT_GT(k.attention, 0);
  EXPECT_GT(k.mlp, 0);
  EXPECT_GT(k.moe, 0);
  EXPECT_TRUE(c.moe_latent_size.has_value());
}

TEST(ModelPresets, UnknownPresetListsThePresets) {
  try {
    model_preset("nemotron-9000");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidInput);
    const std::string m = e.what();
    EXPECT_NE(m.find("nemotron-9000"), std::string::npos) << m;
    EXPECT_NE(m.find("nemotron-3-super-120b-a12b"), std::string::npos) << m;
    EXPECT_NE(m.find("tiny"), std::string::npos) << m;
  }
}

TEST(ModelPresets, NumLayersKeepsThePrefixOfThePattern) {
  ModelConfig c = model_preset("nemotron-3-super-120b-a12b");
  const std::string full = c.pattern();
  truncate_layers(c, 9);
  EXPECT_EQ(c.num_hidden_layers(), 9);
  EXPECT_EQ(c.pattern(), full.substr(0, 9));
  EXPECT_EQ(c.pattern(), "MEMEMEM*E");
  EXPECT_EQ(c.num_nextn_predict_layers, 1);  // the MTP head stays, behind the last kept layer
  EXPECT_EQ(c.mtp_layers.size(), 2u);
  EXPECT_EQ(c.hidden_size, 4096);  // everything else is kept

  ModelConfig t = model_preset("tiny");
  EXPECT_THROW(truncate_layers(t, 0), Error);
  EXPECT_THROW(truncate_layers(t, t.num_hidden_layers() + 1), Error);
  truncate_layers(t, t.num_hidden_layers());
  EXPECT_EQ(t.num_hidden_layers(), 8);
}

}  // namespace
}  // namespace chimera
