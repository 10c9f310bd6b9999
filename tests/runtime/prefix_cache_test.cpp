// Prefix caching's bookkeeping (runtime/prefix_cache.h) without a model: the block hash chain, the reference-counted
// block pool with LRU eviction of published blocks, and the Mamba checkpoint pool.
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"
#include "runtime/prefix_cache.h"

namespace chimera {
namespace {

using V = std::vector<int32_t>;

std::vector<uint64_t> chain(const V& tokens, int32_t bs) {
  std::vector<uint64_t> h;
  for (size_t i = 0; (i + 1) * static_cast<size_t>(bs) <= tokens.size(); ++i) {
    h.push_back(block_hash(i == 0 ? kRootHash : h.back(), std::span<const int32_t>(tokens).subspan(
                                                              i * static_cast<size_t>(bs), static_cast<size_t>(bs))));
  }
  return h;
}

TEST(BlockHash, DependsOnTheWholePrefix) {
  const V a{1, 2, 3, 4, 5, 6, 7, 8}, b{9, 2, 3, 4, 5, 6, 7, 8};
  const auto ha = chain(a, 4), hb = chain(b, 4);
  ASSERT_EQ(ha.size(), 2u);
  EXPECT_NE(ha[0], hb[0]);
  EXPECT_NE(ha[1], hb[1]);  // same second block's tokens, different parent
  EXPECT_EQ(ha, chain(a, 4));
  EXPECT_NE(block_hash(kRootHash, V{0}), block_hash(kRootHash, V{0, 0}));
}

TEST(BlockPool, WithoutCachingItIsAFreeList) {
  BlockPool pool(4, 2, /*caching=*/false);
  V got;
  ASSERT_TRUE(pool.take(3, got));
  EXPECT_EQ(got, (V{0, 1, 2}));
  EXPECT_FALSE(pool.take(2, got));  // nothing taken when short
  EXPECT_EQ(got.size(), 3u);
  pool.publish(0, 42, V{1, 2});  // a no-op
  EXPECT_EQ(pool.num_published(), 0);
  pool.release(got);
  EXPECT_EQ(pool.num_free(), 4);
}

TEST(BlockPool, PublishedBlocksAreSharedAndKeptAfterRelease) {
  const int32_t bs = 2;
  BlockPool pool(6, bs, true);
  const V tokens{1, 2, 3, 4, 5};
  const auto h = chain(tokens, bs);
  V a;
  ASSERT_TRUE(pool.take(3, a));
  pool.publish(a[0], h[0], V{1, 2});
  pool.publish(a[1], h[1], V{3, 4});
  EXPECT_EQ(pool.match(h, tokens), (V{a[0], a[1]}));
  // A second sequence shares them while the first still holds them.
  V b = pool.match(h, tokens);
  pool.acquire(b);
  EXPECT_EQ(pool.ref_count(a[0]), 2);
  pool.release(a);  // block a[2] (unpublished) is free again, the published ones still held by b
  EXPECT_EQ(pool.num_evictable(), 0);
  EXPECT_EQ(pool.num_free(), 4);
  pool.release(b);
  EXPECT_EQ(pool.num_evictable(), 2);
  EXPECT_EQ(pool.num_free(), 6);
  // Still found after everyone let go; a different token in the second block stops the match there.
  EXPECT_EQ(pool.match(h, tokens).size(), 2u);
  const V other{1, 2, 3, 9};
  EXPECT_EQ(pool.match(chain(other, bs), other), (V{a[0]}));
  // A hash whose stored tokens differ (a collision) does not match.
  EXPECT_TRUE(pool.match(std::vector<uint64_t>{h[0]}, V{7, 7}).empty());
}

TEST(BlockPool, EvictsNeverPublishedFirstThenLeastRecentlyReleasedTailFirst) {
  const int32_t bs = 1;
  BlockPool pool(4, bs, true);
  V a;
  ASSERT_TRUE(pool.take(2, a));  // blocks 0, 1
  pool.publish(a[0], 100, V{7});
  pool.publish(a[1], 101, V{8});
  pool.release(a);  // released last block first: 1 is older in the LRU than 0
  V b;
  ASSERT_TRUE(pool.take(2, b));  // the two never-published blocks first
  EXPECT_EQ(b, (V{2, 3}));
  EXPECT_EQ(pool.num_published(), 2);
  V c;
  ASSERT_TRUE(pool.take(1, c));  // now an eviction: the prefix's tail (block 1) goes first
  EXPECT_EQ(c, (V{1}));
  EXPECT_EQ(pool.num_published(), 1);
  EXPECT_EQ(pool.match(std::vector<uint64_t>{100, 101}, V{7, 8}), (V{0}));
  // A re-acquired block leaves the evictable list: taking one more fails.
  V d = pool.match(std::vector<uint64_t>{100}, V{7});
  pool.acquire(d);
  V e;
  EXPECT_FALSE(pool.take(1, e));
}

TEST(BlockPool, FirstPublisherKeepsTheHash) {
  BlockPool pool(2, 1, true);
  V a;
  ASSERT_TRUE(pool.take(2, a));
  pool.publish(a[0], 5, V{1});
  pool.publish(a[1], 5, V{1});  // the same prefix computed twice: the second stays private
  EXPECT_EQ(pool.num_published(), 1);
  pool.release(a);
  EXPECT_EQ(pool.num_evictable(), 1);
  EXPECT_EQ(pool.num_free(), 2);
}

TEST(BlockPool, MisuseIsCaught) {
  BlockPool pool(2, 1, true);
  V a;
  ASSERT_TRUE(pool.take(1, a));
  pool.release(a);
  EXPECT_THROW(pool.release(a), Error);              // released twice
  EXPECT_THROW(pool.publish(a[0], 1, V{1}), Error);  // nobody holds it
  EXPECT_THROW(pool.acquire(a), Error);              // not published
}

TEST(CheckpointPool, LeastRecentlyUsedIsEvicted) {
  CheckpointPool pool({10, 11});
  EXPECT_EQ(pool.capacity(), 2);
  EXPECT_EQ(pool.insert(1), 10);
  EXPECT_EQ(pool.insert(2), 11);
  EXPECT_EQ(pool.insert(2), std::nullopt);  // saved already
  EXPECT_EQ(pool.find(1), 10);              // 1 is now the most recently used
  EXPECT_EQ(pool.insert(3), 11);            // evicts 2
  EXPECT_FALSE(pool.contains(2));
  EXPECT_EQ(pool.find(2), std::nullopt);
  EXPECT_EQ(pool.size(), 2);
  EXPECT_EQ(CheckpointPool({}).insert(1), std::nullopt);
}

}  // namespace
}  // namespace chimera
