// --tool-call-parser nemotron_v3 (vLLM's qwen3_coder format, which Nemotron 3's template teaches):
//   <tool_call>
//   <function=NAME>
//   <parameter=KEY>
//   VALUE
//   </parameter>
//   </function>
//   </tool_call>
// becomes OpenAI tool_calls [{id, type: "function", function: {name, arguments: JSON text}}]. Each VALUE
// (one leading and one trailing newline removed) is converted by the tool's JSON-schema type for KEY: string
// stays a string; integer / number / boolean / null parse; object / array parse as JSON; an unknown key or a
// value that does not parse stays a string. Text outside <tool_call> blocks is content.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace chimera::chat {

struct ToolCall {
  std::string id;  // "call_" + 24 hex digits, unique per parser
  std::string name;
  std::string arguments;  // a JSON object, serialized (ensure_ascii off, as vLLM's json.dumps)
};

struct ToolCallResult {
  std::string content;  // text outside the tool calls
  std::vector<ToolCall> tool_calls;
};

// A streaming step: content to emit and tool calls completed by this delta. Each completed call is sent whole
// (one OpenAI delta with index, id, type, name and the full arguments), which OpenAI clients accept.
struct ToolCallDelta {
  std::string content;
  std::vector<ToolCall> tool_calls;
  size_t first_index = 0;  // OpenAI `index` of tool_calls[0]; the rest follow consecutively
};

class ToolCallParser {
 public:
  // tools: the request's tools array (OpenAI shape), used for parameter types; null / empty is fine.
  // id_seed seeds the generated call ids (the server passes something per request).
  explicit ToolCallParser(nlohmann::json tools = nullptr, uint64_t id_seed = 0);

  ToolCallDelta feed(std::string_view delta);
  // End of output: an unterminated <tool_call> that still names a function is parsed as far as it goes;
  // otherwise its text is returned as content.
  ToolCallDelta finish();

  // The whole output at once (non-streaming responses).
  ToolCallResult parse(std::string_view output);

  size_t num_tool_calls() const { return num_calls_; }

 private:
  std::string next_id();
  bool parse_block(std::string_view raw_block, ToolCall& out);  // text between <tool_call> and </tool_call>

  nlohmann::json tools_;
  uint64_t id_state_;
  bool in_call_ = false;
  std::string pending_;  // content that may begin "<tool_call>", or the open call's text
  size_t scanned_ = 0;   // in a call: bytes of pending_ already searched for "</tool_call>"
  size_t num_calls_ = 0;
};

}  // namespace chimera::chat
