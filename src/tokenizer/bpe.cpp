#include "tokenizer/bpe.h"

#include <queue>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace chimera::tok {

using nlohmann::json;

namespace {

std::optional<std::string> optional_string(const json& j, const char* key, const std::string& source) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::nullopt;
  if (!it->is_string()) invalid_input("{}: field model.{} must be a string or null", source, key);
  return it->get<std::string>();
}

bool optional_bool(const json& j, const char* key, const std::string& source) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return false;
  if (!it->is_boolean()) invalid_input("{}: field model.{} must be a boolean", source, key);
  return it->get<bool>();
}

}  // namespace

Bpe::Bpe(const json& model, const std::string& source) {
  if (auto it = model.find("dropout"); it != model.end() && !it->is_null()) {
    invalid_input("{}: field model.dropout must be null (BPE dropout is a training-time feature)", source);
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    auto v = optional_string(model, key, source);
    if (v && !v->empty()) {
      invalid_input("{}: field model.{} = '{}' is not supported (byte-level BPE uses none)", source, key, *v);
    }
  }
  fuse_unk_ = optional_bool(model, "fuse_unk", source);
  byte_fallback_ = optional_bool(model, "byte_fallback", source);
  ignore_merges_ = optional_bool(model, "ignore_merges", source);

  auto vit = model.find("vocab");
  if (vit == model.end() || !vit->is_object()) invalid_input("{}: field model.vocab must be an object", source);
  vocab_.reserve(vit->size());
  int64_t max_id = -1;
  for (const auto& [token, id] : vit->items()) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX) {
      invalid_input("{}: field model.vocab['{}'] must be a non-negative 32-bit integer id", source, token);
    }
    vocab_.emplace(token, static_cast<int32_t>(id.get<int64_t>()));
    max_id = std::max(max_id, id.get<int64_t>());
  }
  // The id table is dense (max_id + 1 slots): a single large id would allocate for every id below it, so ids
  // may leave at most kMaxIdHoles unused slots beyond the entries the file defines.
  if (max_id >= static_cast<int64_t>(vit->size()) + kMaxIdHoles) {
    invalid_input("{}: field model.vocab has {} entries but an id of {}: ids may exceed the entry count by at most {}",
                  source, vit->size(), max_id, kMaxIdHoles);
  }
  id_to_token_.assign(static_cast<size_t>(max_id + 1), std::string());
  has_id_.assign(static_cast<size_t>(max_id + 1), false);
  for (const auto& [token, id] : vocab_) {
    id_to_token_[static_cast<size_t>(id)] = token;
    has_id_[static_cast<size_t>(id)] = true;
  }

  if (auto unk = optional_string(model, "unk_token", source)) {
    auto it = vocab_.find(*unk);
    if (it == vocab_.end()) invalid_input("{}: field model.unk_token '{}' is not in model.vocab", source, *unk);
    unk_id_ = it->second;
  }
  for (int b = 0; b < 256; ++b) {
    auto it = vocab_.find(fmt::format("<0x{:02X}>", b));
    byte_fallback_ids_[static_cast<size_t>(b)] = it == vocab_.end() ? -1 : it->second;
  }

  auto mit = model.find("merges");
  if (mit == model.end() || !mit->is_array()) invalid_input("{}: field model.merges must be an array", source);
  merges_.reserve(mit->size());
  int32_t rank = 0;
  for (const auto& m : *mit) {
    std::string a, b;
    if (m.is_string()) {  // legacy "a b"
      const std::string s = m.get<std::string>();
      const size_t sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos) {
        invalid_input("{}: field model.merges[{}] = '{}' must be two tokens separated by one space", source, rank,
                      s);
      }
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      a = m[0].get<std::string>();
      b = m[1].get<std::string>();
    } else {
      invalid_input("{}: field model.merges[{}] must be \"a b\" or [\"a\", \"b\"]", source, rank);
    }
    auto ia = vocab_.find(a), ib = vocab_.find(b), iab = vocab_.find(a + b);
    for (auto [it, tok] : {std::pair{ia, &a}, std::pair{ib, &b}}) {
      if (it == vocab_.end()) {
        invalid_input("{}: field model.merges[{}] references token '{}' that is not in model.vocab", source, rank,
                      *tok);
      }
    }
    if (iab == vocab_.end()) {
      invalid_input("{}: field model.merges[{}] produces token '{}' that is not in model.vocab", source, rank,
                    a + b);
    }
    merges_[pair_key(ia->second, ib->second)] = Merge{rank, iab->second};  // a repeated pair: last one wins, as HF
    ++rank;
  }
}

