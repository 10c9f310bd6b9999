#include "chat/tool_call_parser.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>  // memrchr (glibc)
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "chat/jinja_value.h"

namespace chimera::chat {
namespace {

constexpr std::string_view kCallOpen = "<tool_call>";
constexpr std::string_view kCallClose = "</tool_call>";
constexpr std::string_view kFunctionOpen = "<function=";
constexpr std::string_view kFunctionClose = "</function>";
constexpr std::string_view kParamOpen = "<parameter=";
constexpr std::string_view kParamClose = "</parameter>";

size_t partial_tag_suffix(std::string_view s, std::string_view tag) {
  for (size_t n = std::min(s.size(), tag.size() - 1); n > 0; --n) {
    if (s.substr(s.size() - n) == tag.substr(0, n)) return n;
  }
  return 0;
}

std::string lower_trim(std::string s) {
  s = jinja::py_strip(s, true, true, nullptr);
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// The JSON-schema entry of parameter `param` of tool `name`; null when unknown.
const nlohmann::json* param_schema(const nlohmann::json& tools, const std::string& name, const std::string& param,
                                   bool* tool_has_properties) {
  *tool_has_properties = false;
  if (!tools.is_array()) return nullptr;
  for (const auto& t : tools) {
    if (!t.is_object()) continue;
    const nlohmann::json& fn = t.contains("function") && t["function"].is_object() ? t["function"] : t;
    if (!fn.contains("name") || !fn["name"].is_string() || fn["name"].get<std::string>() != name) continue;
    if (!fn.contains("parameters") || !fn["parameters"].is_object()) return nullptr;
    const auto& params = fn["parameters"];
    if (!params.contains("properties") || !params["properties"].is_object()) return nullptr;
    *tool_has_properties = true;
    auto it = params["properties"].find(param);
    return it == params["properties"].end() ? nullptr : &*it;
  }
  return nullptr;
}

// A parameter's text converted by its schema type, as vLLM's qwen3_coder parser does.
nlohmann::ordered_json convert_value(const std::string& value, const nlohmann::json* schema) {
  if (!schema || !schema->is_object()) return value;
  std::string type = "string";
  bool allows_null = false;
  auto type_of = [](const nlohmann::json& t) {
    return t.is_string() ? lower_trim(t.get<std::string>()) : std::string();
  };
  if (schema->contains("type")) {
    const auto& t = (*schema)["type"];
    if (t.is_array()) {  // ["integer", "null"]: the first non-null type
      bool picked = false;
      for (const auto& e : t) {
        std::string s = type_of(e);
        if (s == "null")
          allows_null = true;
        else if (!picked && !s.empty()) {
          type = s;
          picked = true;
        }
      }
    } else {
      type = type_of(t);
      allows_null = type == "null";
    }
  } else if (schema->contains("anyOf") && (*schema)["anyOf"].is_array()) {
    bool picked = false;
    for (const auto& opt : (*schema)["anyOf"]) {
      if (!opt.is_object() || !opt.contains("type")) continue;
      std::string s = type_of(opt["type"]);
      if (s == "null")
        allows_null = true;
      else if (!picked) {
        type = s;
        picked = true;
      }
    }
  }
  std::string lower = lower_trim(value);
  if (allows_null && (lower == "null" || lower == "none")) return nullptr;
  if (type == "string" || type == "str" || type == "text" || type == "varchar" || type == "char" || type == "enum") {
    return value;
  }
  if (lower == "null" || lower == "none") return nullptr;
  auto starts = [&](const char* p) { return type.rfind(p, 0) == 0; };
  if (starts("int") || starts("uint") || starts("long") || starts("short") || starts("unsigned")) {
    std::string t = jinja::py_strip(value, true, true, nullptr);
    t.erase(std::remove(t.begin(), t.end(), '_'), t.end());
    char* end = nullptr;
    errno = 0;
    long long v = std::strtoll(t.c_str(), &end, 10);
    if (!t.empty() && end == t.c_str() + t.size() && errno == 0) return static_cast<int64_t>(v);
    return value;
  }
  if (starts("num") || starts("float")) {
    std::string t = jinja::py_strip(value, true, true, nullptr);
    char* end = nullptr;
    double d = std::strtod(t.c_str(), &end);
    if (t.empty() || end != t.c_str() + t.size()) return value;
    if (std::isfinite(d) && d == std::trunc(d) && std::fabs(d) < 9.2e18) return static_cast<int64_t>(d);
    return d;
  }
  if (type == "boolean" || type == "bool" || type == "binary") return lower == "true";
  auto parsed = nlohmann::ordered_json::parse(value, nullptr, false);
  if (!parsed.is_discarded()) return parsed;
  return value;
}

// Model text is UTF-8 but a cut-off or hostile delta may not be: invalid bytes become U+FFFD so that the
// arguments are always valid JSON text.
std::string valid_utf8(std::string_view s) {
  return jinja::utf8_replace_invalid(s);
}

// body.rfind(tag) for a tag that starts with '<': only the '<' positions are compared (string_view::rfind compares
// the tag at every position from the end, a long output's worth of memcmp calls).
size_t last_tag(std::string_view body, std::string_view tag) {
  size_t end = body.size();
  while (end > 0) {
    const void* hit = memrchr(body.data(), '<', end);
    if (hit == nullptr) break;
    const size_t pos = static_cast<size_t>(static_cast<const char*>(hit) - body.data());
    if (body.substr(pos, tag.size()) == tag) return pos;
    end = pos;
  }
  return std::string_view::npos;
}

std::string strip_one_newline(std::string_view v) {
  if (!v.empty() && v.front() == '\n') v.remove_prefix(1);
  if (!v.empty() && v.back() == '\n') v.remove_suffix(1);
  return std::string(v);
}

}  // namespace

ToolCallParser::ToolCallParser(nlohmann::json tools, uint64_t id_seed) : tools_(std::move(tools)), id_state_(id_seed) {}

std::string ToolCallParser::next_id() {
  // splitmix64: distinct ids per parser; the server seeds it per request.
  auto mix = [this] {
    uint64_t z = (id_state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  };
  uint64_t a = mix(), b = mix();
  char buf[32];
  std::snprintf(buf, sizeof buf, "%016llx%08llx", static_cast<unsigned long long>(a),
                static_cast<unsigned long long>(b & 0xFFFFFFFFull));
  return std::string("call_") + buf;
}

bool ToolCallParser::parse_block(std::string_view raw_block, ToolCall& out) {
  const std::string fixed = valid_utf8(raw_block);
  std::string_view block = fixed;
  size_t f = block.find(kFunctionOpen);
  if (f == std::string_view::npos) return false;
  size_t name_end = block.find('>', f + kFunctionOpen.size());
  if (name_end == std::string_view::npos) return false;
  std::string name =
      jinja::py_strip(block.substr(f + kFunctionOpen.size(), name_end - f - kFunctionOpen.size()), true, true, nullptr);
  if (name.empty()) return false;
  std::string_view body = block.substr(name_end + 1);
  size_t fend = last_tag(body, kFunctionClose);
  if (fend != std::string_view::npos) body = body.substr(0, fend);
  nlohmann::ordered_json args = nlohmann::ordered_json::object();
  size_t pos = 0;
  // The first </parameter> at or after the search point, kept across parameters: values without a close tag (each
  // ends at the next <parameter=) would otherwise rescan the rest of the block once per parameter, quadratic in a
  // hostile or runaway output. npos once none is left.
  size_t close = 0;
  bool close_known = false;
  std::vector<std::pair<std::string, nlohmann::ordered_json>> args_in_order;
  std::unordered_map<std::string, size_t> arg_index;
  while (true) {
    size_t p = body.find(kParamOpen, pos);
    if (p == std::string_view::npos) break;
    size_t pname_end = body.find('>', p + kParamOpen.size());
    if (pname_end == std::string_view::npos) break;
    std::string pname =
        jinja::py_strip(body.substr(p + kParamOpen.size(), pname_end - p - kParamOpen.size()), true, true, nullptr);
    size_t vstart = pname_end + 1;
    // A value ends at </parameter>, else at the next <parameter= (a missing close tag), else at the end.
    if (!close_known || (close != std::string_view::npos && close < vstart)) {
      close = body.find(kParamClose, vstart);
      close_known = true;
    }
    size_t next_open = body.find(kParamOpen, vstart);
    size_t vend = close;
    if (vend == std::string_view::npos || (next_open != std::string_view::npos && next_open < vend)) {
      vend = next_open == std::string_view::npos ? body.size() : next_open;
      pos = vend;
    } else {
      pos = close + kParamClose.size();
    }
    std::string value = strip_one_newline(body.substr(vstart, vend - vstart));
    bool has_props = false;
    const nlohmann::json* schema = param_schema(tools_, name, pname, &has_props);
    // args[pname] = value (a repeated name keeps its first place, as a Python dict does), through a hash index:
    // ordered_json's own lookup is a linear scan, quadratic in a call with many parameters.
    auto [it, added] = arg_index.try_emplace(pname, args_in_order.size());
    if (added) {
      args_in_order.emplace_back(std::move(pname), convert_value(value, schema));
    } else {
      args_in_order[it->second].second = convert_value(value, schema);
    }
  }
  // ordered_map is a vector of pairs: appending the unique names in order builds the object without lookups.
  auto& object = args.get_ref<nlohmann::ordered_json::object_t&>();
  for (auto& [k, v] : args_in_order) object.emplace_back(k, std::move(v));
  out.id = next_id();
  out.name = std::move(name);
  // json.dumps(arguments, ensure_ascii=False): Python's separators and float repr.
  out.arguments = jinja::to_json(jinja::from_json(args), -1, false);
  return true;
}

ToolCallDelta ToolCallParser::feed(std::string_view delta) {
  ToolCallDelta out;
  out.first_index = num_calls_;
  pending_.append(delta);
  while (true) {
    if (!in_call_) {
      size_t open = pending_.find(kCallOpen);
      if (open == std::string::npos) {
        size_t hold = partial_tag_suffix(pending_, kCallOpen);
        // Text after the first tool call is not content (vLLM keeps only what precedes the calls).
        if (num_calls_ == 0 && out.tool_calls.empty()) out.content += pending_.substr(0, pending_.size() - hold);
        pending_.erase(0, pending_.size() - hold);
        return out;
      }
      if (num_calls_ == 0 && out.tool_calls.empty()) out.content += pending_.substr(0, open);
      pending_.erase(0, open + kCallOpen.size());
      in_call_ = true;
      scanned_ = 0;
    }
    // Only the bytes that arrived since the last search can complete "</tool_call>" (plus its length - 1 before
    // them): streaming a long call token by token stays linear.
    size_t close = pending_.find(kCallClose, scanned_ > kCallClose.size() ? scanned_ - kCallClose.size() + 1 : 0);
    if (close == std::string::npos) {
      scanned_ = pending_.size();
      return out;
    }
    scanned_ = 0;
    ToolCall call;
    if (parse_block(std::string_view(pending_).substr(0, close), call)) {
      out.tool_calls.push_back(std::move(call));
      ++num_calls_;
    }
    pending_.erase(0, close + kCallClose.size());
    in_call_ = false;
  }
}

ToolCallDelta ToolCallParser::finish() {
  ToolCallDelta out;
  out.first_index = num_calls_;
  if (in_call_) {
    ToolCall call;
    if (parse_block(pending_, call)) {
      out.tool_calls.push_back(std::move(call));
      ++num_calls_;
    } else if (num_calls_ == 0) {
      out.content = std::string(kCallOpen) + pending_;
    }
  } else if (num_calls_ == 0) {
    out.content = pending_;
  }
  pending_.clear();
  in_call_ = false;
  scanned_ = 0;
  return out;
}

ToolCallResult ToolCallParser::parse(std::string_view output) {
  ToolCallResult r;
  ToolCallDelta a = feed(output);
  ToolCallDelta b = finish();
  r.content = a.content + b.content;
  r.tool_calls = std::move(a.tool_calls);
  for (auto& c : b.tool_calls) r.tool_calls.push_back(std::move(c));
  return r;
}

}  // namespace chimera::chat
