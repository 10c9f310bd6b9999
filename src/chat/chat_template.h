// Chat templates: the checkpoint's own Jinja template (tokenizer_config.json "chat_template" or
// chat_template.jinja) rendered by the interpreter in jinja.h, with the variables transformers'
// apply_chat_template passes (messages, tools, add_generation_prompt, bos_token, eos_token, and every
// chat_template_kwargs entry as a top-level variable).
#pragma once

#include <filesystem>
#include <memory>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

namespace chimera::chat {

namespace jinja {
class Template;
}

class ChatTemplate {
 public:
  // Reads model_dir/tokenizer_config.json ("chat_template": a string, or a list of {"name", "template"} where
  // "default" (else the first) renders plain chats and "tool_use" renders requests that carry tools, as
  // transformers picks them) and, when tokenizer_config has none, model_dir/chat_template.jinja. bos_token /
  // eos_token come from tokenizer_config (a string or an AddedToken object {"content": ...}). nullopt when the
  // model has no template; a malformed file or template is Error kInvalidInput naming the file and line.
  static std::optional<ChatTemplate> load(const std::filesystem::path& model_dir);
  // One template from its source; origin names it in errors ("<string>" by default).
  static ChatTemplate from_string(std::string source, std::string bos_token, std::string eos_token,
                                  std::string origin = "<string>");

  // messages: array of OpenAI-shaped messages; tools: array of tools, or null for none (passed to the template
  // as given, like transformers: null is None, [] is an empty list); kwargs:
  // chat_template_kwargs (object or null), each key a template variable (enable_thinking, ...).
  // ordered_json keeps the request's key order, which `tojson` and `|items` expose in the prompt exactly as
  // transformers does with Python dicts: parse request bodies with nlohmann::ordered_json::parse.
  // Errors (a template error, raise_exception, a work budget exceeded) are Error kInvalidInput
  // "chat template <origin> line N: ...".
  std::string render(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
                     bool add_generation_prompt, const nlohmann::ordered_json& kwargs) const;
  // Same, from nlohmann::json (keys sorted alphabetically, as nlohmann::json stores them).
  std::string render(const nlohmann::json& messages, const nlohmann::json& tools, bool add_generation_prompt,
                     const nlohmann::json& kwargs) const;

  const std::string& bos_token() const { return bos_token_; }
  const std::string& eos_token() const { return eos_token_; }
  bool has_tool_use_variant() const { return tool_use_ != nullptr; }

 private:
  ChatTemplate() = default;
  std::shared_ptr<const jinja::Template> default_;
  std::shared_ptr<const jinja::Template> tool_use_;  // null unless the list form names one
  std::string bos_token_;
  std::string eos_token_;
};

// OpenAI clients send assistant tool_calls[].function.arguments as a JSON string; HF templates (Nemotron 3's
// `arguments|items`) expect a mapping. Returns messages with every such string that parses as a JSON object
// replaced by the object, as vLLM does before rendering; everything else is unchanged.
nlohmann::ordered_json tool_call_arguments_as_objects(const nlohmann::ordered_json& messages);

}  // namespace chimera::chat
