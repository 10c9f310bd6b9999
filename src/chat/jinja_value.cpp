#include "chat/jinja_value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include "tokenizer/unicode.h"

namespace chimera::chat::jinja {

int64_t Value::as_int() const {
  if (is_bool()) return std::get<bool>(v) ? 1 : 0;
  return std::get<int64_t>(v);
}

double Value::as_double() const {
  if (is_float()) return std::get<double>(v);
  return static_cast<double>(as_int());
}

namespace {
constexpr size_t kIndexFrom = 16;  // below this a linear scan beats hashing
}

const Value* Dict::find(std::string_view key) const {
  if (!index_.empty()) {
    auto it = index_.find(std::string(key));
    return it == index_.end() ? nullptr : &entries[it->second].second;
  }
  for (const auto& [k, val] : entries) {
    if (k == key) return &val;
  }
  return nullptr;
}

void Dict::reindex() {
  index_.clear();
  for (size_t i = 0; i < entries.size(); ++i) index_[entries[i].first] = i;
}

void Dict::set(const std::string& key, Value value) {
  if (!index_.empty()) {
    auto it = index_.find(key);
    if (it != index_.end()) {
      entries[it->second].second = std::move(value);
      return;
    }
    index_[key] = entries.size();
    entries.emplace_back(key, std::move(value));
    return;
  }
  for (auto& [k, val] : entries) {
    if (k == key) {
      val = std::move(value);
      return;
    }
  }
  entries.emplace_back(key, std::move(value));
  if (entries.size() >= kIndexFrom) reindex();
}

Value make_list(List items) {
  return Value(std::make_shared<List>(std::move(items)));
}
Value make_tuple(List items) {
  Value v = make_list(std::move(items));
  v.tuple = true;
  return v;
}
Value make_dict() {
  return Value(std::make_shared<Dict>());
}

Value from_json(const nlohmann::ordered_json& j) {
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null: return Value(None{});
    case nlohmann::ordered_json::value_t::boolean: return Value(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer: return Value(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: {
      uint64_t u = j.get<uint64_t>();
      if (u <= static_cast<uint64_t>(INT64_MAX)) return Value(static_cast<int64_t>(u));
      return Value(static_cast<double>(u));
    }
    case nlohmann::ordered_json::value_t::number_float: return Value(j.get<double>());
    case nlohmann::ordered_json::value_t::string: return Value(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      List items;
      items.reserve(j.size());
      for (const auto& e : j) items.push_back(from_json(e));
      return make_list(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      auto d = std::make_shared<Dict>();
      for (const auto& [k, e] : j.items()) d->set(k, from_json(e));
      return Value(d);
    }
    default: return Value(None{});  // binary / discarded do not come from JSON text
  }
}

bool truthy(const Value& v) {
  return std::visit(
      [](const auto& x) -> bool {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, Undefined> || std::is_same_v<T, None>)
          return false;
        else if constexpr (std::is_same_v<T, bool>)
          return x;
        else if constexpr (std::is_same_v<T, int64_t>)
          return x != 0;
        else if constexpr (std::is_same_v<T, double>)
          return x != 0.0;
        else if constexpr (std::is_same_v<T, std::string>)
          return !x.empty();
        else if constexpr (std::is_same_v<T, ListPtr>)
          return !x->empty();
        else if constexpr (std::is_same_v<T, DictPtr>)
          return !x->entries.empty();
        else
          return true;
      },
      v.v);
}

bool equal(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) return a.as_double() == b.as_double();
    return a.as_int() == b.as_int();
  }
  if (a.v.index() != b.v.index()) return false;
  if (a.is_undefined() || a.is_none()) return true;
  if (a.is_string()) return a.str() == b.str();
  if (a.is_list()) {
    const List& x = *a.list();
    const List& y = *b.list();
    if (x.size() != y.size()) return false;
    for (size_t i = 0; i < x.size(); ++i) {
      if (!equal(x[i], y[i])) return false;
    }
    return true;
  }
  if (a.is_dict()) {
    const Dict& x = *a.dict();
    const Dict& y = *b.dict();
    if (x.entries.size() != y.entries.size()) return false;
    for (const auto& [k, val] : x.entries) {
      const Value* o = y.find(k);
      if (!o || !equal(val, *o)) return false;
    }
    return true;
  }
  if (a.is_namespace()) return a.ns() == b.ns();
  return a.callable() == b.callable();
}

