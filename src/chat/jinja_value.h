// Values of the Jinja interpreter, with Python's semantics where templates can observe them: str() / repr()
// text, truthiness, equality (1 == 1.0 == True), insertion-ordered dicts, and json.dumps for `tojson`.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

namespace chimera::chat::jinja {

struct Value;
struct Dict;
struct Namespace;
struct Callable;
using List = std::vector<Value>;
using ListPtr = std::shared_ptr<List>;
using DictPtr = std::shared_ptr<Dict>;
using NamespacePtr = std::shared_ptr<Namespace>;
using CallablePtr = std::shared_ptr<Callable>;

// The missing value: a name that is not defined, an absent key, an index out of range.
struct Undefined {
  std::string hint;  // what was looked up, for error messages ("message.tool_calls")
};
struct None {};

struct Value {
  std::variant<Undefined, None, bool, int64_t, double, std::string, ListPtr, DictPtr, NamespacePtr, CallablePtr> v;
  bool tuple = false;  // a list that Python would hold as a tuple: printed "(a, b)"

  Value() : v(Undefined{}) {}
  Value(None n) : v(n) {}
  Value(bool b) : v(b) {}
  Value(int64_t i) : v(i) {}
  Value(int i) : v(static_cast<int64_t>(i)) {}
  Value(double d) : v(d) {}
  Value(std::string s) : v(std::move(s)) {}
  Value(const char* s) : v(std::string(s)) {}
  Value(ListPtr l) : v(std::move(l)) {}
  Value(DictPtr d) : v(std::move(d)) {}
  Value(NamespacePtr n) : v(std::move(n)) {}
  Value(CallablePtr c) : v(std::move(c)) {}
  static Value undefined(std::string hint) {
    Value x;
    x.v = Undefined{std::move(hint)};
    return x;
  }

  bool is_undefined() const { return std::holds_alternative<Undefined>(v); }
  bool is_none() const { return std::holds_alternative<None>(v); }
  bool is_bool() const { return std::holds_alternative<bool>(v); }
  bool is_int() const { return std::holds_alternative<int64_t>(v); }
  bool is_float() const { return std::holds_alternative<double>(v); }
  bool is_number() const { return is_int() || is_float() || is_bool(); }  // bool is an int in Python
  bool is_string() const { return std::holds_alternative<std::string>(v); }
  bool is_list() const { return std::holds_alternative<ListPtr>(v); }
  bool is_dict() const { return std::holds_alternative<DictPtr>(v); }
  bool is_namespace() const { return std::holds_alternative<NamespacePtr>(v); }
  bool is_callable() const { return std::holds_alternative<CallablePtr>(v); }

  const std::string& str() const { return std::get<std::string>(v); }
  const ListPtr& list() const { return std::get<ListPtr>(v); }
  const DictPtr& dict() const { return std::get<DictPtr>(v); }
  const NamespacePtr& ns() const { return std::get<NamespacePtr>(v); }
  const CallablePtr& callable() const { return std::get<CallablePtr>(v); }
  int64_t as_int() const;    // bool / int (caller checks)
  double as_double() const;  // bool / int / float (caller checks)
};

// An insertion-ordered string-keyed mapping (Python dict as JSON and templates build it).
struct Dict {
  std::vector<std::pair<std::string, Value>> entries;
  const Value* find(std::string_view key) const;
  void set(const std::string& key, Value value);

 private:
  std::unordered_map<std::string, size_t> index_;  // built once the dict is large
  void reindex();
};

struct Namespace {
  Dict attrs;
};

struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;
};

class Interpreter;
struct Callable {
  std::string name;
  std::function<Value(Interpreter&, CallArgs&, int line)> fn;
};

Value make_list(List items = {});
Value make_tuple(List items);
Value make_dict();
Value from_json(const nlohmann::ordered_json& j);

bool truthy(const Value& v);
bool equal(const Value& a, const Value& b);
const char* type_name(const Value& v);  // Python's name ("str", "dict", "NoneType", "undefined", ...)

std::string py_str(const Value& v);   // str(v); undefined -> ""
std::string py_repr(const Value& v);  // repr(v)
std::string py_float_repr(double d);
// json.dumps(v, ensure_ascii=False, indent=indent (<0: None), separators, sort_keys). Null separators take
// Python's defaults: (", ", ": ") without indent, ("," , ": ") with it. Undefined / callables / namespaces
// throw std::invalid_argument naming the type.
std::string to_json(const Value& v, int indent, bool sort_keys, const std::string* item_sep = nullptr,
                    const std::string* key_sep = nullptr);

// UTF-8 helpers with Python's notion of whitespace (str.isspace) and code-point counts.
bool is_py_space(uint32_t cp);
// The length (1..4) of the well-formed UTF-8 sequence at s[i], its code point in *cp when cp is not null; 0 when the
// byte there starts none (a stray continuation byte, a cut-off, overlong or surrogate sequence, past U+10FFFF).
size_t utf8_sequence_at(std::string_view s, size_t i, uint32_t* cp);
std::vector<uint32_t> utf8_decode(std::string_view s);  // invalid bytes decode as themselves (U+DC80.. style)
// s with every byte that starts no well-formed sequence replaced by U+FFFD (one per byte, as decoding with
// errors="surrogateescape" and encoding those escapes as U+FFFD); valid text is copied unchanged, in one pass.
std::string utf8_replace_invalid(std::string_view s);
std::string utf8_encode(const std::vector<uint32_t>& cps, size_t begin, size_t end);
size_t utf8_length(std::string_view s);
std::string py_strip(std::string_view s, bool left, bool right, const std::string* chars);

}  // namespace chimera::chat::jinja