Bpe::Bpe(Bpe&& o) noexcept
    : vocab_(std::move(o.vocab_)),
      id_to_token_(std::move(o.id_to_token_)),
      has_id_(std::move(o.has_id_)),
      merges_(std::move(o.merges_)),
      unk_id_(o.unk_id_),
      fuse_unk_(o.fuse_unk_),
      byte_fallback_(o.byte_fallback_),
      ignore_merges_(o.ignore_merges_),
      byte_fallback_ids_(o.byte_fallback_ids_),
      cache_(std::move(o.cache_)) {}

std::optional<int32_t> Bpe::token_to_id(std::string_view token) const {
  auto it = vocab_.find(token);
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

const std::string* Bpe::id_to_token(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= id_to_token_.size() || !has_id_[static_cast<size_t>(id)]) return nullptr;
  return &id_to_token_[static_cast<size_t>(id)];
}

void Bpe::tokenize(std::string_view piece, std::vector<int32_t>& out) const {
  if (piece.empty()) return;
  if (ignore_merges_) {
    if (auto it = vocab_.find(piece); it != vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  const bool cacheable = piece.size() <= kCacheMaxPieceBytes;
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mu_);
    if (auto it = cache_.find(piece); it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<int32_t> ids;
  merge_word(piece, ids);
  out.insert(out.end(), ids.begin(), ids.end());
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mu_);
    if (cache_.size() >= kCacheCapacity) cache_.clear();
    cache_.emplace(std::string(piece), std::move(ids));
  }
}

void Bpe::merge_word(std::string_view piece, std::vector<int32_t>& out) const {
  struct Symbol {
    int32_t id;
    int32_t prev;
    int32_t next;
    bool removed;
  };
  std::vector<Symbol> sym;
  sym.reserve(piece.size());
  auto add = [&](int32_t id) {
    const auto n = static_cast<int32_t>(sym.size());
    if (n > 0) sym.back().next = n;
    sym.push_back(Symbol{id, n - 1, -1, false});
  };

  // Initial symbols: one per character; unknown characters go through byte_fallback, then unk (fused when
  // fuse_unk), and are dropped when the model has no unk token (HF does the same).
  bool pending_unk = false;
  size_t i = 0;
  while (i < piece.size()) {
    size_t n = 1;
    while (i + n < piece.size() && (static_cast<unsigned char>(piece[i + n]) & 0xC0) == 0x80) ++n;
    const std::string_view ch = piece.substr(i, n);
    i += n;
    if (auto it = vocab_.find(ch); it != vocab_.end()) {
      if (pending_unk) add(*unk_id_);
      pending_unk = false;
      add(it->second);
      continue;
    }
    if (byte_fallback_) {
      bool all = true;
      for (char c : ch) all = all && byte_fallback_ids_[static_cast<unsigned char>(c)] >= 0;
      if (all) {
        for (char c : ch) add(byte_fallback_ids_[static_cast<unsigned char>(c)]);
        continue;
      }
    }
    if (unk_id_) {
      if (pending_unk && !fuse_unk_) add(*unk_id_);
      pending_unk = true;
    }
  }
  if (pending_unk) add(*unk_id_);

  struct Entry {
    int32_t rank;
    int32_t pos;
    int32_t new_id;
    bool operator>(const Entry& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> queue;
  for (size_t k = 0; k + 1 < sym.size(); ++k) {
    if (auto it = merges_.find(pair_key(sym[k].id, sym[k + 1].id)); it != merges_.end()) {
      queue.push(Entry{it->second.rank, static_cast<int32_t>(k), it->second.new_id});
    }
  }
  while (!queue.empty()) {
    const Entry top = queue.top();
    queue.pop();
    Symbol& cur = sym[static_cast<size_t>(top.pos)];
    if (cur.removed || cur.next < 0) continue;
    const int32_t right_pos = cur.next;
    Symbol& right = sym[static_cast<size_t>(right_pos)];
    auto it = merges_.find(pair_key(cur.id, right.id));
    if (it == merges_.end() || it->second.new_id != top.new_id) continue;  // stale entry
    cur.id = top.new_id;
    cur.next = right.next;
    right.removed = true;
    if (cur.next >= 0) sym[static_cast<size_t>(cur.next)].prev = top.pos;
    if (cur.prev >= 0) {
      if (auto m = merges_.find(pair_key(sym[static_cast<size_t>(cur.prev)].id, cur.id)); m != merges_.end()) {
        queue.push(Entry{m->second.rank, cur.prev, m->second.new_id});
      }
    }
    if (cur.next >= 0) {
      if (auto m = merges_.find(pair_key(cur.id, sym[static_cast<size_t>(cur.next)].id)); m != merges_.end()) {
        queue.push(Entry{m->second.rank, top.pos, m->second.new_id});
      }
    }
  }
  for (const Symbol& s : sym) {
    if (!s.removed) out.push_back(s.id);
  }
}

}  // namespace chimera::tok
