// QuantConfig: one validated view of a ModelOpt checkpoint's quantization metadata (docs/quantization.md 1), from
// DIR/hf_quant_config.json ({"producer": {"name": "modelopt", ...}, "quantization": {...}}) and / or DIR/config.json's
// "quantization_config" ({"quant_method": "modelopt", ...}). When both are present they must say the same thing.
// The question it answers: what format does the linear module named X (a checkpoint prefix such as
// "backbone.layers.3.mixer.in_proj") store its weight in.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace chimera {

// How a linear module's weight is stored.
enum class WeightFormat : uint8_t {
  kUnquantized,  // the checkpoint's float dtype (bf16 in NVIDIA's releases)
  kFp8,          // F8_E4M3 weight, F32 per-tensor weight_scale, F32 input_scale (static W8A8)
  kNvfp4,        // packed E2M1 U8 weight, F8_E4M3 per-group weight_scale, F32 weight_scale_2, F32 input_scale (W4A4)
  kNvfp4W4A16,   // NVFP4 weights, unquantized activations (ModelOpt's W4A16_NVFP4)
};
const char* weight_format_name(WeightFormat f);  // "unquantized", "fp8", "nvfp4", "nvfp4_w4a16"

struct ModuleQuant {
  WeightFormat format = WeightFormat::kUnquantized;
  int64_t group_size = 0;  // elements per weight_scale entry along `in` (NVFP4: 16); 0 when not grouped
  bool operator==(const ModuleQuant&) const = default;
};

enum class QuantAlgo : uint8_t { kFp8, kNvfp4, kNvfp4W4A16, kMixedPrecision };
const char* quant_algo_name(QuantAlgo a);  // the file's spelling: "FP8", "NVFP4", "W4A16_NVFP4", "MIXED_PRECISION"

enum class KvCacheQuant : uint8_t { kNone, kFp8, kNvfp4 };

struct QuantConfig {
  std::string source;            // the file(s) it was read from, for errors
  std::string producer_version;  // hf_quant_config.json producer.version ("" when not given)
  QuantAlgo algo = QuantAlgo::kFp8;
  KvCacheQuant kv_cache = KvCacheQuant::kNone;
  int64_t group_size = 0;  // the NVFP4 group size (16 when the file says nothing); 0 for FP8
  // Names or patterns of modules left unquantized, the ModelOpt 0.47 NUL suffix removed (parse_module_pattern).
  std::vector<std::string> exclude_modules;
  // MIXED_PRECISION: module name -> its format; modules not listed (and not a parent of a listed one) are
  // unquantized.
  std::map<std::string, ModuleQuant, std::less<>> quantized_layers;

  // The storage format of linear module `name` (exact checkpoint prefix, no ".weight"):
  //   excluded (exclude_modules / ignore match)          -> unquantized
  //   MIXED_PRECISION: listed in quantized_layers         -> its entry
  //                    a parent of listed modules          -> their common entry (all must agree, else kInvalidInput)
  //                    otherwise                           -> unquantized
  //   FP8 / NVFP4 / W4A16_NVFP4                            -> that format
  ModuleQuant module_quant(std::string_view name) const;
  bool excluded(std::string_view name) const;
};

// An exclude pattern matches `name` when it is equal to it, when it is a prefix of it ending at a '.' boundary
// ("backbone.layers.3" excludes "backbone.layers.3.mixer.in_proj"), or as an fnmatch-style wildcard over the
// whole name ('*' any run of characters, dots included; '?' one character; '[...]' a set, '[!...]' its
// complement), which is how ModelOpt writes them ("*mixer.conv1d*", "backbone.layers.4.mixer*", "lm_head").
bool module_pattern_matches(std::string_view pattern, std::string_view name);

// The module name in one exclude / ignore entry. ModelOpt 0.47 writes names it failed to map back with a
// NUL-separated sentinel suffix: "lm_head.\0backbone.pt_name_sentinel" means "lm_head"; a wildcard after the
// sentinel ("x.\0y.pt_name_sentinel*") is kept ("x*"). Entries without a NUL are returned as they are.
std::string parse_module_pattern(std::string_view entry);

// Parsers of one file's text; `source` names it in errors (every error is kInvalidInput naming the field).
QuantConfig parse_hf_quant_config(const std::string& json_text, const std::string& source);
// config.json's "quantization_config" object (already parsed JSON).
QuantConfig parse_quantization_config(const nlohmann::json& qc, const std::string& source);

// Reads DIR/hf_quant_config.json and DIR/config.json's quantization_config. nullopt when neither is present (an
// unquantized checkpoint). A quantization_config whose quant_method is not "modelopt", an unknown quant_algo,
// a field of the wrong type, or the two files disagreeing -> kInvalidInput naming the file(s) and the field.
std::optional<QuantConfig> load_quant_config(const std::filesystem::path& model_dir);

}  // namespace chimera
