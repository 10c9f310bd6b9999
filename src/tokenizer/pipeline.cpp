#include "tokenizer/pipeline.h"

#include <memory>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "tokenizer/regex.h"
#include "tokenizer/unicode.h"

namespace chimera::tok {

using nlohmann::json;

namespace {

// The GPT-2 pre-tokenizer regex that ByteLevel(use_regex=true) applies.
constexpr const char* kGpt2Regex =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

std::string type_of(const json& j, const Where& w) {
  if (!j.is_object()) invalid_input("{}: field {} must be an object or null", w.source, w.field);
  auto it = j.find("type");
  if (it == j.end() || !it->is_string()) invalid_input("{}: field {}.type is missing", w.source, w.field);
  return it->get<std::string>();
}

const json& member(const json& j, const char* key, const Where& w) {
  auto it = j.find(key);
  if (it == j.end()) invalid_input("{}: field {} is missing", w.source, w.at(key).field);
  return *it;
}

std::string get_string(const json& j, const char* key, const Where& w) {
  const json& v = member(j, key, w);
  if (!v.is_string()) invalid_input("{}: field {} must be a string", w.source, w.at(key).field);
  return v.get<std::string>();
}

bool get_bool(const json& j, const char* key, const Where& w, bool fallback) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  if (!it->is_boolean()) invalid_input("{}: field {} must be a boolean", w.source, w.at(key).field);
  return it->get<bool>();
}

int64_t get_int(const json& j, const char* key, const Where& w) {
  const json& v = member(j, key, w);
  if (!v.is_number_integer()) invalid_input("{}: field {} must be an integer", w.source, w.at(key).field);
  return v.get<int64_t>();
}

const json& get_array(const json& j, const char* key, const Where& w) {
  const json& v = member(j, key, w);
  if (!v.is_array()) invalid_input("{}: field {} must be an array", w.source, w.at(key).field);
  return v;
}

[[noreturn]] void unsupported(const Where& w, const std::string& what, const std::string& type, const char* supported) {
  invalid_input("{}: unsupported {} type '{}' at field {}.type (supported: {})", w.source, what, type, w.field,
                supported);
}

// A {"String": s} or {"Regex": r} pattern, as used by Split and Replace.
struct Pattern {
  std::string literal;
  std::shared_ptr<Regex> regex;

