// Chat templates from hostile hands: input = template source, a NUL byte, then messages JSON (an array; the
// default conversation when absent or not an array). The first byte after the JSON's NUL, if any, picks
// add_generation_prompt / tools / enable_thinking. Rendering must end in an output or a kInvalidInput error
// naming the template line, within the work budget (no hang, no crash, no other exception); the output is then
// streamed through the reasoning and tool-call parsers, which must agree with their whole-output forms.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "chat/chat_template.h"
#include "chat/jinja.h"
#include "chat/reasoning_parser.h"
#include "chat/tool_call_parser.h"
#include "core/error.h"

namespace {

using nlohmann::ordered_json;

void finding(const char* what, const char* detail) {
  std::fprintf(stderr, "chat_template_fuzz: %s: %s\n", what, detail);
  std::abort();
}

void check_parsers(const std::string& text) {
  using namespace chimera::chat;
  // Streaming in two pieces agrees with the whole output (where vLLM's whole-output rule and streaming agree:
  // no <think> anywhere).
  const size_t cut = text.size() / 2;
  if (text.find("<think>") == std::string::npos) {
    ReasoningParser rp;
    ReasoningSplit a = rp.feed(std::string_view(text).substr(0, cut));
    ReasoningSplit b = rp.feed(std::string_view(text).substr(cut));
    ReasoningSplit c = rp.finish();
    ReasoningSplit whole = ReasoningParser::parse(text);
    if (a.reasoning + b.reasoning + c.reasoning != whole.reasoning ||
        a.content + b.content + c.content != whole.content) {
      finding("reasoning parser", "streamed split differs from the whole output");
    }
  }
  ToolCallParser tp(nullptr, 1);
  ToolCallDelta d1 = tp.feed(std::string_view(text).substr(0, cut));
  ToolCallDelta d2 = tp.feed(std::string_view(text).substr(cut));
  ToolCallDelta d3 = tp.finish();
  ToolCallResult whole = ToolCallParser(nullptr, 1).parse(text);
  if (d1.content + d2.content + d3.content != whole.content ||
      d1.tool_calls.size() + d2.tool_calls.size() + d3.tool_calls.size() != whole.tool_calls.size()) {
    finding("tool-call parser", "streamed split differs from the whole output");
  }
  for (const auto& call : whole.tool_calls) {
    if (!ordered_json::accept(call.arguments)) finding("tool-call parser", "arguments are not JSON");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace chimera;
  const std::string input(reinterpret_cast<const char*>(data), size);
  const size_t nul = input.find('\0');
  const std::string source = input.substr(0, nul);
  // The default conversation and tool list are parsed once: per input only the copy is paid.
  static const ordered_json kDefaultMessages = ordered_json::parse(R"([{"role": "system", "content": "sys"},
      {"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>r</think>a",
       "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]},
      {"role": "tool", "content": "42"}])");
  static const ordered_json kTools = ordered_json::parse(R"([{"type": "function", "function": {"name": "f",
      "description": "d", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}}])");
  ordered_json messages = kDefaultMessages;
  uint8_t flags = 0;
  if (nul != std::string::npos) {
    std::string rest = input.substr(nul + 1);
    const size_t nul2 = rest.find('\0');
    if (nul2 != std::string::npos && nul2 + 1 < rest.size()) flags = static_cast<uint8_t>(rest[nul2 + 1]);
    ordered_json parsed = ordered_json::parse(rest.substr(0, nul2), nullptr, false);
    if (!parsed.is_discarded() && parsed.is_array()) messages = std::move(parsed);
  }
  const ordered_json tools = (flags & 2) ? kTools : ordered_json(nullptr);
  ordered_json kwargs = ordered_json::object();
  if (flags & 4) kwargs["enable_thinking"] = (flags & 8) != 0;
  try {
    // The interpreter under a small budget (the server's is larger), so that each input runs in well under a
    // millisecond: outputs near 1 MiB made the parsers' passes over them cost ~5 ms an input under ASan. A loop
    // that the budget does not charge still hangs at any budget (the harness's timeout finds it), and the
    // parsers' linearity at server sizes has its own unit tests.
    chat::jinja::Budget budget;
    budget.max_steps = 20'000;
    budget.max_output_bytes = 64 << 10;
    budget.max_depth = 64;
    chat::jinja::Template t = chat::jinja::Template::parse(source, "fuzz");
    ordered_json vars = {{"messages", messages},
                         {"tools", tools},
                         {"add_generation_prompt", (flags & 1) != 0},
                         {"bos_token", "<s>"},
                         {"eos_token", "</s>"}};
    for (const auto& [k, v] : kwargs.items()) vars[k] = v;
    std::string out = t.render(vars, budget);
    check_parsers(out);
    // And the public entry point (default budget) on the same source when it is small.
    if (source.size() < 256) {
      chat::ChatTemplate ct = chat::ChatTemplate::from_string(source, "<s>", "</s>", "fuzz");
      (void)ct;
    }
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::kInvalidInput) finding("kRuntime error on bad input", e.what());
    if (std::string(e.what()).find("line ") == std::string::npos) finding("error without a line", e.what());
  }
  return 0;
}
