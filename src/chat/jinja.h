// A Jinja2 interpreter for Hugging Face chat templates: lexer (jinja_lexer.cpp), parser (jinja_parser.cpp),
// evaluator (jinja_eval.cpp, jinja_builtins.cpp) over the values of jinja_value.h.
// It follows the environment transformers renders chat templates in: ImmutableSandboxedEnvironment with
// trim_blocks and lstrip_blocks, the loopcontrols extension (break / continue), `{% generation %}`, the
// default (lenient) Undefined, and transformers' globals and filters (raise_exception, strftime_now, tojson
// with ensure_ascii off). Every error is Error kInvalidInput "<origin> line N: ..."; a template that runs
// past its work budget (steps, output bytes, recursion depth) stops with such an error instead of hanging.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

namespace chimera::chat::jinja {

struct Node;

struct Budget {
  uint64_t max_steps = 20'000'000;          // expression evaluations + loop iterations + output pieces
  uint64_t max_output_bytes = 64ull << 20;  // rendered text, and any single string / list built on the way
  uint32_t max_depth = 200;                 // macro call / template nesting depth
};

class Template {
 public:
  // Parses source (errors: kInvalidInput naming origin and line). Parsing is bounded: nesting deeper than
  // kMaxParseDepth is an error.
  static Template parse(const std::string& source, std::string origin = "<template>");
  static constexpr int kMaxParseDepth = 256;

  // vars: a JSON object, each key a template variable.
  std::string render(const nlohmann::ordered_json& vars, const Budget& budget = {}) const;

  const std::string& origin() const { return origin_; }

 private:
  Template() = default;
  std::shared_ptr<const Node> root_;
  std::string origin_;
};

}  // namespace chimera::chat::jinja
