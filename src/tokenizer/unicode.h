// UTF-8 helpers for the tokenizer: validation, Rust-compatible lossy decoding, the Unicode White_Space set,
// and the GPT-2 byte <-> unicode table used by the ByteLevel pre-tokenizer and decoder.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace chimera::tok {

// Length of the well-formed UTF-8 sequence starting at s[i] (Unicode Table 3-7), or 0 if it is not one.
size_t utf8_valid_len(std::string_view s, size_t i);
// Offset of the first byte that is not part of a well-formed sequence, or npos when s is valid UTF-8.
size_t find_invalid_utf8(std::string_view s);
// Code point of the well-formed sequence at s[i] (caller guarantees validity); *len receives its length.
uint32_t decode_utf8(std::string_view s, size_t i, size_t* len);
void append_utf8(std::string& out, uint32_t cp);
// Rust's String::from_utf8_lossy: each maximal subpart of an ill-formed sequence becomes one U+FFFD.
std::string utf8_lossy(std::string_view bytes);

// Unicode White_Space (Rust char::is_whitespace, Oniguruma \s, Rust regex \s).
bool is_white_space(uint32_t cp);

// GPT-2 bytes_to_unicode: printable Latin-1 bytes map to themselves, the other 68 to U+0100.. in order.
const std::array<std::string, 256>& byte_to_unicode();
// Inverse table; -1 for code points that are not the image of a byte.
int unicode_to_byte(uint32_t cp);

}  // namespace chimera::tok
