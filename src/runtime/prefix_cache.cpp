#include "runtime/prefix_cache.h"

#include <algorithm>

#include "core/error.h"

namespace chimera {
namespace {

// splitmix64's finaliser: every input bit reaches every output bit.
uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

uint64_t block_hash(uint64_t parent, std::span<const int32_t> tokens) {
  uint64_t h = mix(parent ^ (static_cast<uint64_t>(tokens.size()) << 32));
  for (int32_t t : tokens) h = mix(h ^ static_cast<uint32_t>(t));
  return h;
}

BlockPool::BlockPool(int32_t num_blocks, int32_t block_size, bool caching)
    : block_size_(block_size),
      caching_(caching),
      refs_(static_cast<size_t>(num_blocks), 0),
      meta_(static_cast<size_t>(num_blocks)) {
  if (caching_) tokens_.resize(static_cast<size_t>(num_blocks) * static_cast<size_t>(block_size));
  for (int32_t b = num_blocks - 1; b >= 0; --b) free_.push_back(b);
}

bool BlockPool::take(int32_t n, std::vector<int32_t>& out) {
  if (n <= 0) return true;
  if (n > num_free()) return false;
  for (int32_t i = 0; i < n; ++i) {
    int32_t b;
    if (!free_.empty()) {
      b = free_.back();
      free_.pop_back();
    } else {
      b = evictable_.front();
      unpublish(b);  // takes it off the evictable list too
    }
    refs_[static_cast<size_t>(b)] = 1;
    out.push_back(b);
  }
  return true;
}

void BlockPool::release(std::span<const int32_t> blocks) {
  for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) {
    const int32_t b = *it;
    int32_t& r = refs_[static_cast<size_t>(b)];
    CHIMERA_CHECK(r > 0, "KV block {} released more often than taken", b);
    if (--r > 0) continue;
    Published& m = meta_[static_cast<size_t>(b)];
    if (m.published) {
      m.lru = evictable_.insert(evictable_.end(), b);
      m.evictable = true;
    } else {
      free_.push_back(b);
    }
  }
}

void BlockPool::acquire(std::span<const int32_t> blocks) {
  for (int32_t b : blocks) {
    Published& m = meta_[static_cast<size_t>(b)];
    CHIMERA_CHECK(m.published, "KV block {} is not published: nothing to share", b);
    if (m.evictable) {
      evictable_.erase(m.lru);
      m.evictable = false;
    }
    ++refs_[static_cast<size_t>(b)];
  }
}

void BlockPool::unpublish(int32_t b) {
  Published& m = meta_[static_cast<size_t>(b)];
  if (!m.published) return;
  by_hash_.erase(m.hash);
  if (m.evictable) evictable_.erase(m.lru);
  m = Published{};
}

void BlockPool::publish(int32_t block, uint64_t hash, std::span<const int32_t> tokens) {
  if (!caching_) return;
  CHIMERA_CHECK(static_cast<int32_t>(tokens.size()) == block_size_, "publishing {} tokens in a block of {}",
                tokens.size(), block_size_);
  CHIMERA_CHECK(refs_[static_cast<size_t>(block)] > 0, "publishing KV block {}, which nobody holds", block);
  Published& m = meta_[static_cast<size_t>(block)];
  if (m.published || by_hash_.count(hash) != 0) return;
  m.hash = hash;
  m.published = true;
  by_hash_.emplace(hash, block);
  std::copy(tokens.begin(), tokens.end(), tokens_.begin() + static_cast<ptrdiff_t>(block) * block_size_);
}

std::vector<int32_t> BlockPool::match(std::span<const uint64_t> hashes, std::span<const int32_t> tokens) const {
  std::vector<int32_t> out;
  if (!caching_) return out;
  const auto bs = static_cast<size_t>(block_size_);
  for (size_t i = 0; i < hashes.size() && (i + 1) * bs <= tokens.size(); ++i) {
    auto it = by_hash_.find(hashes[i]);
    if (it == by_hash_.end()) break;
    const int32_t b = it->second;
    const auto stored = tokens_.begin() + static_cast<ptrdiff_t>(b) * block_size_;
    if (!std::equal(stored, stored + block_size_, tokens.begin() + static_cast<ptrdiff_t>(i * bs))) break;
    out.push_back(b);
  }
  return out;
}

CheckpointPool::CheckpointPool(std::vector<int32_t> slots) : slots_(std::move(slots)) {
  free_.assign(slots_.rbegin(), slots_.rend());
}

std::optional<int32_t> CheckpointPool::find(uint64_t hash) {
  auto it = by_hash_.find(hash);
  if (it == by_hash_.end()) return std::nullopt;
  lru_.splice(lru_.end(), lru_, it->second.lru);
  return it->second.slot;
}

std::optional<int32_t> CheckpointPool::insert(uint64_t hash) {
  if (slots_.empty() || by_hash_.count(hash) != 0) return std::nullopt;
  int32_t slot;
  if (!free_.empty()) {
    slot = free_.back();
    free_.pop_back();
  } else {
    const uint64_t oldest = lru_.front();
    lru_.pop_front();
    slot = by_hash_.at(oldest).slot;
    by_hash_.erase(oldest);
  }
  by_hash_.emplace(hash, Entry{slot, lru_.insert(lru_.end(), hash)});
  return slot;
}

}  // namespace chimera
