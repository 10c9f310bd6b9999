// JSON from files the user supplies (config.json, generation_config.json, the safetensors header and index,
// tokenizer.json): one parser whose every failure is kInvalidInput naming the file. Beyond syntax it rejects
// numbers outside a double (1e400), nesting deeper than kMaxJsonDepth (the error and dump paths recurse) and,
// when asked, a key given twice in one object (nlohmann keeps the last silently; HF's Python loader too, so a
// duplicated key is an edit nobody can see the effect of).
#pragma once

#include <cstddef>
#include <filesystem>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace chimera {

inline constexpr int kMaxJsonDepth = 128;
// Config-sized files (config.json, generation_config.json, an index): far above any real one.
inline constexpr size_t kMaxConfigFileBytes = size_t{64} << 20;
// tokenizer.json: real ones are a few MiB to a few tens of MiB.
inline constexpr size_t kMaxTokenizerFileBytes = size_t{1} << 30;

enum class DuplicateKeys { kReject, kKeepLast };

// `source` names the text in errors ("DIR/config.json", "DIR/model.safetensors header").
nlohmann::json parse_json(std::string_view text, const std::string& source,
                          DuplicateKeys duplicates = DuplicateKeys::kReject);

// The bytes of a regular file of at most max_bytes; `what` says which file it is in errors ("config file").
// A missing path, a directory, an unreadable or oversized file -> kInvalidInput naming the path.
std::string read_text_file(const std::filesystem::path& path, const std::string& what, size_t max_bytes);

}  // namespace chimera
