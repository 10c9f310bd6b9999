// A byte-level BPE tokenizer of a given vocabulary size, built in memory, for synthetic (random-weight)
// models whose published vocabulary has no tokenizer at hand. Every byte has its own id, there are no
// merges (text encodes to one id per byte), and every id in [0, vocab_size) decodes to text, so a
// synthetic model can be served and benchmarked end to end with text prompts and text output.
#pragma once

#include <cstdint>
#include <span>

#include "tokenizer/tokenizer.h"

namespace chimera {

// Vocabulary: the 256 GPT-2 byte-level symbols at ids 0..255, then "<|t{id}|>" for the remaining ids.
// Each eos id inside [0, vocab_size) is a special added token "<|eos|>" ("<|eos_1|>", ... for further
// ones); a byte whose natural id is an eos id moves to the first free id at or above 256, so every byte
// still encodes and decodes. No normalizer, ByteLevel pre-tokenizer (GPT-2 regex, no prefix space),
// ByteLevel decoder, no post-processor (add_special_tokens adds nothing).
// Errors (kInvalidInput): vocab_size too small to hold the 256 bytes beside the eos tokens, or > INT32_MAX.
Tokenizer synthetic_byte_level_tokenizer(int64_t vocab_size, std::span<const int64_t> eos_token_ids);

}  // namespace chimera
