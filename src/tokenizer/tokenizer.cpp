// Tokenizer: loads tokenizer.json and runs HF tokenizers' encode pipeline:
//   1. split out added tokens matched on the raw text (normalized=false), leftmost-longest
//   2. normalize each remaining piece, then split out added tokens matched on normalized text
//   3. pre-tokenize each remaining piece; 4. BPE each word; 5. post-process (add_special_tokens)
// and its decode: ids -> token strings (added content or vocab) -> decoder chain -> concatenation.
#include "tokenizer/tokenizer.h"

#include <algorithm>
#include <fstream>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/json_file.h"
#include "tokenizer/bpe.h"
#include "tokenizer/pipeline.h"
#include "tokenizer/regex.h"
#include "tokenizer/unicode.h"

namespace chimera {

using nlohmann::json;
using tok::Where;

namespace {

struct AddedToken {
  int32_t id;
  std::string content;
  bool special, lstrip, rstrip, normalized, single_word;
};

// Rust regex \w (used by HF for single_word): Alphabetic, Mark, Decimal_Number, Connector_Punctuation,
// Join_Control.
const tok::Regex& word_char_regex() {
  static const tok::Regex re(R"([\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\x{200C}\x{200D}])", "word-character class",
                             /*oniguruma=*/false);
  return re;
}

bool ends_with_word(std::string_view s) {
  if (s.empty()) return false;
  size_t start = s.size() - 1;
  while (start > 0 && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
  return word_char_regex().matches_at(s, start);
}

bool starts_with_word(std::string_view s) { return !s.empty() && word_char_regex().matches_at(s, 0); }

// Start of the trailing run of White_Space characters in s.
size_t trailing_space_start(std::string_view s) {
  size_t e = s.size();
  while (e > 0) {
    size_t start = e - 1;
    while (start > 0 && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
    size_t n;
    if (!tok::is_white_space(tok::decode_utf8(s, start, &n))) break;
    e = start;
  }
  return e;
}

size_t leading_space_len(std::string_view s) {
  size_t b = 0;
  while (b < s.size()) {
    size_t n;
    if (!tok::is_white_space(tok::decode_utf8(s, b, &n))) break;
    b += n;
  }
  return b;
}

// Leftmost-longest, non-overlapping matching of added-token patterns (HF uses Aho-Corasick with
// MatchKind::LeftmostLongest); candidates are bucketed by first byte and tried longest first.
class AddedMatcher {
 public:
  void add(std::string pattern, const AddedToken* token) {
    if (pattern.empty()) return;
    auto& bucket = by_first_[static_cast<unsigned char>(pattern[0])];
    bucket.push_back({std::move(pattern), token});
    std::stable_sort(bucket.begin(), bucket.end(),
                     [](const Entry& a, const Entry& b) { return a.pattern.size() > b.pattern.size(); });
    empty_ = false;
  }

  struct Segment {
    size_t begin, end;
    const AddedToken* token;  // nullptr: plain text
  };

  // HF AddedVocabulary::find_matches: segments covering s, with single_word / lstrip / rstrip applied.
  std::vector<Segment> split(std::string_view s) const {
    std::vector<Segment> out;
    if (empty_) {
      out.push_back({0, s.size(), nullptr});
      return out;
    }
    size_t start_offset = 0;
    size_t i = 0;
    while (i < s.size()) {
      const Entry* hit = nullptr;
      for (const Entry& e : by_first_[static_cast<unsigned char>(s[i])]) {
        if (s.compare(i, e.pattern.size(), e.pattern) == 0) {
          hit = &e;
          break;
        }
      }
      if (hit == nullptr) {
        ++i;
        continue;
      }
      size_t start = i, stop = i + hit->pattern.size();
      i = stop;  // the automaton resumes after the match even when single_word discards it
      const AddedToken& t = *hit->token;
      if (t.single_word) {
        const bool start_space = start == 0 || !ends_with_word(s.substr(0, start));
        const bool stop_space = stop == s.size() || !starts_with_word(s.substr(stop));
        if (!start_space || !stop_space) continue;
      }
      if (t.lstrip) start = std::max(trailing_space_start(s.substr(0, start)), start_offset);
      if (t.rstrip) stop += leading_space_len(s.substr(stop));
      if (start_offset < start) out.push_back({start_offset, start, nullptr});
      out.push_back({start, stop, &t});
      start_offset = stop;
    }
    if (start_offset < s.size()) out.push_back({start_offset, s.size(), nullptr});
    return out;
  }

 private:
  struct Entry {
    std::string pattern;
    const AddedToken* token;
  };
  std::array<std::vector<Entry>, 256> by_first_;
  bool empty_ = true;
};

}  // namespace

struct Tokenizer::Impl {
  std::string source;
  tok::Normalizer normalizer;
  tok::PreTokenizer pre_tokenizer;
  std::optional<tok::Bpe> model;
  tok::PostProcessor post;
  tok::Decoder decoder;

  std::vector<std::unique_ptr<AddedToken>> added;
  std::unordered_map<int32_t, const AddedToken*> added_by_id;
  tok::TokenMap added_by_content;
  std::unordered_set<std::string> special_contents;
  AddedMatcher raw_matcher, normalized_matcher;
  int32_t max_id = -1;

  void parse_added_tokens(const json& root);
  void encode_plain(std::string_view text, std::vector<int32_t>& ids) const;
  void encode_normalized(std::string&& text, std::vector<int32_t>& ids) const;
};

void Tokenizer::Impl::parse_added_tokens(const json& root) {
  Impl& impl = *this;
  auto it = root.find("added_tokens");
  if (it == root.end() || it->is_null()) return;
  const Where w{impl.source, "added_tokens"};
  if (!it->is_array()) invalid_input("{}: field added_tokens must be an array", impl.source);
  // Added ids extend the model's id space; bounded like the model's (vocab_size() is max id + 1).
  const int64_t id_limit = static_cast<int64_t>(impl.max_id) + 1 + static_cast<int64_t>(it->size()) + tok::kMaxIdHoles;
  for (size_t i = 0; i < it->size(); ++i) {
    const json& t = (*it)[i];
    const Where tw = w.index(i);
    if (!t.is_object() || !t.contains("id") || !t["id"].is_number_integer() || t["id"].get<int64_t>() < 0 ||
        t["id"].get<int64_t>() > INT32_MAX) {
      invalid_input("{}: field {}.id must be a non-negative integer", impl.source, tw.field);
    }
    if (!t.contains("content") || !t["content"].is_string()) {
      invalid_input("{}: field {}.content must be a string", impl.source, tw.field);
    }
    auto flag = [&](const char* key, bool fallback) {
      auto f = t.find(key);
      if (f == t.end() || f->is_null()) return fallback;
      if (!f->is_boolean()) invalid_input("{}: field {}.{} must be a boolean", impl.source, tw.field, key);
      return f->get<bool>();
    };
    if (t["id"].get<int64_t>() >= id_limit) {
      invalid_input("{}: field {}.id is {}, beyond the {} ids of model.vocab and added_tokens (at most {} unused ids)",
                    impl.source, tw.field, t["id"].get<int64_t>(), impl.max_id + 1 + static_cast<int64_t>(it->size()),
                    tok::kMaxIdHoles);
    }
    auto token = std::make_unique<AddedToken>();
    token->id = t["id"].get<int32_t>();
    token->content = t["content"].get<std::string>();
    token->special = flag("special", false);
    token->lstrip = flag("lstrip", false);
    token->rstrip = flag("rstrip", false);
    token->normalized = flag("normalized", !token->special);
    token->single_word = flag("single_word", false);
    if (token->content.empty()) continue;
    impl.added_by_id[token->id] = token.get();
    impl.added_by_content[token->content] = token->id;
    if (token->special) impl.special_contents.insert(token->content);
    impl.max_id = std::max(impl.max_id, token->id);
    impl.added.push_back(std::move(token));
  }
  for (const auto& t : impl.added) {
    if (!t->normalized) {
      impl.raw_matcher.add(t->content, t.get());
    } else {
      std::string pattern = t->content;
      if (impl.normalizer) impl.normalizer(pattern);
      impl.normalized_matcher.add(std::move(pattern), t.get());
    }
  }
}

Tokenizer Tokenizer::from_json(const std::string& json_text, const std::string& source) {
  // HF's own loader keeps the last of duplicated keys; so does this one (real vocabularies are not checked here).
  const json root = parse_json(json_text, source, DuplicateKeys::kKeepLast);
  if (!root.is_object()) invalid_input("{}: top level must be a JSON object", source);
  auto impl = std::make_unique<Impl>();
  impl->source = source;
  const Where top{impl->source, ""};
  for (const char* key : {"truncation", "padding"}) {
    if (auto it = root.find(key); it != root.end() && !it->is_null()) {
      invalid_input("{}: field {} must be null (Chimera does not truncate or pad at tokenization)", source, key);
    }
  }
  auto field = [&](const char* key) -> const json& {
    static const json kNull;
    auto it = root.find(key);
    return it == root.end() ? kNull : *it;
  };

  impl->normalizer = tok::parse_normalizer(field("normalizer"), top.at("normalizer"));
  impl->pre_tokenizer = tok::parse_pre_tokenizer(field("pre_tokenizer"), top.at("pre_tokenizer"));
  impl->decoder = tok::parse_decoder(field("decoder"), top.at("decoder"));

  const json& model = field("model");
  if (!model.is_object()) invalid_input("{}: field model must be an object", source);
  const std::string type = model.contains("type") && model["type"].is_string() ? model["type"].get<std::string>()
                                                                                 : std::string("BPE");
  if (type != "BPE") {
    invalid_input("{}: unsupported model type '{}' at field model.type (supported: BPE)", source, type);
  }
  impl->model.emplace(model, source);
  impl->max_id = impl->model->max_id();

  impl->parse_added_tokens(root);
  impl->post = tok::parse_post_processor(field("post_processor"), top.at("post_processor"));
  for (auto ids : {&impl->post.before, &impl->post.after}) {
    for (int32_t id : *ids) {
      if (id < 0 || id > impl->max_id) {
        invalid_input("{}: field post_processor uses id {} outside the vocabulary (size {})", source, id,
                      impl->max_id + 1);
      }
    }
  }
  return Tokenizer(std::move(impl));
}

Tokenizer Tokenizer::load(const std::filesystem::path& path) {
  return from_json(read_text_file(path, "tokenizer file", kMaxTokenizerFileBytes), path.string());
}

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

void Tokenizer::Impl::encode_normalized(std::string&& text, std::vector<int32_t>& ids) const {
  if (!pre_tokenizer) {
    model->tokenize(text, ids);
    return;
  }
  std::vector<std::string> words;
  pre_tokenizer(std::move(text), words);
  for (const auto& w : words) model->tokenize(w, ids);
}

void Tokenizer::Impl::encode_plain(std::string_view text, std::vector<int32_t>& ids) const {
  std::string normalized(text);
  if (normalizer) normalizer(normalized);
  if (normalized.empty()) return;
  for (const auto& seg : normalized_matcher.split(normalized)) {
    if (seg.token != nullptr) {
      ids.push_back(seg.token->id);
    } else if (seg.end > seg.begin) {
      encode_normalized(normalized.substr(seg.begin, seg.end - seg.begin), ids);
    }
  }
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  if (size_t bad = tok::find_invalid_utf8(text); bad != std::string_view::npos) {
    invalid_input("{}: encode input is not valid UTF-8 (byte offset {})", impl_->source, bad);
  }
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  if (add_special_tokens) ids = impl_->post.before;
  for (const auto& seg : impl_->raw_matcher.split(text)) {
    if (seg.token != nullptr) {
      ids.push_back(seg.token->id);
    } else if (seg.end > seg.begin) {
      impl_->encode_plain(text.substr(seg.begin, seg.end - seg.begin), ids);
    }
  }
  if (add_special_tokens) ids.insert(ids.end(), impl_->post.after.begin(), impl_->post.after.end());
  return ids;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int32_t id : ids) {
    if (id < 0 || id > impl_->max_id) {
      invalid_input("{}: decode: token id {} is out of range [0, {})", impl_->source, id, impl_->max_id + 1);
    }
    const std::string* token = nullptr;
    if (auto it = impl_->added_by_id.find(id); it != impl_->added_by_id.end()) {
      token = &it->second->content;
    } else {
      token = impl_->model->id_to_token(id);
    }
    if (token == nullptr) continue;  // a hole in the id space: HF skips it too
    if (skip_special_tokens && impl_->special_contents.count(*token) != 0) continue;
    tokens.push_back(*token);
  }
  if (!impl_->decoder) {
    std::string out;
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (i > 0) out += ' ';
      out += tokens[i];
    }
    return out;
  }
  impl_->decoder(tokens);
  std::string out;
  for (const auto& t : tokens) out += t;
  return out;
}

int64_t Tokenizer::vocab_size() const { return static_cast<int64_t>(impl_->max_id) + 1; }

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  if (auto it = impl_->added_by_content.find(token); it != impl_->added_by_content.end()) return it->second;
  return impl_->model->token_to_id(token);
}