const char* type_name(const Value& v) {
  switch (v.v.index()) {
    case 0: return "undefined";
    case 1: return "NoneType";
    case 2: return "bool";
    case 3: return "int";
    case 4: return "float";
    case 5: return "str";
    case 6: return "list";
    case 7: return "dict";
    case 8: return "Namespace";
    default: return "function";
  }
}

std::string py_float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d < 0 ? "-inf" : "inf";
  if (d == 0.0) return std::signbit(d) ? "-0.0" : "0.0";
  // Shortest round-trip digits, then Python's layout: fixed for 1e-4 <= |d| < 1e16, else d.ddde+XX.
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific);
  std::string sci(buf, res.ptr);
  bool neg = sci[0] == '-';
  if (neg) sci.erase(0, 1);
  size_t epos = sci.find('e');
  int exp10 = std::stoi(sci.substr(epos + 1));
  std::string digits;
  for (size_t i = 0; i < epos; ++i) {
    if (sci[i] != '.') digits += sci[i];
  }
  std::string out = neg ? "-" : "";
  if (exp10 >= -4 && exp10 < 16) {
    if (exp10 < 0) {
      out += "0.";
      out.append(static_cast<size_t>(-exp10 - 1), '0');
      out += digits;
    } else {
      size_t int_len = static_cast<size_t>(exp10) + 1;
      if (digits.size() <= int_len) {
        out += digits;
        out.append(int_len - digits.size(), '0');
        out += ".0";
      } else {
        out.append(digits, 0, int_len);
        out += '.';
        out.append(digits, int_len, std::string::npos);
      }
    }
    return out;
  }
  out += digits[0];
  if (digits.size() > 1) {
    out += '.';
    out.append(digits, 1, std::string::npos);
  }
  char ebuf[16];
  std::snprintf(ebuf, sizeof ebuf, "e%c%02d", exp10 < 0 ? '-' : '+', std::abs(exp10));
  return out + ebuf;
}

namespace {

// Invalid bytes map to U+DC80..U+DCFF (Python's surrogateescape) so that decode + encode round-trips.
constexpr uint32_t kEscapeBase = 0xDC00;

std::string repr_string(const std::string& s) {
  bool has_single = s.find('\'') != std::string::npos;
  bool has_double = s.find('"') != std::string::npos;
  char q = (has_single && !has_double) ? '"' : '\'';
  std::string out(1, q);
  for (uint32_t cp : utf8_decode(s)) {
    if (cp == static_cast<uint32_t>(q) || cp == '\\') {
      out += '\\';
      out += static_cast<char>(cp);
    } else if (cp == '\n') {
      out += "\\n";
    } else if (cp == '\r') {
      out += "\\r";
    } else if (cp == '\t') {
      out += "\\t";
    } else if (cp < 0x20 || (cp >= 0x7F && cp <= 0xA0) || cp == 0xAD) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", cp);
      out += buf;
    } else if ((cp >= 0x2028 && cp <= 0x2029) || (cp >= 0xD800 && cp <= 0xDFFF)) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", cp);
      out += buf;
    } else {
      tok::append_utf8(out, cp);
    }
  }
  out += q;
  return out;
}

void json_string(std::string& out, const std::string& s) {
  out += '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  out += '"';
}

struct JsonSeps {
  std::string item;
  std::string key;
};

