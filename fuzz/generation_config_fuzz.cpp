// generation_config.json text applied to the bundled model's config: the special ids that come out are in the
// vocabulary.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_util.h"
#include "io/model_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace chimera;
  static const ModelConfig base = load_model_config(CHIMERA_SOURCE_DIR "/models/nemotron-h-tiny");
  const std::string text(reinterpret_cast<const char*>(data), size);
  fuzz::expect_clean([&] {
    ModelConfig c = base;
    apply_generation_config(c, text, "generation_config.json");
    for (int64_t id : c.eos_token_ids) fuzz::require(id >= 0 && id < c.vocab_size, "eos id in the vocabulary");
    fuzz::require(c.bos_token_id >= 0 && c.bos_token_id < c.vocab_size, "bos id in the vocabulary");
  });
  return 0;
}