std::string Tokenizer::id_to_token(int32_t id) const {
  if (auto it = impl_->added_by_id.find(id); it != impl_->added_by_id.end()) return it->second->content;
  if (const std::string* t = impl_->model->id_to_token(id)) return *t;
  invalid_input("{}: token id {} is not in the vocabulary (size {})", impl_->source, id, vocab_size());
}

bool Tokenizer::is_special(int32_t id) const {
  auto it = impl_->added_by_id.find(id);
  return it != impl_->added_by_id.end() && it->second->special;
}

// ---- streaming ---------------------------------------------------------------------------------------

StreamingDecoder::StreamingDecoder(const Tokenizer& tok, bool skip_special_tokens)
    : tok_(tok), skip_special_(skip_special_tokens) {}

std::string StreamingDecoder::decode_range(size_t begin, size_t end) {
  decoded_ids_ += end - begin;
  return tok_.decode(std::span<const int32_t>(ids_).subspan(begin, end - begin), skip_special_);
}

// The window's text so far is final: the unread tokens become the next window's context. A context that
// decodes to nothing (a lone "\u2581" that Strip removes, skipped special tokens) would let a decoder's
// sequence-start rule (Strip's leading space) act on the next tokens, so the old context is kept with it,
// for at most kMaxEmptyContextIds ids.
constexpr size_t kMaxEmptyContextIds = 16;

