// ModelOpt quantization metadata: the text as hf_quant_config.json and as a config.json with a quantization_config.
// A config that parses answers module_quant for its own names: every exclude entry is unquantized, every listed
// MIXED_PRECISION module that is not excluded has its listed format, and no name holds a NUL.
#include <cstddef>
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "fuzz_util.h"
#include "io/json_file.h"
#include "io/quant_config.h"

namespace {

void check(const chimera::QuantConfig& c) {
  using namespace chimera;
  fuzz::require(c.group_size == 0 || c.group_size == 16, "group size 0 or 16");
  for (const std::string& p : c.exclude_modules) {
    fuzz::require(p.find('\0') == std::string::npos, "no NUL in an exclude pattern");
    fuzz::require(c.module_quant(p).format == WeightFormat::kUnquantized, "an excluded name is unquantized");
  }
  for (const auto& [name, mq] : c.quantized_layers) {
    fuzz::require(name.find('\0') == std::string::npos, "no NUL in a module name");
    if (!c.excluded(name)) fuzz::require(c.module_quant(name) == mq, "a listed module has its listed format");
  }
  fuzz::expect_clean([&] { (void)c.module_quant("backbone.layers.1.mixer.experts"); });
  fuzz::expect_clean([&] { (void)c.module_quant("lm_head"); });
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace chimera;
  const std::string text(reinterpret_cast<const char*>(data), size);
  fuzz::expect_clean([&] { check(parse_hf_quant_config(text, "hf_quant_config.json")); });
  fuzz::expect_clean([&] {
    const nlohmann::json j = parse_json(text, "config.json");
    if (j.is_object() && j.contains("quantization_config")) {
      check(parse_quantization_config(j["quantization_config"], "config.json"));
    }
  });
  return 0;
}
