#include "tokenizer/unicode.h"

namespace chimera::tok {

namespace {

// Allowed range of the second byte for a lead byte (Unicode Table 3-7); the other continuation bytes are
// always 80..BF. Returns the sequence length, or 0 for bytes that can never start a sequence.
size_t lead_info(unsigned char b, unsigned char* lo, unsigned char* hi) {
  *lo = 0x80;
  *hi = 0xBF;
  if (b < 0x80) return 1;
  if (b >= 0xC2 && b <= 0xDF) return 2;
  if (b == 0xE0) *lo = 0xA0;
  if (b == 0xED) *hi = 0x9F;
  if (b >= 0xE0 && b <= 0xEF) return 3;
  if (b == 0xF0) *lo = 0x90;
  if (b == 0xF4) *hi = 0x8F;
  if (b >= 0xF0 && b <= 0xF4) return 4;
  return 0;
}

// Number of bytes of s[i..] that form a (possibly incomplete) prefix of a well-formed sequence, and
// whether that prefix is complete.
size_t maximal_subpart(std::string_view s, size_t i, bool* complete) {
  unsigned char lo, hi;
  const size_t need = lead_info(static_cast<unsigned char>(s[i]), &lo, &hi);
  *complete = false;
  if (need == 0) return 1;
  size_t n = 1;
  while (n < need && i + n < s.size()) {
    const auto c = static_cast<unsigned char>(s[i + n]);
    if (c < lo || c > hi) break;
    lo = 0x80;
    hi = 0xBF;
    ++n;
  }
  *complete = n == need;
  return n;
}

}  // namespace

size_t utf8_valid_len(std::string_view s, size_t i) {
  bool complete;
  const size_t n = maximal_subpart(s, i, &complete);
  return complete ? n : 0;
}

size_t find_invalid_utf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    if (static_cast<unsigned char>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    const size_t n = utf8_valid_len(s, i);
    if (n == 0) return i;
    i += n;
  }
  return std::string_view::npos;
}

uint32_t decode_utf8(std::string_view s, size_t i, size_t* len) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  if (b0 < 0x80) {
    *len = 1;
    return b0;
  }
  size_t n = b0 >= 0xF0 ? 4 : b0 >= 0xE0 ? 3 : 2;
  uint32_t cp = b0 & (0x7F >> n);
  for (size_t k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  *len = n;
  return cp;
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

std::string utf8_lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  size_t i = 0;
  while (i < bytes.size()) {
    bool complete;
    const size_t n = maximal_subpart(bytes, i, &complete);
    if (complete) {
      out.append(bytes.substr(i, n));
    } else {
      out += "\xEF\xBF\xBD";
    }
    i += n;
  }
  return out;
}

bool is_white_space(uint32_t cp) {
  if (cp <= 0x20) return cp == 0x20 || (cp >= 0x09 && cp <= 0x0D);
  if (cp < 0x85) return false;
  return cp == 0x85 || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 ||
         cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

namespace {

struct ByteTables {
  std::array<std::string, 256> to_unicode;
  std::array<int, 324> to_byte;  // every image is < U+0144
  ByteTables() {
    to_byte.fill(-1);
    int extra = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      const uint32_t cp = printable ? static_cast<uint32_t>(b) : static_cast<uint32_t>(256 + extra++);
      append_utf8(to_unicode[b], cp);
      to_byte[cp] = b;
    }
  }
};

const ByteTables& byte_tables() {
  static const ByteTables tables;
  return tables;
}

}  // namespace

const std::array<std::string, 256>& byte_to_unicode() { return byte_tables().to_unicode; }

int unicode_to_byte(uint32_t cp) {
  const auto& t = byte_tables().to_byte;
  return cp < t.size() ? t[cp] : -1;
}

}  // namespace chimera::tok
