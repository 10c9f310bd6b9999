// The Jinja interpreter vs transformers' own Jinja environment (tests/fixtures/chat_templates/jinja_cases.json,
// made by scripts/make_chat_goldens.py), plus error messages and the work budget on hostile templates.
#include "chat/jinja.h"

#include <chrono>
#include <fstream>
#include <sstream>

#include <gtest/gtest.h>

#include "common/compare.h"
#include "core/error.h"

namespace chimera::chat::jinja {
namespace {

using nlohmann::ordered_json;

std::string render(const std::string& src, const ordered_json& vars = ordered_json::object(), const Budget& b = {}) {
  return Template::parse(src, "t").render(vars, b);
}

// The error a template raises, or "" when it renders.
std::string error_of(const std::string& src, const ordered_json& vars = ordered_json::object(), const Budget& b = {}) {
  try {
    render(src, vars, b);
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidInput) << e.what();
    return e.what();
  }
  return "";
}

TEST(JinjaCases, MatchTransformersEnvironment) {
  std::ifstream in(test::source_path("tests/fixtures/chat_templates/jinja_cases.json"), std::ios::binary);
  ASSERT_TRUE(in.good());
  const ordered_json cases = ordered_json::parse(in)["cases"];
  size_t rendered = 0, raised = 0;
  for (const auto& c : cases) {
    const std::string src = c["template"].get<std::string>();
    if (c.contains("error")) {
      std::string err = error_of(src, c["vars"]);
      EXPECT_NE(err, "") << ordered_json(src).dump() << ": jinja2 raised " << c["error"].get<std::string>()
                         << " but this rendered";
      EXPECT_NE(err.find("t line "), std::string::npos) << err;  // every error names the template line
      ++raised;
      continue;
    }
    try {
      EXPECT_EQ(render(src, c["vars"]), c["expected"].get<std::string>()) << ordered_json(src).dump();
      ++rendered;
    } catch (const Error& e) {
      ADD_FAILURE() << ordered_json(src).dump() << ": " << e.what();
    }
  }
  EXPECT_GT(rendered, 40u);
  EXPECT_GT(raised, 10u);
}

TEST(JinjaErrors, NameTheLine) {
  EXPECT_NE(error_of("a\nb\n{{ 1 + }}").find("t line 3:"), std::string::npos);
  EXPECT_NE(error_of("x\n{% for m in messages %}\n{{ m }}").find("t line 2:"), std::string::npos);
  EXPECT_NE(error_of("x\n\n{{ raise_exception('Conversation roles must alternate') }}")
                .find("t line 3: raise_exception: Conversation roles must alternate"),
            std::string::npos);
  EXPECT_NE(
      error_of("{% if x %}\n{{ x.y.z }}\n{% endif %}", ordered_json::parse(R"({"x": {"a": 1}})")).find("t line 2:"),
      std::string::npos);
  EXPECT_NE(error_of("{{ 'abc' | nosuch }}").find("unknown filter 'nosuch'"), std::string::npos);
  EXPECT_NE(error_of("{# never closed").find("unclosed comment"), std::string::npos);
  EXPECT_NE(error_of("{% raw %}never closed").find("endraw"), std::string::npos);
  EXPECT_NE(error_of("{{ 'a' }").find("line 1"), std::string::npos);
  EXPECT_NE(error_of("{% include 'x.jinja' %}").find("unsupported tag 'include'"), std::string::npos);
}

TEST(JinjaAwkward, InputsThatRenderAsJinja2Does) {
  // Strings holding tag delimiters, braces inside expressions, the Nano v2 style '{{' inside a literal.
  EXPECT_EQ(render("{{ '}}' }}{{ \"{%\" }}{{ {'a': {'b': 1}}['a']['b'] }}"), "}}{%1");
  EXPECT_EQ(render("{{- '<TOOLCALL>[{{\"name\": 1}}]' -}}"), "<TOOLCALL>[{{\"name\": 1}}]");
  // Text that only looks like a tag.
  EXPECT_EQ(render("{ {a} }} %} #}"), "{ {a} }} %} #}");
  EXPECT_EQ(render("{"), "{");
  // Invalid UTF-8 passes through text and filters unchanged.
  EXPECT_EQ(render(std::string("\xff\xfe{{ s | trim }}"), ordered_json::parse(R"({"s": " x "})")), "\xff\xfex");
  // Empty template, template of only whitespace control.
  EXPECT_EQ(render(""), "");
  EXPECT_EQ(render("  {%- if true -%}  {%- endif -%}  "), "");
  // Keys with JSON order preserved, and non-ASCII kept by tojson.
  EXPECT_EQ(render("{{ v | tojson }}", ordered_json::parse(R"({"v": {"z": "ü", "a": 1.5}})")),
            "{\"z\": \"ü\", \"a\": 1.5}");
  // Large integers, negative zero, float formatting.
  EXPECT_EQ(render("{{ 9223372036854775807 }} {{ 2 ** 62 }} {{ 1e300 * 1e300 }} {{ 0.000123 }}"),
            "9223372036854775807 4611686018427387904 inf 0.000123");
}

TEST(JinjaBudget, HostileTemplatesStopWithAClearError) {
  using Clock = std::chrono::steady_clock;
  auto t0 = Clock::now();
  Budget small;
  small.max_steps = 200'000;
  small.max_output_bytes = 1 << 20;
  // Nested loops: 10^12 iterations.
  EXPECT_NE(error_of("{% for a in range(1000000) %}{% for b in range(1000000) %}x{% endfor %}{% endfor %}", {}, small)
                .find("work budget"),
            std::string::npos);
  // Unbounded macro recursion.
  EXPECT_NE(error_of("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}").find("recursed deeper"),
            std::string::npos);
  // Recursion whose every level nests deep expressions: the evaluation depth bound stops it before the stack.
  EXPECT_NE(error_of("{% macro f(n) %}{{ " + std::string(40, '[') + "f(n + 1)" + std::string(40, ']') +
                     " }}{% endmacro %}{{ f(0) }}")
                .find("nests too deeply"),
            std::string::npos);
  // A string that doubles every iteration.
  EXPECT_NE(error_of("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
                     {}, small)
                .find("budget"),
            std::string::npos);
  EXPECT_NE(error_of("{{ 'x' * 100000000000 }}").find("budget"), std::string::npos);
  EXPECT_NE(error_of("{{ range(100000000000) | length }}").find("budget"), std::string::npos);
  // Repeating nothing a huge number of times is nothing, at once (fuzz finding: an undefined name escaped to ''
  // times 77777777775 looped 7.7e10 times without growing the output); the same for an empty list.
  EXPECT_EQ(render("[{{ 77777777775 * (A777 | e) }}][{{ '' * 9223372036854775807 }}][{{ [] * 100000000000 }}]"),
            "[][][[]]");
  // Work that grows with the values built is charged too (fuzz finding: a 4-item list times 77777 inside a loop
  // copied 300,000 items per iteration under a 20,000-step budget and ran for 18 s).
  EXPECT_NE(
      error_of("{% for i in range(88) %}{{ 'abcd' | list * 77777 * 0 }}{% endfor %}", {}, small).find("work budget"),
      std::string::npos);
  EXPECT_NE(error_of("{% set l = range(60000) | list %}{% for i in range(100) %}{{ l | list | length }}{% endfor %}",
                     {}, small)
                .find("work budget"),
            std::string::npos);
  EXPECT_NE(error_of("{% set s = 'x' * 60000 %}{% for i in range(10000) %}{% set t = s ~ i %}{% endfor %}", {}, small)
                .find("work budget"),
            std::string::npos);
  EXPECT_EQ(render("{{ ('ab' | list) * 3 }} {{ [1] + [2] }} {{ 'a' ~ 'b' }}", {}, small),
            "['a', 'b', 'a', 'b', 'a', 'b'] [1, 2] ab");
  // Integer powers take log2(exponent) steps and stay exact, the sign included.
  EXPECT_EQ(render("{{ (-1) ** 9223372036854775807 }} {{ 1 ** 9223372036854775807 }} {{ (-3) ** 3 }} {{ 3 ** 39 }}"),
            "-1 1 -27 4052555153018976267");
  // Output past the budget.
  Budget narrow;
  narrow.max_output_bytes = 1 << 20;
  EXPECT_NE(error_of("{% for i in range(100000) %}0123456789abcdef{% endfor %}", {}, narrow).find("output exceeded"),
            std::string::npos);
  // Deep nesting in the parser is an error, not a stack overflow.
  EXPECT_NE(error_of("{{ " + std::string(100000, '(') + "1" + std::string(100000, ')') + " }}").find("nests deeper"),
            std::string::npos);
  EXPECT_EQ(render(std::string(5000, '[')), std::string(5000, '['));  // text, not an expression
  EXPECT_NE(error_of("{{ " + std::string(5000, '[')).find("t line 1: unexpected end of template"), std::string::npos);
  std::string deep_ifs;
  for (int i = 0; i < 1000; ++i) deep_ifs += "{% if true %}";
  EXPECT_NE(error_of(deep_ifs).find("nests deeper"), std::string::npos);
  EXPECT_NE(error_of("{{ " + std::string(50000, '-') + "1 }}").find("nests deeper"), std::string::npos);
  EXPECT_NE(error_of("{{ x" + std::string(50000, '|') + " }}").find("line 1"), std::string::npos);
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 20.0);
}

}  // namespace
}  // namespace chimera::chat::jinja