void json_dump(std::string& out, const Value& v, int indent, bool sort_keys, const JsonSeps& seps, int level) {
  auto newline = [&](int lvl) {
    out += '\n';
    out.append(static_cast<size_t>(indent * lvl), ' ');
  };
  const std::string& item_sep = seps.item;
  if (v.is_none()) {
    out += "null";
  } else if (v.is_bool()) {
    out += std::get<bool>(v.v) ? "true" : "false";
  } else if (v.is_int()) {
    out += std::to_string(std::get<int64_t>(v.v));
  } else if (v.is_float()) {
    double d = std::get<double>(v.v);
    if (std::isnan(d))
      out += "NaN";
    else if (std::isinf(d))
      out += d < 0 ? "-Infinity" : "Infinity";
    else
      out += py_float_repr(d);
  } else if (v.is_string()) {
    json_string(out, v.str());
  } else if (v.is_list()) {
    const List& l = *v.list();
    if (l.empty()) {
      out += "[]";
      return;
    }
    out += '[';
    for (size_t i = 0; i < l.size(); ++i) {
      if (i) out += item_sep;
      if (indent >= 0) newline(level + 1);
      json_dump(out, l[i], indent, sort_keys, seps, level + 1);
    }
    if (indent >= 0) newline(level);
    out += ']';
  } else if (v.is_dict()) {
    const Dict& d = *v.dict();
    if (d.entries.empty()) {
      out += "{}";
      return;
    }
    std::vector<const std::pair<std::string, Value>*> order;
    for (const auto& e : d.entries) order.push_back(&e);
    if (sort_keys) {
      std::stable_sort(order.begin(), order.end(), [](auto* a, auto* b) { return a->first < b->first; });
    }
    out += '{';
    for (size_t i = 0; i < order.size(); ++i) {
      if (i) out += item_sep;
      if (indent >= 0) newline(level + 1);
      json_string(out, order[i]->first);
      out += seps.key;
      json_dump(out, order[i]->second, indent, sort_keys, seps, level + 1);
    }
    if (indent >= 0) newline(level);
    out += '}';
  } else {
    throw std::invalid_argument(std::string("Object of type ") + type_name(v) + " is not JSON serializable");
  }
}

}  // namespace

std::string to_json(const Value& v, int indent, bool sort_keys, const std::string* item_sep,
                    const std::string* key_sep) {
  JsonSeps seps{item_sep ? *item_sep : (indent >= 0 ? "," : ", "), key_sep ? *key_sep : ": "};
  std::string out;
  json_dump(out, v, indent, sort_keys, seps, 0);
  return out;
}

std::string py_repr(const Value& v) {
  if (v.is_string()) return repr_string(v.str());
  if (v.is_list()) {
    std::string out = v.tuple ? "(" : "[";
    const List& l = *v.list();
    for (size_t i = 0; i < l.size(); ++i) {
      if (i) out += ", ";
      out += py_repr(l[i]);
    }
    if (v.tuple && l.size() == 1) out += ',';
    out += v.tuple ? ")" : "]";
    return out;
  }
  if (v.is_dict()) {
    std::string out = "{";
    bool first = true;
    for (const auto& [k, val] : v.dict()->entries) {
      if (!first) out += ", ";
      first = false;
      out += repr_string(k) + ": " + py_repr(val);
    }
    return out + "}";
  }
  return py_str(v);
}

std::string py_str(const Value& v) {
  return std::visit(
      [&](const auto& x) -> std::string {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, Undefined>)
          return "";
        else if constexpr (std::is_same_v<T, None>)
          return "None";
        else if constexpr (std::is_same_v<T, bool>)
          return x ? "True" : "False";
        else if constexpr (std::is_same_v<T, int64_t>)
          return std::to_string(x);
        else if constexpr (std::is_same_v<T, double>)
          return py_float_repr(x);
        else if constexpr (std::is_same_v<T, std::string>)
          return x;
        else if constexpr (std::is_same_v<T, NamespacePtr>)
          return "<Namespace " + py_repr(Value([&] {
                   auto d = std::make_shared<Dict>(x->attrs);
                   return d;
                 }())) +
                 ">";
        else if constexpr (std::is_same_v<T, CallablePtr>)
          return "<function " + x->name + ">";
        else
          return py_repr(v);
      },
      v.v);
}

