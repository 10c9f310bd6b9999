#include "chat/chat_template.h"

#include <fstream>
#include <sstream>

#include "chat/jinja.h"
#include "core/error.h"

namespace chimera::chat {
namespace {

using nlohmann::ordered_json;

std::string read_file(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  if (!f) invalid_input("{}: cannot read", p.string());
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// tokenizer_config.json stores special tokens as a string or as an AddedToken object {"content": ...}.
std::string token_string(const nlohmann::json& cfg, const char* key, const std::filesystem::path& file) {
  auto it = cfg.find(key);
  if (it == cfg.end() || it->is_null()) return "";
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) {
    return (*it)["content"].get<std::string>();
  }
  invalid_input("{}: \"{}\" must be a string or an object with \"content\"", file.string(), key);
}

// What apply_chat_template does to messages before rendering: keys whose value is None are dropped, and a
// message's reasoning under any of its names ("reasoning_content", "thinking", "reasoning") is also passed as
// "thinking" (first) and "reasoning_content" (last), i.e. {"thinking": r, **message, "reasoning_content": r}.
ordered_json normalize_messages(const ordered_json& messages) {
  static const char* kReasoningFields[] = {"reasoning_content", "thinking", "reasoning"};
  ordered_json out = ordered_json::array();
  for (const auto& m : messages) {
    if (!m.is_object()) invalid_input("chat template: each message must be an object, got {}", m.dump());
    ordered_json kept = ordered_json::object();
    for (const auto& [k, v] : m.items()) {
      if (!v.is_null()) kept[k] = v;
    }
    const ordered_json* reasoning = nullptr;
    for (const char* f : kReasoningFields) {
      if (kept.contains(f)) {
        reasoning = &kept[f];
        break;
      }
    }
    if (reasoning) {
      ordered_json aliased = ordered_json::object();
      aliased["thinking"] = *reasoning;
      for (const auto& [k, v] : kept.items()) aliased[k] = v;
      aliased["reasoning_content"] = *reasoning;
      kept = std::move(aliased);
    }
    out.push_back(std::move(kept));
  }
  return out;
}

}  // namespace

ChatTemplate ChatTemplate::from_string(std::string source, std::string bos_token, std::string eos_token,
                                       std::string origin) {
  ChatTemplate t;
  t.default_ = std::make_shared<const jinja::Template>(jinja::Template::parse(source, "chat template " + origin));
  t.bos_token_ = std::move(bos_token);
  t.eos_token_ = std::move(eos_token);
  return t;
}

std::optional<ChatTemplate> ChatTemplate::load(const std::filesystem::path& model_dir) {
  const std::filesystem::path cfg_path = model_dir / "tokenizer_config.json";
  const std::filesystem::path jinja_path = model_dir / "chat_template.jinja";
  nlohmann::json cfg = nlohmann::json::object();
  if (std::filesystem::exists(cfg_path)) {
    try {
      cfg = nlohmann::json::parse(read_file(cfg_path));
    } catch (const nlohmann::json::exception& e) {
      invalid_input("{}: malformed JSON: {}", cfg_path.string(), e.what());
    }
    if (!cfg.is_object()) invalid_input("{}: expected a JSON object", cfg_path.string());
  }
  ChatTemplate t;
  t.bos_token_ = token_string(cfg, "bos_token", cfg_path);
  t.eos_token_ = token_string(cfg, "eos_token", cfg_path);
  // transformers reads chat_template.jinja in preference to the tokenizer_config entry when both exist.
  if (std::filesystem::exists(jinja_path)) {
    t.default_ = std::make_shared<const jinja::Template>(
        jinja::Template::parse(read_file(jinja_path), "chat template " + jinja_path.string()));
    return t;
  }
  auto it = cfg.find("chat_template");
  if (it == cfg.end() || it->is_null()) return std::nullopt;
  const std::string origin = "chat template " + cfg_path.string();
  if (it->is_string()) {
    t.default_ = std::make_shared<const jinja::Template>(jinja::Template::parse(it->get<std::string>(), origin));
    return t;
  }
  if (!it->is_array() || it->empty()) {
    invalid_input("{}: \"chat_template\" must be a string or a non-empty list of {{name, template}}",
                  cfg_path.string());
  }
  std::shared_ptr<const jinja::Template> first;
  for (const auto& e : *it) {
    if (!e.is_object() || !e.contains("name") || !e.contains("template") || !e["name"].is_string() ||
        !e["template"].is_string()) {
      invalid_input("{}: each \"chat_template\" entry must be {{\"name\": string, \"template\": string}}",
                    cfg_path.string());
    }
    const std::string name = e["name"].get<std::string>();
    auto tpl = std::make_shared<const jinja::Template>(
        jinja::Template::parse(e["template"].get<std::string>(), origin + " [" + name + "]"));
    if (!first) first = tpl;
    if (name == "default") t.default_ = tpl;
    if (name == "tool_use") t.tool_use_ = tpl;
  }
  if (!t.default_) t.default_ = first;
  return t;
}

std::string ChatTemplate::render(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
                                 bool add_generation_prompt, const nlohmann::ordered_json& kwargs) const {
  if (!messages.is_array()) invalid_input("chat template: messages must be an array");
  if (messages.empty()) invalid_input("chat template: the conversation is empty (messages needs at least one message)");
  if (!tools.is_null() && !tools.is_array()) invalid_input("chat template: tools must be an array or null");
  if (!kwargs.is_null() && !kwargs.is_object()) invalid_input("chat template: chat_template_kwargs must be an object");
  // transformers picks the tool_use template whenever tools is not None, and passes tools through as given.
  const bool has_tools = !tools.is_null();
  // The variables apply_chat_template passes: special tokens, then messages / tools / documents /
  // add_generation_prompt, then the caller's kwargs (which may override any of them).
  nlohmann::ordered_json vars = nlohmann::ordered_json::object();
  vars["bos_token"] = bos_token_;
  vars["eos_token"] = eos_token_;
  vars["messages"] = normalize_messages(messages);
  vars["tools"] = tools;
  vars["documents"] = nullptr;
  vars["add_generation_prompt"] = add_generation_prompt;
  if (kwargs.is_object()) {
    for (const auto& [k, v] : kwargs.items()) vars[k] = v;
  }
  const jinja::Template& tpl = (has_tools && tool_use_) ? *tool_use_ : *default_;
  return tpl.render(vars);
}

std::string ChatTemplate::render(const nlohmann::json& messages, const nlohmann::json& tools,
                                 bool add_generation_prompt, const nlohmann::json& kwargs) const {
  return render(nlohmann::ordered_json::parse(messages.dump()), nlohmann::ordered_json::parse(tools.dump()),
                add_generation_prompt, nlohmann::ordered_json::parse(kwargs.dump()));
}

nlohmann::ordered_json tool_call_arguments_as_objects(const nlohmann::ordered_json& messages) {
  nlohmann::ordered_json out = messages;
  if (!out.is_array()) return out;
  for (auto& m : out) {
    if (!m.is_object() || !m.contains("tool_calls") || !m["tool_calls"].is_array()) continue;
    for (auto& call : m["tool_calls"]) {
      if (!call.is_object() || !call.contains("function") || !call["function"].is_object()) continue;
      auto& fn = call["function"];
      if (!fn.contains("arguments") || !fn["arguments"].is_string()) continue;
      auto parsed = nlohmann::ordered_json::parse(fn["arguments"].get<std::string>(), nullptr, false);
      if (!parsed.is_discarded() && parsed.is_object()) fn["arguments"] = std::move(parsed);
    }
  }
  return out;
}

}  // namespace chimera::chat
