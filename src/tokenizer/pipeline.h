// The non-model stages of tokenizer.json, each parsed once into a callable:
//   normalizer      Sequence, Prepend, Replace, Strip                      (text -> text)
//   pre_tokenizer   Sequence, Split, ByteLevel, Digits                     (text -> pieces)
//   post_processor  Sequence, TemplateProcessing, ByteLevel, Bert/Roberta (ids -> ids, add_special_tokens)
//   decoder         Sequence, ByteLevel, Replace, Strip, Fuse, ByteFallback (tokens -> strings)
// Anything else is rejected at load time with the file, the JSON field and the supported list.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace chimera::tok {

// A JSON location for error messages: "FILE: field pre_tokenizer.pretokenizers[0].pattern".
struct Where {
  const std::string& source;
  std::string field;
  Where at(const std::string& key) const { return {source, field.empty() ? key : field + "." + key}; }
  Where index(size_t i) const { return {source, field + "[" + std::to_string(i) + "]"}; }
};

using Normalizer = std::function<void(std::string&)>;
// Splits one piece into sub-pieces appended to out; empty pieces are never appended.
using PreTokenizer = std::function<void(std::string&&, std::vector<std::string>&)>;
// Rewrites the list of token strings; the decoded text is their concatenation.
using Decoder = std::function<void(std::vector<std::string>&)>;

// Template for add_special_tokens=true on a single sequence: before + ids + after.
struct PostProcessor {
  std::vector<int32_t> before;
  std::vector<int32_t> after;
};

// null JSON -> empty std::function (stage absent).
Normalizer parse_normalizer(const nlohmann::json& j, const Where& w);
PreTokenizer parse_pre_tokenizer(const nlohmann::json& j, const Where& w);
Decoder parse_decoder(const nlohmann::json& j, const Where& w);
PostProcessor parse_post_processor(const nlohmann::json& j, const Where& w);

}  // namespace chimera::tok