bool is_py_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

size_t utf8_sequence_at(std::string_view s, size_t i, uint32_t* cp_out) {
  unsigned char c = static_cast<unsigned char>(s[i]);
  int len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
  if (len == 0 || i + static_cast<size_t>(len) > s.size()) return 0;
  uint32_t cp = len == 1 ? c : len == 2 ? (c & 0x1F) : len == 3 ? (c & 0x0F) : (c & 0x07);
  for (int k = 1; k < len; ++k) {
    unsigned char cc = static_cast<unsigned char>(s[i + static_cast<size_t>(k)]);
    if ((cc >> 6) != 0x2) return 0;
    cp = (cp << 6) | (cc & 0x3F);
  }
  // Overlong forms, code points past U+10FFFF and surrogates are not UTF-8.
  static constexpr uint32_t kMin[5] = {0, 0, 0x80, 0x800, 0x10000};
  if (cp < kMin[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
  if (cp_out != nullptr) *cp_out = cp;
  return static_cast<size_t>(len);
}

std::vector<uint32_t> utf8_decode(std::string_view s) {
  std::vector<uint32_t> out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    uint32_t cp = 0;
    const size_t len = utf8_sequence_at(s, i, &cp);
    if (len == 0) {
      out.push_back(kEscapeBase + static_cast<unsigned char>(s[i]));
      ++i;
    } else {
      out.push_back(cp);
      i += len;
    }
  }
  return out;
}

std::string utf8_replace_invalid(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  size_t run = 0;  // start of the valid bytes not yet copied
  while (i < s.size()) {
    // ASCII runs eight bytes a test.
    uint64_t word = 0;
    if (i + 8 <= s.size() && (std::memcpy(&word, s.data() + i, 8), (word & 0x8080808080808080ull) == 0)) {
      i += 8;
      continue;
    }
    if (static_cast<unsigned char>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    const size_t len = utf8_sequence_at(s, i, nullptr);
    if (len > 0) {
      i += len;
      continue;
    }
    out.append(s, run, i - run);
    out += "\xEF\xBF\xBD";  // U+FFFD
    run = ++i;
  }
  out.append(s, run, std::string_view::npos);
  return out;
}

std::string utf8_encode(const std::vector<uint32_t>& cps, size_t begin, size_t end) {
  std::string out;
  for (size_t i = begin; i < end; ++i) {
    uint32_t cp = cps[i];
    if (cp >= kEscapeBase + 0x80 && cp <= kEscapeBase + 0xFF)
      out += static_cast<char>(cp - kEscapeBase);
    else
      tok::append_utf8(out, cp);
  }
  return out;
}

size_t utf8_length(std::string_view s) {
  size_t n = 0;
  bool ascii = true;
  for (char c : s) {
    if (static_cast<unsigned char>(c) >= 0x80) {
      ascii = false;
      break;
    }
  }
  if (ascii) return s.size();
  n = utf8_decode(s).size();
  return n;
}

std::string py_strip(std::string_view s, bool left, bool right, const std::string* chars) {
  std::vector<uint32_t> cps = utf8_decode(s);
  std::vector<uint32_t> set;
  if (chars) set = utf8_decode(*chars);
  auto strip_it = [&](uint32_t cp) {
    return chars ? std::find(set.begin(), set.end(), cp) != set.end() : is_py_space(cp);
  };
  size_t b = 0, e = cps.size();
  if (left) {
    while (b < e && strip_it(cps[b])) ++b;
  }
  if (right) {
    while (e > b && strip_it(cps[e - 1])) --e;
  }
  return utf8_encode(cps, b, e);
}

}  // namespace chimera::chat::jinja