  std::vector<std::pair<size_t, size_t>> find_all(std::string_view s) const {
    if (regex) return regex->find_all(s);
    std::vector<std::pair<size_t, size_t>> out;
    if (literal.empty()) return out;
    for (size_t p = s.find(literal); p != std::string_view::npos; p = s.find(literal, p + literal.size())) {
      out.emplace_back(p, p + literal.size());
    }
    return out;
  }
};

Pattern parse_pattern(const json& j, const Where& w) {
  const json& p = member(j, "pattern", w);
  const Where pw = w.at("pattern");
  Pattern out;
  if (p.is_object() && p.contains("String") && p["String"].is_string()) {
    out.literal = p["String"].get<std::string>();
  } else if (p.is_object() && p.contains("Regex") && p["Regex"].is_string()) {
    out.regex = std::make_shared<Regex>(p["Regex"].get<std::string>(),
                                        fmt::format("{}: field {}.Regex", w.source, pw.field));
  } else {
    invalid_input("{}: field {} must be {{\"String\": ...}} or {{\"Regex\": ...}}", w.source, pw.field);
  }
  return out;
}

std::string replace_all(const std::string& s, const Pattern& p, const std::string& content) {
  auto matches = p.find_all(s);
  if (matches.empty()) return s;
  std::string out;
  size_t prev = 0;
  for (auto [b, e] : matches) {
    out.append(s, prev, b - prev);
    out += content;
    prev = e;
  }
  out.append(s, prev, std::string::npos);
  return out;
}

enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

SplitBehavior parse_behavior(const json& j, const Where& w) {
  const std::string b = get_string(j, "behavior", w);
  if (b == "Removed") return SplitBehavior::kRemoved;
  if (b == "Isolated") return SplitBehavior::kIsolated;
  if (b == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
  if (b == "MergedWithNext") return SplitBehavior::kMergedWithNext;
  if (b == "Contiguous") return SplitBehavior::kContiguous;
  invalid_input("{}: unsupported split behavior '{}' at field {} (supported: Removed, Isolated, "
                "MergedWithPrevious, MergedWithNext, Contiguous)",
                w.source, b, w.at("behavior").field);
}

// HF NormalizedString::split: (begin, end, is_match) spans covering s, combined per behaviour.
void split_pieces(std::string&& s, const Pattern& pattern, SplitBehavior behavior, bool invert,
                  std::vector<std::string>& out) {
  struct Span {
    size_t b, e;
    bool match;
  };
  std::vector<Span> spans;
  size_t prev = 0;
  for (auto [b, e] : pattern.find_all(s)) {
    if (prev != b) spans.push_back({prev, b, false});
    spans.push_back({b, e, true});
    prev = e;
  }
  if (prev != s.size()) spans.push_back({prev, s.size(), false});
  if (invert) {
    for (auto& sp : spans) sp.match = !sp.match;
  }
  std::vector<std::pair<size_t, size_t>> kept;
  bool previous_match = false;
  switch (behavior) {
    case SplitBehavior::kRemoved:
      for (const auto& sp : spans) {
        if (!sp.match) kept.emplace_back(sp.b, sp.e);
      }
      break;
    case SplitBehavior::kIsolated:
      for (const auto& sp : spans) kept.emplace_back(sp.b, sp.e);
      break;
    case SplitBehavior::kMergedWithPrevious:
      for (const auto& sp : spans) {
        if (sp.match && !previous_match && !kept.empty()) {
          kept.back().second = sp.e;
        } else {
          kept.emplace_back(sp.b, sp.e);
        }
        previous_match = sp.match;
      }
      break;
    case SplitBehavior::kMergedWithNext:
      for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
        if (it->match && !previous_match && !kept.empty()) {
          kept.back().first = it->b;
        } else {
          kept.emplace_back(it->b, it->e);
        }
        previous_match = it->match;
      }
      std::reverse(kept.begin(), kept.end());
      break;
    case SplitBehavior::kContiguous:
      for (size_t k = 0; k < spans.size(); ++k) {
        if (k > 0 && spans[k].match == previous_match) {
          kept.back().second = spans[k].e;
        } else {
          kept.emplace_back(spans[k].b, spans[k].e);
        }
        previous_match = spans[k].match;
      }
      break;
  }
  if (kept.size() == 1 && kept[0].first == 0 && kept[0].second == s.size()) {
    if (!s.empty()) out.push_back(std::move(s));
    return;
  }
  for (auto [b, e] : kept) {
    if (e > b) out.emplace_back(s.substr(b, e - b));
  }
}

std::string byte_level_map(std::string_view s) {
  const auto& table = byte_to_unicode();
  std::string out;
  out.reserve(s.size() * 2);
  for (char c : s) out += table[static_cast<unsigned char>(c)];
  return out;
}

}  // namespace

// ---- normalizers -----------------------------------------------------------------------------------

