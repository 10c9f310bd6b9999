// model.safetensors.index.json text: a weight_map that parses names only confined, relative shard files.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>

#include "fuzz_util.h"
#include "io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace chimera;
  const std::string text(reinterpret_cast<const char*>(data), size);
  fuzz::expect_clean([&] {
    for (const auto& [tensor, shard] : parse_safetensors_index(text, "model.safetensors.index.json")) {
      const std::filesystem::path p(shard);
      fuzz::require(!shard.empty() && !p.has_root_path(), "shard entry is a relative path");
      for (const auto& part : p) fuzz::require(part != "..", "shard entry has no '..'");
    }
  });
  return 0;
}
