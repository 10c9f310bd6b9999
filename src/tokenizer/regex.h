// PCRE2 wrapper that gives HF tokenizers' Oniguruma patterns their Oniguruma meaning.
// Compiled with PCRE2_UTF | PCRE2_UCP (Unicode \d, \p{..}) and JIT when available. Oniguruma differs from
// PCRE2 in a few classes, which translate_oniguruma() rewrites:
//   \s  Oniguruma: Unicode White_Space; PCRE2 10.42 UCP also matches U+180E -> spelled out as a list
//   \w  Oniguruma: Letter | Mark | Number | Connector_Punctuation; PCRE2 10.42: \p{L}\p{N}_
//   \h  Oniguruma: hex digit; PCRE2: horizontal space
//   ^ $ Oniguruma (Ruby syntax) anchors match at line boundaries -> PCRE2_MULTILINE
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace chimera::tok {

std::string translate_oniguruma(std::string_view pattern);

class Regex {
 public:
  // `where` names the file and JSON field for the error raised on a pattern PCRE2 cannot compile.
  // oniguruma=false compiles the pattern as PCRE2 syntax unchanged.
  Regex(std::string_view pattern, const std::string& where, bool oniguruma = true);

  // Non-overlapping matches [begin, end) of the whole subject, left to right, as Rust's find_iter.
  // Empty matches are not reported. subject must be valid UTF-8.
  std::vector<std::pair<size_t, size_t>> find_all(std::string_view subject) const;
  // Whether the pattern matches at offset `at` (anchored there).
  bool matches_at(std::string_view subject, size_t at) const;

 private:
  struct Code;
  std::shared_ptr<const Code> code_;
};

}  // namespace chimera::tok
