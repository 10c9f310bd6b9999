// tokenizer.json text: a tokenizer that loads encodes and decodes a fixed text without failing, and its ids
// are inside its vocabulary.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_util.h"
#include "tokenizer/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace chimera;
  const std::string text(reinterpret_cast<const char*>(data), size);
  fuzz::expect_clean([&] {
    const Tokenizer tok = Tokenizer::from_json(text, "tokenizer.json");
    const std::vector<int32_t> ids = tok.encode("Hello, world! \xE6\x97\xA5\xE6\x9C\xAC <s> 42\n", true);
    for (int32_t id : ids) fuzz::require(id >= 0 && id < tok.vocab_size(), "encoded id in the vocabulary");
    (void)tok.decode(ids);
    StreamingDecoder stream(tok);
    std::string all;
    for (int32_t id : ids) all += stream.feed(id);
    all += stream.flush();
    (void)all;
  });
  return 0;
}