Normalizer parse_normalizer(const json& j, const Where& w) {
  if (j.is_null()) return {};
  const std::string type = type_of(j, w);
  if (type == "Sequence") {
    const json& arr = get_array(j, "normalizers", w);
    std::vector<Normalizer> parts;
    for (size_t i = 0; i < arr.size(); ++i) {
      if (auto n = parse_normalizer(arr[i], w.at("normalizers").index(i))) parts.push_back(std::move(n));
    }
    return [parts = std::move(parts)](std::string& s) {
      for (const auto& n : parts) n(s);
    };
  }
  if (type == "Prepend") {
    std::string prefix = get_string(j, "prepend", w);
    return [prefix = std::move(prefix)](std::string& s) {
      if (!s.empty()) s.insert(0, prefix);
    };
  }
  if (type == "Replace") {
    Pattern pattern = parse_pattern(j, w);
    std::string content = get_string(j, "content", w);
    return [pattern = std::move(pattern), content = std::move(content)](std::string& s) {
      s = replace_all(s, pattern, content);
    };
  }
  if (type == "Strip") {
    const bool left = get_bool(j, "strip_left", w, false), right = get_bool(j, "strip_right", w, false);
    return [left, right](std::string& s) {
      size_t b = 0, e = s.size();
      if (left) {
        while (b < e) {
          size_t n;
          if (!is_white_space(decode_utf8(s, b, &n))) break;
          b += n;
        }
      }
      if (right) {
        while (e > b) {
          size_t start = e - 1;
          while (start > b && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
          size_t n;
          if (!is_white_space(decode_utf8(s, start, &n))) break;
          e = start;
        }
      }
      s = s.substr(b, e - b);
    };
  }
  unsupported(w, "normalizer", type,
              "null, Sequence, Prepend, Replace, Strip; Unicode normalization (NFC, NFKC, NFD, NFKD), "
              "Lowercase, BertNormalizer and Precompiled need Unicode tables Chimera does not ship");
}

// ---- pre-tokenizers --------------------------------------------------------------------------------

PreTokenizer parse_pre_tokenizer(const json& j, const Where& w) {
  if (j.is_null()) return {};
  const std::string type = type_of(j, w);
  if (type == "Sequence") {
    const json& arr = get_array(j, "pretokenizers", w);
    std::vector<PreTokenizer> parts;
    for (size_t i = 0; i < arr.size(); ++i) {
      if (auto p = parse_pre_tokenizer(arr[i], w.at("pretokenizers").index(i))) parts.push_back(std::move(p));
    }
    return [parts = std::move(parts)](std::string&& s, std::vector<std::string>& out) {
      std::vector<std::string> cur, next;
      cur.push_back(std::move(s));
      for (const auto& p : parts) {
        next.clear();
        for (auto& piece : cur) p(std::move(piece), next);
        std::swap(cur, next);
      }
      for (auto& piece : cur) out.push_back(std::move(piece));
    };
  }
  if (type == "Split") {
    Pattern pattern = parse_pattern(j, w);
    const SplitBehavior behavior = parse_behavior(j, w);
    const bool invert = get_bool(j, "invert", w, false);
    return [pattern = std::move(pattern), behavior, invert](std::string&& s, std::vector<std::string>& out) {
      split_pieces(std::move(s), pattern, behavior, invert, out);
    };
  }
  if (type == "Digits") {
    const bool individual = get_bool(j, "individual_digits", w, false);
    Pattern pattern;
    pattern.regex = std::make_shared<Regex>(individual ? "\\p{N}" : "\\p{N}+", w.source + ": Digits");
    return [pattern = std::move(pattern)](std::string&& s, std::vector<std::string>& out) {
      split_pieces(std::move(s), pattern, SplitBehavior::kIsolated, false, out);
    };
  }
  if (type == "ByteLevel") {
    const bool add_prefix_space = get_bool(j, "add_prefix_space", w, true);
    const bool use_regex = get_bool(j, "use_regex", w, true);
    Pattern gpt2;
    if (use_regex) gpt2.regex = std::make_shared<Regex>(kGpt2Regex, w.source + ": ByteLevel GPT-2 regex");
    return [add_prefix_space, use_regex, gpt2 = std::move(gpt2)](std::string&& s, std::vector<std::string>& out) {
      if (add_prefix_space && (s.empty() || s[0] != ' ')) s.insert(0, 1, ' ');
      if (!use_regex) {
        if (!s.empty()) out.push_back(byte_level_map(s));
        return;
      }
      std::vector<std::string> pieces;
      split_pieces(std::move(s), gpt2, SplitBehavior::kIsolated, false, pieces);
      for (const auto& p : pieces) out.push_back(byte_level_map(p));
    };
  }
  unsupported(w, "pre_tokenizer", type, "null, Sequence, Split, ByteLevel, Digits");
}

// ---- post-processors -------------------------------------------------------------------------------

PostProcessor parse_post_processor(const json& j, const Where& w) {
  PostProcessor out;
  if (j.is_null()) return out;
  const std::string type = type_of(j, w);
  if (type == "ByteLevel") return out;  // only trims offsets; ids are unchanged
  if (type == "Sequence") {
    const json& arr = get_array(j, "processors", w);
    for (size_t i = 0; i < arr.size(); ++i) {
      PostProcessor p = parse_post_processor(arr[i], w.at("processors").index(i));
      out.before.insert(out.before.begin(), p.before.begin(), p.before.end());
      out.after.insert(out.after.end(), p.after.begin(), p.after.end());
    }
    return out;
  }
  if (type == "TemplateProcessing") {
    const json& single = get_array(j, "single", w);
    const json& specials = member(j, "special_tokens", w);
    bool seen_a = false;
    for (size_t i = 0; i < single.size(); ++i) {
      const json& piece = single[i];
      const Where pw = w.at("single").index(i);
      if (piece.contains("Sequence")) {
        const std::string id = get_string(piece["Sequence"], "id", pw.at("Sequence"));
        if (id != "A" || seen_a) {
          invalid_input("{}: field {} uses sequence '{}'; a single-sequence template uses A once", w.source,
                        pw.field, id);
        }
        seen_a = true;
      } else if (piece.contains("SpecialToken")) {
        const std::string name = get_string(piece["SpecialToken"], "id", pw.at("SpecialToken"));
        auto it = specials.find(name);
        if (it == specials.end()) {
          invalid_input("{}: field {} names special token '{}' missing from {}.special_tokens", w.source, pw.field,
                        name, w.field);
        }
        const Where sw = w.at("special_tokens").at(name);
        auto& dst = seen_a ? out.after : out.before;
        for (const auto& id : get_array(*it, "ids", sw)) {
          if (!id.is_number_integer()) invalid_input("{}: field {}.ids must hold integers", w.source, sw.field);
          dst.push_back(id.get<int32_t>());
        }
      } else {
        invalid_input("{}: field {} must be {{\"Sequence\": ..}} or {{\"SpecialToken\": ..}}", w.source, pw.field);
      }
    }
    if (!seen_a) invalid_input("{}: field {}.single has no $A sequence", w.source, w.field);
    return out;
  }
  if (type == "BertProcessing" || type == "RobertaProcessing") {
    auto token = [&](const char* key) {
      const json& pair = member(j, key, w);
      if (!pair.is_array() || pair.size() != 2 || !pair[1].is_number_integer()) {
        invalid_input("{}: field {} must be [token, id]", w.source, w.at(key).field);
      }
      return pair[1].get<int32_t>();
    };
    out.before.push_back(token("cls"));
    out.after.push_back(token("sep"));
    return out;
  }
  unsupported(w, "post_processor", type, "null, Sequence, TemplateProcessing, ByteLevel, BertProcessing, "
                                         "RobertaProcessing");
}

// ---- decoders --------------------------------------------------------------------------------------

Decoder parse_decoder(const json& j, const Where& w) {
  if (j.is_null()) return {};
  const std::string type = type_of(j, w);
  if (type == "Sequence") {
    const json& arr = get_array(j, "decoders", w);
    std::vector<Decoder> parts;
    for (size_t i = 0; i < arr.size(); ++i) {
      if (auto d = parse_decoder(arr[i], w.at("decoders").index(i))) parts.push_back(std::move(d));
    }
    return [parts = std::move(parts)](std::vector<std::string>& tokens) {
      for (const auto& d : parts) d(tokens);
    };
  }
  if (type == "ByteLevel") {
    // Each token maps back through the byte table when all its characters are in it, else it contributes its
    // own UTF-8 bytes; the whole byte string is then decoded lossily (HF decoders/byte_level.rs).
    return [](std::vector<std::string>& tokens) {
      std::string bytes;
      for (const auto& t : tokens) {
        const size_t start = bytes.size();
        bool all = true;
        for (size_t i = 0; i < t.size();) {
          size_t n;
          const int b = unicode_to_byte(decode_utf8(t, i, &n));
          if (b < 0) {
            all = false;
            break;
          }
          bytes += static_cast<char>(b);
          i += n;
        }
        if (!all) {
          bytes.resize(start);
          bytes += t;
        }
      }
      tokens.assign(1, utf8_lossy(bytes));
    };
  }
  if (type == "Replace") {
    Pattern pattern = parse_pattern(j, w);
    std::string content = get_string(j, "content", w);
    return [pattern = std::move(pattern), content = std::move(content)](std::vector<std::string>& tokens) {
      for (auto& t : tokens) t = replace_all(t, pattern, content);
    };
  }
  if (type == "Fuse") {
    return [](std::vector<std::string>& tokens) {
      std::string all;
      for (const auto& t : tokens) all += t;
      tokens.assign(1, std::move(all));
    };
  }
  if (type == "Strip") {
    const std::string content = get_string(j, "content", w);
    size_t n = 0;
    if (content.empty() || utf8_valid_len(content, 0) != content.size()) {
      invalid_input("{}: field {} must be a single character", w.source, w.at("content").field);
    }
    const uint32_t ch = decode_utf8(content, 0, &n);
    const int64_t start = get_int(j, "start", w), stop = get_int(j, "stop", w);
    return [ch, start, stop](std::vector<std::string>& tokens) {
      for (auto& t : tokens) {
        std::vector<std::pair<size_t, uint32_t>> chars;  // (byte offset, code point)
        for (size_t i = 0; i < t.size();) {
          size_t len;
          chars.emplace_back(i, decode_utf8(t, i, &len));
          i += len;
        }
        size_t cut_start = 0, cut_stop = chars.size();
        for (int64_t k = 0; k < start && static_cast<size_t>(k) < chars.size() && chars[k].second == ch; ++k) {
          cut_start = static_cast<size_t>(k) + 1;
        }
        for (int64_t k = 0; k < stop && static_cast<size_t>(k) < chars.size(); ++k) {
          const size_t idx = chars.size() - 1 - static_cast<size_t>(k);
          if (chars[idx].second != ch) break;
          cut_stop = idx;
        }
        if (cut_start >= cut_stop) {
          t.clear();
        } else {
          const size_t b = chars[cut_start].first;
          const size_t e = cut_stop < chars.size() ? chars[cut_stop].first : t.size();
          t = t.substr(b, e - b);
        }
      }
    };
  }
  if (type == "ByteFallback") {
    // Runs of "<0xXX>" tokens become their bytes when those form valid UTF-8, else one U+FFFD per byte token.
    return [](std::vector<std::string>& tokens) {
      std::vector<std::string> out;
      std::string run;
      auto flush = [&] {
        if (run.empty()) return;
        if (find_invalid_utf8(run) == std::string::npos) {
          out.push_back(run);
        } else {
          for (size_t k = 0; k < run.size(); ++k) out.emplace_back("\xEF\xBF\xBD");
        }
        run.clear();
      };
      for (auto& t : tokens) {
        const bool is_byte = t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>' &&
                             std::isxdigit(static_cast<unsigned char>(t[3])) &&
                             std::isxdigit(static_cast<unsigned char>(t[4]));
        if (is_byte) {
          run += static_cast<char>(std::stoi(t.substr(3, 2), nullptr, 16));
        } else {
          flush();
          out.push_back(std::move(t));
        }
      }
      flush();
      tokens = std::move(out);
    };
  }
  unsupported(w, "decoder", type, "null, Sequence, ByteLevel, Replace, Strip, Fuse, ByteFallback");
}

}  // namespace chimera::tok
