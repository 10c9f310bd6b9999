#include "tokenizer/regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "core/error.h"

namespace chimera::tok {

namespace {

// Unicode White_Space spelled out: PCRE2's UCP \\s also matches U+180E, which Oniguruma's does not.
constexpr const char* kOnigSpace =
    "\\t\\n\\x0B\\f\\r\\x20\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}";
constexpr const char* kOnigWord = "\\p{L}\\p{M}\\p{N}\\p{Pc}";
constexpr const char* kOnigHex = "0-9a-fA-F";

}  // namespace

std::string translate_oniguruma(std::string_view p) {
  std::string out;
  out.reserve(p.size() + 16);
  int class_depth = 0;  // Oniguruma allows nested classes; we only track depth to know where we are
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char e = p[++i];
      const bool in_class = class_depth > 0;
      auto put = [&](const char* inside, const char* outside_open, const char* body) {
        if (in_class) {
          out += inside;
        } else {
          out += outside_open;
          out += body;
          out += ']';
        }
      };
      switch (e) {
        case 's': put(kOnigSpace, "[", kOnigSpace); break;
        case 'S': put("\\S", "[^", kOnigSpace); break;
        case 'w': put(kOnigWord, "[", kOnigWord); break;
        case 'W': put("\\W", "[^", kOnigWord); break;
        case 'h': put(kOnigHex, "[", kOnigHex); break;
        case 'H': put("\\H", "[^", kOnigHex); break;
        default:
          out += '\\';
          out += e;
      }
      continue;
    }
    if (c == '[') {
      if (class_depth > 0 && i + 1 < p.size() && p[i + 1] == ':') {  // POSIX [:alpha:] inside a class
        const size_t close = p.find(":]", i + 2);
        if (close != std::string_view::npos) {
          out.append(p.substr(i, close + 2 - i));
          i = close + 1;
          continue;
        }
      }
      ++class_depth;
      out += c;
      // A ']' right after '[' or '[^' is a literal.
      if (i + 1 < p.size() && p[i + 1] == '^') out += p[++i];
      if (i + 1 < p.size() && p[i + 1] == ']') {
        out += "\\]";
        ++i;
      }
      continue;
    }
    if (c == ']' && class_depth > 0) --class_depth;
    out += c;
  }
  return out;
}

struct Regex::Code {
  pcre2_code* code = nullptr;
  ~Code() { pcre2_code_free(code); }
};

Regex::Regex(std::string_view pattern, const std::string& where, bool oniguruma) {
  const std::string pcre = oniguruma ? translate_oniguruma(pattern) : std::string(pattern);
  int err = 0;
  PCRE2_SIZE err_off = 0;
  auto code = std::make_shared<Code>();
  code->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pcre.data()), pcre.size(),
                             PCRE2_UTF | PCRE2_UCP | PCRE2_MULTILINE, &err, &err_off, nullptr);
  if (code->code == nullptr) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof(msg));
    invalid_input("{}: cannot compile regex '{}' (as PCRE2 '{}'): {} at offset {}", where, pattern, pcre,
                  reinterpret_cast<const char*>(msg), err_off);
  }
  pcre2_jit_compile(code->code, PCRE2_JIT_COMPLETE);  // optional: pcre2_match falls back to the interpreter
  code_ = std::move(code);
}

namespace {

// One match at or after `start`; returns false when there is none. Retries without JIT if the JIT stack
// is too small (long whitespace runs with (?!\S) backtrack deeply).
bool match_one(pcre2_code* code, pcre2_match_data* md, std::string_view s, size_t start, uint32_t options,
               size_t* b, size_t* e) {
  int rc = pcre2_match(code, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), start,
                       options | PCRE2_NO_UTF_CHECK, md, nullptr);
  if (rc == PCRE2_ERROR_JIT_STACKLIMIT) {
    rc = pcre2_match(code, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), start,
                     options | PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, md, nullptr);
  }
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  if (rc < 0) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(rc, msg, sizeof(msg));
    runtime_error("regex match failed: {}", reinterpret_cast<const char*>(msg));
  }
  const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
  *b = ov[0];
  *e = ov[1];
  return true;
}

struct MatchData {
  pcre2_match_data* md;
  explicit MatchData(pcre2_code* code) : md(pcre2_match_data_create_from_pattern(code, nullptr)) {}
  ~MatchData() { pcre2_match_data_free(md); }
  MatchData(const MatchData&) = delete;
  MatchData& operator=(const MatchData&) = delete;
};

}  // namespace

std::vector<std::pair<size_t, size_t>> Regex::find_all(std::string_view s) const {
  std::vector<std::pair<size_t, size_t>> out;
  MatchData md(code_->code);
  size_t pos = 0;
  while (pos <= s.size()) {
    size_t b, e;
    if (!match_one(code_->code, md.md, s, pos, 0, &b, &e)) break;
    if (e == b) {  // empty match: step over one character, as Oniguruma's iterator does
      if (b >= s.size()) break;
      size_t n = 1;
      while (b + n < s.size() && (static_cast<unsigned char>(s[b + n]) & 0xC0) == 0x80) ++n;
      pos = b + n;
      continue;
    }
    out.emplace_back(b, e);
    pos = e;
  }
  return out;
}

bool Regex::matches_at(std::string_view s, size_t at) const {
  MatchData md(code_->code);
  size_t b, e;
  return match_one(code_->code, md.md, s, at, PCRE2_ANCHORED, &b, &e);
}

}  // namespace chimera::tok
