// The bundled tokenizer (models/nemotron-h-tiny) on arbitrary input, read two ways: as text to encode (invalid
// UTF-8 must be refused, valid text must give in-vocabulary ids) and as a sequence of 16-bit ids to decode, in
// one call and streaming: the streamed pieces are valid UTF-8 and concatenate to decode() of the ids.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/unicode.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace chimera;
  static const Tokenizer tok = Tokenizer::load(CHIMERA_SOURCE_DIR "/models/nemotron-h-tiny/tokenizer.json");
  const std::string text(reinterpret_cast<const char*>(data), size);
  const bool valid = tok::find_invalid_utf8(text) == std::string_view::npos;
  try {
    for (int32_t id : tok.encode(text, size % 2 == 0)) {
      fuzz::require(id >= 0 && id < tok.vocab_size(), "encoded id in the vocabulary");
    }
    fuzz::require(valid, "invalid UTF-8 is refused");
  } catch (const Error& e) {
    fuzz::require(e.kind() == ErrorKind::kInvalidInput && !valid, "only invalid UTF-8 fails to encode");
  }

  std::vector<int32_t> ids;
  for (size_t i = 0; i + 1 < size; i += 2) {
    ids.push_back(static_cast<int32_t>((data[i] | (data[i + 1] << 8)) % tok.vocab_size()));
  }
  for (bool skip : {false, true}) {
    const std::string whole = tok.decode(ids, skip);
    StreamingDecoder stream(tok, skip);
    std::string all;
    for (int32_t id : ids) {
      const std::string piece = stream.feed(id);
      fuzz::require(tok::find_invalid_utf8(piece) == std::string_view::npos, "streamed piece is valid UTF-8");
      all += piece;
    }
    all += stream.flush();
    fuzz::require(all == whole, "streaming decode equals decode");
  }
  return 0;
}
