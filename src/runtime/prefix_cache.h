// Prefix caching for hybrid models (docs/architecture.md "Prefix caching"): the bookkeeping, no tensors.
//
// KV blocks. A full block of a sequence is named by a hash chain over token ids, as vLLM names it:
//   hash(block i) = mix(hash(block i - 1), tokens of block i),  hash(block -1) = a fixed seed
// so equal hashes mean equal prefixes up to and including the block (the block's own tokens are compared too,
// which leaves only a 64-bit collision of the parents, never seen in practice). Once a block's tokens are all
// computed, the scheduler publishes it under its hash. Blocks are reference counted: a new request whose prompt
// starts with published blocks takes references to them instead of computing them again (several running
// sequences may share one). A published block no sequence holds stays where it is, evictable: the pool hands out
// never-published free blocks first, then evicts the least recently released published one (a sequence's blocks
// are released last block first, so a prefix's tail goes before its head).
//
// Mamba checkpoints. The Mamba layers' state after a prefix is one tensor per layer that the recurrence overwrote,
// so the KV blocks alone cannot restore it. A checkpoint is a copy of a sequence's Mamba state (every layer's
// conv window and SSM state) after the first p tokens, p a multiple of the checkpoint interval, kept in a Mamba
// slot of a pool of its own (CacheSizes::checkpoint_slots) under the hash of the block ending at p, LRU-evicted.
// A request restores the longest prefix for which both the KV blocks and a checkpoint exist.
#pragma once

#include <cstdint>
#include <list>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

namespace chimera {

// The chain hash of a block holding `tokens`, after the block whose hash is `parent` (kRootHash for the first).
inline constexpr uint64_t kRootHash = 0x9e3779b97f4a7c15ull;
uint64_t block_hash(uint64_t parent, std::span<const int32_t> tokens);

// The paged KV pool's block ids [0, num_blocks): free, held by sequences (reference counted), or published and
// held by nobody (evictable).
class BlockPool {
 public:
  // caching = false: nothing is ever published, and the pool is a plain free list.
  BlockPool(int32_t num_blocks, int32_t block_size, bool caching);

  int32_t block_size() const { return block_size_; }
  bool caching() const { return caching_; }
  // Blocks a take() can hand out: free ones and evictable published ones.
  int32_t num_free() const { return static_cast<int32_t>(free_.size() + evictable_.size()); }
  // Published blocks (held or not) and those of them nobody holds.
  int32_t num_published() const { return static_cast<int32_t>(by_hash_.size()); }
  int32_t num_evictable() const { return static_cast<int32_t>(evictable_.size()); }

  // Appends n fresh blocks (one reference each) to `out`: never-published ones first (lowest ids first), then the
  // least recently released published ones, unpublished as they go. False, and nothing taken, when short.
  bool take(int32_t n, std::vector<int32_t>& out);
  // Drops one reference to each block, last block first; a block nobody holds becomes evictable if published,
  // free otherwise.
  void release(std::span<const int32_t> blocks);
  // One more reference to each (published) block, taking it off the evictable list.
  void acquire(std::span<const int32_t> blocks);
  int32_t ref_count(int32_t block) const { return refs_[static_cast<size_t>(block)]; }

  // Publishes a held block whose block_size tokens are computed, under their chain hash. A hash already published
  // (another sequence computed the same prefix) keeps its block; this one stays private. No-op without caching.
  void publish(int32_t block, uint64_t hash, std::span<const int32_t> tokens);
  // The published blocks of the longest prefix of `hashes` whose blocks hold exactly the matching block_size slices
  // of `tokens` (hashes[i] covers tokens [i * block_size, (i + 1) * block_size)). No references taken.
  std::vector<int32_t> match(std::span<const uint64_t> hashes, std::span<const int32_t> tokens) const;

 private:
  struct Published {
    uint64_t hash = 0;
    bool published = false;
    std::list<int32_t>::iterator lru;  // in evictable_ while nobody holds it
    bool evictable = false;
  };
  void unpublish(int32_t block);

  int32_t block_size_;
  bool caching_;
  std::vector<int32_t> free_;  // a stack: lowest ids handed out first
  std::vector<int32_t> refs_;
  std::vector<Published> meta_;
  std::vector<int32_t> tokens_;  // [num_blocks, block_size]: a published block's tokens
  std::unordered_map<uint64_t, int32_t> by_hash_;
  std::list<int32_t> evictable_;  // least recently released first
};

// Mamba checkpoints: slot ids of the checkpoint pool, keyed by the hash of the block a checkpoint ends at.
class CheckpointPool {
 public:
  explicit CheckpointPool(std::vector<int32_t> slots);

  int32_t capacity() const { return static_cast<int32_t>(slots_.size()); }
  int32_t size() const { return static_cast<int32_t>(by_hash_.size()); }
  bool contains(uint64_t hash) const { return by_hash_.count(hash) != 0; }
  // The checkpoint's slot, marked most recently used; nullopt when there is none.
  std::optional<int32_t> find(uint64_t hash);
  // A slot to save the checkpoint of `hash` into: a free one, else the least recently used checkpoint's (which is
  // forgotten). nullopt when the hash is saved already or the pool has no slots.
  std::optional<int32_t> insert(uint64_t hash);

 private:
  struct Entry {
    int32_t slot;
    std::list<uint64_t>::iterator lru;
  };
  std::vector<int32_t> slots_;
  std::vector<int32_t> free_;
  std::unordered_map<uint64_t, Entry> by_hash_;
  std::list<uint64_t> lru_;  // least recently used first
};

// Token counts a prefix cache reports (vLLM's prefix_cache_queries / prefix_cache_hits): every admission of a
// sequence queries its tokens, and hits the ones it restores.
struct PrefixCacheStats {
  int64_t queries = 0;            // tokens looked up
  int64_t hits = 0;               // tokens restored
  int64_t restores = 0;           // admissions that restored a prefix
  int64_t checkpoints_saved = 0;  // Mamba checkpoints written
};

}  // namespace chimera
