// The caches' scratch part for CUDA-graph pad rows (CacheSizes::num_pad): slots and blocks past the sequences'
// part, never handed out, zero from the start, and not counted in the load figures.
#include "runtime/state_cache.h"

#include <gtest/gtest.h>

#include <algorithm>

#include "common/compare.h"
#include "core/error.h"

namespace chimera {
namespace {

ModelConfig tiny() { return load_model_config(test::source_path("models/nemotron-h-tiny")); }

TEST(StateCache, PadScratchLiesPastTheSequencesSlotsAndBlocks) {
  const ModelConfig c = tiny();
  StateCache cache(c, CacheSizes{.max_seqs = 3, .max_model_len = 32, .block_size = 8, .num_blocks = 6, .num_pad = 2});
  EXPECT_EQ(cache.sizes().max_seqs, 3);
  EXPECT_EQ(cache.sizes().num_blocks, 6);
  EXPECT_EQ(cache.free_slots(), 3);
  EXPECT_EQ(cache.free_blocks(), 6);
  EXPECT_EQ(cache.pad_slot(0), 3);
  EXPECT_EQ(cache.pad_slot(1), 4);
  EXPECT_EQ(cache.pad_block(0), 6);
  EXPECT_EQ(cache.pad_block(1), 7);
  EXPECT_THROW(cache.pad_slot(2), Error);
  EXPECT_THROW(cache.pad_block(-1), Error);

  // The tensors hold the scratch too, zeroed.
  size_t mamba_layers = 0;
  for (size_t i = 0; i < c.layers.size(); ++i) {
    const ModelState& st = cache.state();
    if (c.layers[i] == LayerKind::kMamba) {
      ++mamba_layers;
      ASSERT_EQ(st.conv[i].dim(0), 5);
      ASSERT_EQ(st.ssm[i].dim(0), 5);
      for (int32_t s : {3, 4}) {
        const Tensor ssm = st.ssm[i].select(s);
        EXPECT_TRUE(std::all_of(ssm.f32(), ssm.f32() + ssm.numel(), [](float v) { return v == 0.0f; }));
        const Tensor conv = st.conv[i].select(s);
        EXPECT_TRUE(std::all_of(conv.f32(), conv.f32() + conv.numel(), [](float v) { return v == 0.0f; }));
      }
    } else if (c.layers[i] == LayerKind::kAttention) {
      ASSERT_EQ(st.kv[i].k.dim(0), 8);
      ASSERT_EQ(st.kv[i].v.dim(0), 8);
    }
  }
  EXPECT_GT(mamba_layers, 0u);

  // Every slot and block the sequences can take is one of theirs, never a pad's.
  std::vector<int32_t> slots;
  for (int32_t s = cache.allocate_slot(); s >= 0; s = cache.allocate_slot()) slots.push_back(s);
  std::sort(slots.begin(), slots.end());
  EXPECT_EQ(slots, (std::vector<int32_t>{0, 1, 2}));
  std::vector<int32_t> blocks;
  ASSERT_TRUE(cache.reserve_blocks(blocks, 32));
  std::vector<int32_t> more;
  ASSERT_TRUE(cache.reserve_blocks(more, 16));
  EXPECT_FALSE(cache.reserve_blocks(more, 24));  // the 6 sequence blocks are taken; the 2 scratch ones are not free
  blocks.insert(blocks.end(), more.begin(), more.end());
  EXPECT_TRUE(std::all_of(blocks.begin(), blocks.end(), [](int32_t b) { return b >= 0 && b < 6; }));
  EXPECT_THROW(cache.release_slot(cache.pad_slot(0)), Error);  // scratch is never released
}

TEST(StateCache, NoPadScratchByDefault) {
  const StateCache cache(tiny(), CacheSizes{.max_seqs = 2, .max_model_len = 16, .block_size = 4});
  EXPECT_EQ(cache.sizes().num_pad, 0);
  EXPECT_THROW(cache.pad_slot(0), Error);
}

}  // namespace
}  // namespace chimera