void StreamingDecoder::advance(size_t window_bytes) {
  const size_t old_prefix = prefix_;
  prefix_ = read_;
  read_ = ids_.size();
  prefix_bytes_ = decode_range(prefix_, read_).size();
  if (prefix_bytes_ == 0 && read_ - old_prefix <= kMaxEmptyContextIds) {
    prefix_ = old_prefix;
    prefix_bytes_ = window_bytes;
  }
  held_returned_ = 0;
}

std::string StreamingDecoder::feed(int32_t id) {
  ids_.push_back(id);
  const std::string text = decode_range(prefix_, ids_.size());
  // A trailing U+FFFD may be an incomplete character that later tokens complete: hold those back. Everything
  // before them is final for the supported decoders (byte-level lossy decoding is left to right).
  static constexpr std::string_view kReplacement = "\xEF\xBF\xBD";
  size_t end = text.size();
  while (end >= kReplacement.size() && std::string_view(text).substr(end - kReplacement.size(), 3) == kReplacement) {
    end -= kReplacement.size();
  }
  const size_t from = prefix_bytes_ + held_returned_;
  std::string out = end > from ? text.substr(from, end - from) : std::string();
  if (end > from) held_returned_ = end - prefix_bytes_;
  if (end == text.size()) advance(text.size());
  return out;
}

std::string StreamingDecoder::flush() {
  const std::string text = decode_range(prefix_, ids_.size());
  const size_t from = prefix_bytes_ + held_returned_;
  std::string out = text.size() > from ? text.substr(from) : std::string();
  if (text.size() > from) held_returned_ = text.size() - prefix_bytes_;  // later feeds continue the sequence
  return out;
}

}  // namespace chimera
