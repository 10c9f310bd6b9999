// ModelOpt quantization metadata -> QuantConfig (io/quant_config.h, docs/quantization.md 1).
#include "io/quant_config.h"

#include <algorithm>
#include <cctype>
#include <set>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/json_file.h"
#include "io/model_config.h"

namespace chimera {

namespace fs = std::filesystem;
using json = nlohmann::json;

const char* weight_format_name(WeightFormat f) {
  switch (f) {
    case WeightFormat::kUnquantized: return "unquantized";
    case WeightFormat::kFp8: return "fp8";
    case WeightFormat::kNvfp4: return "nvfp4";
    case WeightFormat::kNvfp4W4A16: return "nvfp4_w4a16";
  }
  return "?";
}

const char* quant_algo_name(QuantAlgo a) {
  switch (a) {
    case QuantAlgo::kFp8: return "FP8";
    case QuantAlgo::kNvfp4: return "NVFP4";
    case QuantAlgo::kNvfp4W4A16: return "W4A16_NVFP4";
    case QuantAlgo::kMixedPrecision: return "MIXED_PRECISION";
  }
  return "?";
}

namespace {

constexpr int64_t kNvfp4GroupSize = 16;
constexpr const char* kSupportedAlgos = "FP8, NVFP4, W4A16_NVFP4, MIXED_PRECISION";

std::string upper(std::string s) {
  for (char& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

// A JSON value for a message: short, NULs visible.
std::string shown(const json& v) {
  std::string s = v.dump(-1, ' ', true, json::error_handler_t::replace);
  if (s.size() > 80) s = s.substr(0, 77) + "...";
  return s;
}

const json* field(const json& obj, const char* name) {
  const auto it = obj.find(name);
  return it == obj.end() || it->is_null() ? nullptr : &*it;
}

std::string get_string(const json& v, const std::string& source, const std::string& field_name) {
  if (!v.is_string()) invalid_input("{}: field '{}' must be a string, got {}", source, field_name, shown(v));
  return v.get<std::string>();
}

int64_t get_group_size(const json& v, const std::string& source, const std::string& field_name) {
  if (!v.is_number_integer() || (v.is_number_unsigned() && v.get<uint64_t>() > 1u << 20) ||
      v.get<int64_t>() <= 0) {
    invalid_input("{}: field '{}' must be a positive integer, got {}", source, field_name, shown(v));
  }
  return v.get<int64_t>();
}

struct Algo {
  QuantAlgo algo;
  WeightFormat format;  // the per-module format (kUnquantized for MIXED_PRECISION)
};

Algo parse_algo(const json& v, const std::string& source, const std::string& field_name, bool allow_mixed) {
  const std::string a = upper(get_string(v, source, field_name));
  if (a == "FP8") return {QuantAlgo::kFp8, WeightFormat::kFp8};
  if (a == "NVFP4") return {QuantAlgo::kNvfp4, WeightFormat::kNvfp4};
  if (a == "W4A16_NVFP4") return {QuantAlgo::kNvfp4W4A16, WeightFormat::kNvfp4W4A16};
  if (a == "MIXED_PRECISION" && allow_mixed) return {QuantAlgo::kMixedPrecision, WeightFormat::kUnquantized};
  invalid_input("{}: field '{}': unsupported quant_algo {} (supported: {})", source, field_name, shown(v),
                allow_mixed ? kSupportedAlgos : "FP8, NVFP4, W4A16_NVFP4");
}

int64_t group_size_for(WeightFormat f, const json* gs, const std::string& source, const std::string& field_name) {
  if (f != WeightFormat::kNvfp4 && f != WeightFormat::kNvfp4W4A16) {
    if (gs) get_group_size(*gs, source, field_name);  // type-checked, not used: FP8 is per tensor
    return 0;
  }
  const int64_t g = gs ? get_group_size(*gs, source, field_name) : kNvfp4GroupSize;
  if (g != kNvfp4GroupSize) {
    invalid_input("{}: field '{}': NVFP4 group size {} (supported: {})", source, field_name, g, kNvfp4GroupSize);
  }
  return g;
}

KvCacheQuant parse_kv_algo(const json& v, const std::string& source, const std::string& field_name) {
  const std::string a = upper(get_string(v, source, field_name));
  if (a == "FP8") return KvCacheQuant::kFp8;
  if (a == "NVFP4") return KvCacheQuant::kNvfp4;
  invalid_input("{}: field '{}': unsupported KV cache quant_algo {} (supported: FP8, NVFP4, or null)", source,
                field_name, shown(v));
}

std::vector<std::string> parse_patterns(const json& v, const std::string& source, const std::string& field_name) {
  if (!v.is_array()) invalid_input("{}: field '{}' must be a list of strings, got {}", source, field_name, shown(v));
  std::vector<std::string> r;
  r.reserve(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    if (!v[i].is_string()) {
      invalid_input("{}: field '{}[{}]' must be a string, got {}", source, field_name, i, shown(v[i]));
    }
    std::string p = parse_module_pattern(v[i].get_ref<const std::string&>());
    if (p.empty()) invalid_input("{}: field '{}[{}]' names no module: {}", source, field_name, i, shown(v[i]));
    r.push_back(std::move(p));
  }
  return r;
}

// The fields shared by both files, with the names each uses.
struct FieldNames {
  const char* exclude;   // "exclude_modules" / "ignore"
  const char* prefix;    // "quantization." / "quantization_config."
};

QuantConfig parse_common(const json& q, const std::string& source, const FieldNames& names) {
  const std::string pre = names.prefix;
  QuantConfig c;
  c.source = source;
  const json* algo = field(q, "quant_algo");
  if (!algo) invalid_input("{}: field '{}quant_algo' is missing (supported: {})", source, pre, kSupportedAlgos);
  const Algo a = parse_algo(*algo, source, pre + "quant_algo", /*allow_mixed=*/true);
  c.algo = a.algo;
  c.group_size = group_size_for(a.format, field(q, "group_size"), source, pre + "group_size");
  if (const json* e = field(q, names.exclude)) c.exclude_modules = parse_patterns(*e, source, pre + names.exclude);

  const json* layers = field(q, "quantized_layers");
  if (c.algo == QuantAlgo::kMixedPrecision) {
    if (!layers || !layers->is_object() || layers->empty()) {
      invalid_input("{}: quant_algo MIXED_PRECISION needs a non-empty object '{}quantized_layers' (module name -> "
                    "{{\"quant_algo\": ...}}), got {}",
                    source, pre, layers ? shown(*layers) : std::string("nothing"));
    }
    for (const auto& [raw_name, entry] : layers->items()) {
      const std::string f = pre + "quantized_layers." + parse_module_pattern(raw_name);
      if (!entry.is_object()) invalid_input("{}: field '{}' must be an object, got {}", source, f, shown(entry));
      const json* ea = field(entry, "quant_algo");
      if (!ea) invalid_input("{}: field '{}.quant_algo' is missing", source, f);
      const Algo la = parse_algo(*ea, source, f + ".quant_algo", /*allow_mixed=*/false);
      ModuleQuant mq{la.format, group_size_for(la.format, field(entry, "group_size"), source, f + ".group_size")};
      const std::string name = parse_module_pattern(raw_name);
      if (name.empty()) invalid_input("{}: field '{}quantized_layers' has an entry naming no module", source, pre);
      const auto [it, inserted] = c.quantized_layers.emplace(name, mq);
      if (!inserted && !(it->second == mq)) {
        invalid_input("{}: field '{}': listed twice with different formats", source, f);
      }
    }
    // The group size of a MIXED_PRECISION file is its NVFP4 entries' (they all have 16).
    for (const auto& [name, mq] : c.quantized_layers) {
      if (mq.group_size) c.group_size = mq.group_size;
    }
  } else if (layers) {
    invalid_input("{}: field '{}quantized_layers' is given but quant_algo is {}: per-module formats belong to "
                  "MIXED_PRECISION",
                  source, pre, quant_algo_name(c.algo));
  }
  return c;
}

std::string describe_kv(KvCacheQuant k) {
  switch (k) {
    case KvCacheQuant::kNone: return "none";
    case KvCacheQuant::kFp8: return "FP8";
    case KvCacheQuant::kNvfp4: return "NVFP4";
  }
  return "?";
}

std::string describe_layers(const QuantConfig& c) {
  std::string s;
  for (const auto& [name, mq] : c.quantized_layers) {
    if (!s.empty()) s += ", ";
    s += name + ": " + weight_format_name(mq.format);
    if (s.size() > 200) return s + ", ...";
  }
  return s;
}

// The two files of one checkpoint must agree: a loader reading one and a reader of the other would otherwise
// run different models.
void check_agree(const QuantConfig& a, const QuantConfig& b) {
  auto differ = [&](const char* what, const std::string& x, const std::string& y) {
    invalid_input("{} and {} disagree on {}: {} vs {}", a.source, b.source, what, x, y);
  };
  if (a.algo != b.algo) differ("quant_algo", quant_algo_name(a.algo), quant_algo_name(b.algo));
  if (a.kv_cache != b.kv_cache) {
    differ("the KV cache quantization (kv_cache_quant_algo / kv_cache_scheme)", describe_kv(a.kv_cache),
           describe_kv(b.kv_cache));
  }
  if (a.group_size != b.group_size) differ("group_size", std::to_string(a.group_size), std::to_string(b.group_size));
  const std::set<std::string> ea(a.exclude_modules.begin(), a.exclude_modules.end());
  const std::set<std::string> eb(b.exclude_modules.begin(), b.exclude_modules.end());
  if (ea != eb) {
    std::string only_a, only_b;
    for (const auto& s : ea) {
      if (!eb.count(s) && only_a.size() < 160) only_a += (only_a.empty() ? "" : ", ") + s;
    }
    for (const auto& s : eb) {
      if (!ea.count(s) && only_b.size() < 160) only_b += (only_b.empty() ? "" : ", ") + s;
    }
    differ("the excluded modules (exclude_modules / ignore)", "[" + only_a + "] only in the first",
           "[" + only_b + "] only in the second");
  }
  if (a.quantized_layers != b.quantized_layers) differ("quantized_layers", describe_layers(a), describe_layers(b));
}

// fnmatch over the whole string: '*' any run, '?' one character, '[set]' / '[!set]' with ranges; a '[' without
// its ']' is literal. Iterative with one backtrack point (the last '*'), so linear-ish and never recursive.
size_t match_class(std::string_view p, size_t i, char c, bool* matched) {
  // p[i] == '['; returns the index after ']', or npos when there is none.
  size_t j = i + 1;
  bool negate = false;
  if (j < p.size() && (p[j] == '!')) {
    negate = true;
    ++j;
  }
  bool hit = false;
  bool first = true;
  for (; j < p.size(); ++j) {
    if (p[j] == ']' && !first) {
      *matched = hit != negate;
      return j + 1;
    }
    first = false;
    if (j + 2 < p.size() && p[j + 1] == '-' && p[j + 2] != ']') {
      if (p[j] <= c && c <= p[j + 2]) hit = true;
      j += 2;
    } else if (p[j] == c) {
      hit = true;
    }
  }
  return std::string_view::npos;
}

bool glob_match(std::string_view p, std::string_view s) {
  size_t pi = 0, si = 0;
  size_t star_p = std::string_view::npos, star_s = 0;
  while (si < s.size()) {
    if (pi < p.size()) {
      const char pc = p[pi];
      if (pc == '*') {
        star_p = pi++;
        star_s = si;
        continue;
      }
      if (pc == '?') {
        ++pi;
        ++si;
        continue;
      }
      if (pc == '[') {
        bool m = false;
        const size_t next = match_class(p, pi, s[si], &m);
        if (next != std::string_view::npos) {
          if (m) {
            pi = next;
            ++si;
            continue;
          }
        } else if (s[si] == '[') {  // literal '['
          ++pi;
          ++si;
          continue;
        }
      } else if (pc == s[si]) {
        ++pi;
        ++si;
        continue;
      }
    }
    if (star_p == std::string_view::npos) return false;
    pi = star_p + 1;
    si = ++star_s;
  }
  while (pi < p.size() && p[pi] == '*') ++pi;
  return pi == p.size();
}

}  // namespace

std::string parse_module_pattern(std::string_view entry) {
  const size_t nul = entry.find('\0');
  if (nul == std::string_view::npos) return std::string(entry);
  std::string base(entry.substr(0, nul));
  if (!base.empty() && base.back() == '.') base.pop_back();
  const std::string_view tail = entry.substr(nul + 1);
  if (tail.size() >= 2 && tail.substr(tail.size() - 2) == ".*") {
    base += ".*";
  } else if (!tail.empty() && tail.back() == '*') {
    base += '*';
  }
  return base;
}

bool module_pattern_matches(std::string_view pattern, std::string_view name) {
  if (pattern == name) return true;
  if (name.size() > pattern.size() && name.substr(0, pattern.size()) == pattern && name[pattern.size()] == '.') {
    return true;
  }
  return glob_match(pattern, name);
}

bool QuantConfig::excluded(std::string_view name) const {
  return std::any_of(exclude_modules.begin(), exclude_modules.end(),
                     [&](const std::string& p) { return module_pattern_matches(p, name); });
}

ModuleQuant QuantConfig::module_quant(std::string_view name) const {
  if (excluded(name)) return {};
  switch (algo) {
    case QuantAlgo::kFp8: return {WeightFormat::kFp8, 0};
    case QuantAlgo::kNvfp4: return {WeightFormat::kNvfp4, group_size};
    case QuantAlgo::kNvfp4W4A16: return {WeightFormat::kNvfp4W4A16, group_size};
    case QuantAlgo::kMixedPrecision: break;
  }
  if (const auto it = quantized_layers.find(name); it != quantized_layers.end()) return it->second;
  // A parent of listed modules (e.g. "...mixer.experts" over "...mixer.experts.0.up_proj"): their common format.
  const std::string parent = std::string(name) + ".";
  std::optional<ModuleQuant> common;
  for (auto it = quantized_layers.lower_bound(parent);
       it != quantized_layers.end() && it->first.compare(0, parent.size(), parent) == 0; ++it) {
    if (common && !(*common == it->second)) {
      invalid_input("{}: the modules under '{}' have different formats in quantized_layers ({} and {}: {})", source,
                    name, weight_format_name(common->format), it->first, weight_format_name(it->second.format));
    }
    common = it->second;
  }
  return common.value_or(ModuleQuant{});
}

QuantConfig parse_hf_quant_config(const std::string& json_text, const std::string& source) {
  const json j = parse_json(json_text, source);
  if (!j.is_object()) invalid_input("{}: must be a JSON object, got {}", source, j.type_name());
  std::string version;
  if (const json* producer = field(j, "producer")) {
    if (!producer->is_object()) invalid_input("{}: field 'producer' must be an object, got {}", source, shown(*producer));
    const json* name = field(*producer, "name");
    if (!name) invalid_input("{}: field 'producer.name' is missing (supported: modelopt)", source);
    const std::string n = get_string(*name, source, "producer.name");
    if (n != "modelopt") {
      invalid_input("{}: field 'producer.name': quantized by {} (supported: modelopt)", source, shown(*name));
    }
    if (const json* v = field(*producer, "version")) version = get_string(*v, source, "producer.version");
  }
  const json* q = field(j, "quantization");
  if (!q) invalid_input("{}: field 'quantization' is missing", source);
  if (!q->is_object()) invalid_input("{}: field 'quantization' must be an object, got {}", source, shown(*q));
  QuantConfig c = parse_common(*q, source, {"exclude_modules", "quantization."});
  c.producer_version = version;
  if (const json* kv = field(*q, "kv_cache_quant_algo")) {
    c.kv_cache = parse_kv_algo(*kv, source, "quantization.kv_cache_quant_algo");
  }
  return c;
}

QuantConfig parse_quantization_config(const json& qc, const std::string& source) {
  if (!qc.is_object()) invalid_input("{}: field 'quantization_config' must be an object, got {}", source, shown(qc));
  const json* method = field(qc, "quant_method");
  if (!method) invalid_input("{}: field 'quantization_config.quant_method' is missing (supported: modelopt)", source);
  const std::string m = get_string(*method, source, "quantization_config.quant_method");
  std::string ml = m;
  for (char& ch : ml) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  if (ml.rfind("modelopt", 0) != 0) {
    invalid_input("{}: field 'quantization_config.quant_method': unsupported quantization method {} (supported: "
                  "modelopt)",
                  source, shown(*method));
  }
  QuantConfig c = parse_common(qc, source, {"ignore", "quantization_config."});
  // kv_cache_scheme: {"type": "float", "num_bits": 8, "dynamic": false} is FP8; null or absent is none.
  if (const json* kv = field(qc, "kv_cache_scheme")) {
    const std::string f = "quantization_config.kv_cache_scheme";
    if (!kv->is_object()) invalid_input("{}: field '{}' must be an object, got {}", source, f, shown(*kv));
    const json* type = field(*kv, "type");
    const json* bits = field(*kv, "num_bits");
    const bool fp8 = type && type->is_string() && *type == "float" && bits && bits->is_number_integer() &&
                     bits->get<int64_t>() == 8;
    const bool fp4 = type && type->is_string() && *type == "float" && bits && bits->is_number_integer() &&
                     bits->get<int64_t>() == 4;
    if (!fp8 && !fp4) {
      invalid_input("{}: field '{}': unsupported KV cache scheme {} (supported: {{\"type\": \"float\", \"num_bits\": "
                    "8 or 4}})",
                    source, f, shown(*kv));
    }
    c.kv_cache = fp8 ? KvCacheQuant::kFp8 : KvCacheQuant::kNvfp4;
  } else if (const json* kva = field(qc, "kv_cache_quant_algo")) {
    c.kv_cache = parse_kv_algo(*kva, source, "quantization_config.kv_cache_quant_algo");
  }
  return c;
}

std::optional<QuantConfig> load_quant_config(const fs::path& model_dir) {
  std::optional<QuantConfig> from_hf, from_config;
  const fs::path hf = model_dir / "hf_quant_config.json";
  std::error_code ec;
  if (fs::exists(hf, ec)) {
    from_hf = parse_hf_quant_config(read_text_file(hf, "quantization config", kMaxConfigFileBytes), hf.string());
  }
  const fs::path cfg = model_dir / "config.json";
  if (fs::exists(cfg, ec)) {
    const std::string source = cfg.string();
    const json j = parse_json(quote_nonfinite_literals(read_text_file(cfg, "config file", kMaxConfigFileBytes)),
                              source);
    if (j.is_object()) {
      if (const json* qc = field(j, "quantization_config")) from_config = parse_quantization_config(*qc, source);
    }
  }
  if (from_hf && from_config) {
    check_agree(*from_hf, *from_config);
    from_hf->source = from_hf->source + " + " + from_config->source;
    return from_hf;
  }
  return from_hf ? from_hf : from_config;
}

}  // namespace chimera
