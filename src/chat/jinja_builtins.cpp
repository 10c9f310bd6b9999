// Filters, tests, methods and globals: Jinja2's builtins that chat templates use, with Python's semantics, plus
// transformers' additions (tojson with ensure_ascii off, raise_exception, strftime_now).
#include <algorithm>
#include <cmath>
#include <ctime>
#include <stdexcept>

#include "chat/jinja_interp.h"
#include "core/error.h"

namespace chimera::chat::jinja {
namespace {

// Argument access by position or keyword name, with Python's "unexpected argument" errors.
class Args {
 public:
  Args(Interpreter& in, CallArgs& a, const std::string& fn, int line, std::vector<std::string> names)
      : in_(in), a_(a), fn_(fn), line_(line), names_(std::move(names)) {
    if (a_.positional.size() > names_.size()) {
      in_.fail(line_, fn_ + "() takes at most " + std::to_string(names_.size()) + " argument(s), got " +
                          std::to_string(a_.positional.size()));
    }
    for (const auto& [k, v] : a_.keyword) {
      if (std::find(names_.begin(), names_.end(), k) == names_.end()) {
        in_.fail(line_, fn_ + "() got an unexpected keyword argument '" + k + "'");
      }
    }
  }
  const Value* get(size_t i) const {
    if (i < a_.positional.size()) return &a_.positional[i];
    for (const auto& [k, v] : a_.keyword) {
      if (k == names_[i]) return &v;
    }
    return nullptr;
  }
  bool has(size_t i) const { return get(i) != nullptr && !get(i)->is_none(); }
  std::string str(size_t i, const std::string& def) const {
    const Value* v = get(i);
    if (!v || v->is_none()) return def;
    if (!v->is_string()) {
      in_.fail(line_, fn_ + "() argument '" + names_[i] + "' must be a string, not " + type_name(*v));
    }
    return v->str();
  }
  int64_t integer(size_t i, int64_t def) const {
    const Value* v = get(i);
    if (!v || v->is_none()) return def;
    if (!v->is_int() && !v->is_bool()) {
      in_.fail(line_, fn_ + "() argument '" + names_[i] + "' must be an integer, not " + type_name(*v));
    }
    return v->as_int();
  }
  bool boolean(size_t i, bool def) const {
    const Value* v = get(i);
    return v ? truthy(*v) : def;
  }

 private:
  Interpreter& in_;
  CallArgs& a_;
  const std::string& fn_;
  int line_;
  std::vector<std::string> names_;
};

std::string ascii_upper(std::string s) {
  for (char& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}
std::string ascii_lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}
std::string py_title(const std::string& s) {
  std::string out = s;
  bool prev_cased = false;
  for (char& c : out) {
    unsigned char u = static_cast<unsigned char>(c);
    bool alpha = std::isalpha(u) != 0;
    c = static_cast<char>(alpha ? (prev_cased ? std::tolower(u) : std::toupper(u)) : u);
    prev_cased = alpha;
  }
  return out;
}
std::string py_capitalize(const std::string& s) {
  std::string out = ascii_lower(s);
  if (!out.empty()) out[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(out[0])));
  return out;
}

std::string replace_all(Interpreter& in, const std::string& s, const std::string& from, const std::string& to,
                        int64_t count, int line) {
  std::string out;
  if (from.empty()) {
    // Python inserts `to` between every code point (and at both ends).
    std::vector<uint32_t> cps = utf8_decode(s);
    int64_t done = 0;
    for (size_t i = 0; i <= cps.size(); ++i) {
      if (count < 0 || done < count) {
        out += to;
        ++done;
      }
      if (i < cps.size()) out += utf8_encode(cps, i, i + 1);
      in.check_size(out.size(), line);
    }
    return out;
  }
  size_t pos = 0;
  int64_t done = 0;
  while (count < 0 || done < count) {
    size_t f = s.find(from, pos);
    if (f == std::string::npos) break;
    out.append(s, pos, f - pos);
    out += to;
    in.check_size(out.size(), line);
    pos = f + from.size();
    ++done;
  }
  out.append(s, pos, std::string::npos);
  return out;
}

Value py_split(Interpreter& in, const std::string& s, const Value* sep, int64_t maxsplit, int line) {
  List out;
  if (!sep || sep->is_none()) {
    std::vector<uint32_t> cps = utf8_decode(s);
    size_t i = 0;
    int64_t splits = 0;
    while (i < cps.size()) {
      while (i < cps.size() && is_py_space(cps[i])) ++i;
      if (i >= cps.size()) break;
      if (maxsplit >= 0 && splits >= maxsplit) {
        size_t e = cps.size();
        while (e > i && is_py_space(cps[e - 1])) --e;
        out.emplace_back(utf8_encode(cps, i, e));
        break;
      }
      size_t j = i;
      while (j < cps.size() && !is_py_space(cps[j])) ++j;
      out.emplace_back(utf8_encode(cps, i, j));
      ++splits;
      i = j;
    }
    return make_list(std::move(out));
  }
  if (!sep->is_string()) in.fail(line, std::string("split() separator must be a string, not ") + type_name(*sep));
  const std::string& d = sep->str();
  if (d.empty()) in.fail(line, "split(): empty separator");
  size_t pos = 0;
  int64_t splits = 0;
  while (maxsplit < 0 || splits < maxsplit) {
    size_t f = s.find(d, pos);
    if (f == std::string::npos) break;
    out.emplace_back(s.substr(pos, f - pos));
    pos = f + d.size();
    ++splits;
    in.step(line);
  }
  out.emplace_back(s.substr(pos));
  return make_list(std::move(out));
}

bool starts_or_ends(Interpreter& in, const std::string& s, const Value& arg, bool starts, int line) {
  auto one = [&](const Value& p) {
    if (!p.is_string()) in.fail(line, std::string(starts ? "startswith" : "endswith") + "() needs a string argument");
    const std::string& x = p.str();
    if (x.size() > s.size()) return false;
    return starts ? s.compare(0, x.size(), x) == 0 : s.compare(s.size() - x.size(), x.size(), x) == 0;
  };
  if (arg.is_list()) {
    for (const auto& p : *arg.list()) {
      if (one(p)) return true;
    }
    return false;
  }
  return one(arg);
}

std::string html_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

Value attribute_of(Interpreter& in, const Value& item, const std::string& path, int line) {
  // "a.b.0": dotted lookups, integer parts as indexes, as Jinja2's make_attrgetter.
  Value cur = item;
  size_t pos = 0;
  while (true) {
    size_t dot = path.find('.', pos);
    std::string part = path.substr(pos, dot == std::string::npos ? std::string::npos : dot - pos);
    if (cur.is_undefined()) return cur;
    bool digits = !part.empty() && std::all_of(part.begin(), part.end(),
                                               [](char c) { return std::isdigit(static_cast<unsigned char>(c)); });
    if (cur.is_dict()) {
      const Value* v = cur.dict()->find(part);
      cur = v ? *v : Value::undefined("'" + part + "'");
    } else if (cur.is_list() && digits) {
      size_t i = std::stoul(part);
      cur = i < cur.list()->size() ? (*cur.list())[i] : Value::undefined("index " + part);
    } else if (cur.is_namespace()) {
      const Value* v = cur.ns()->attrs.find(part);
      cur = v ? *v : Value::undefined("'" + part + "'");
    } else {
      cur = Value::undefined("'" + part + "'");
    }
    if (dot == std::string::npos) return cur;
    pos = dot + 1;
    in.step(line);
  }
}

// select / reject / selectattr / rejectattr share this: args after the attribute are (test, test args...).
Value select_items(Interpreter& in, const Value& seq, CallArgs& args, bool by_attr, bool keep, int line,
                   const std::string& fn) {
  size_t first_test = by_attr ? 1 : 0;
  std::string attr;
  if (by_attr) {
    if (args.positional.empty() || !args.positional[0].is_string()) in.fail(line, fn + "() needs an attribute name");
    attr = args.positional[0].str();
  }
  std::string test;
  CallArgs test_args;
  if (args.positional.size() > first_test) {
    if (!args.positional[first_test].is_string()) in.fail(line, fn + "() test name must be a string");
    test = args.positional[first_test].str();
    test_args.positional.assign(args.positional.begin() + static_cast<long>(first_test) + 1, args.positional.end());
  }
  List out;
  for (const auto& item : in.iterate(seq, line)) {
    in.step(line);
    Value subject = by_attr ? attribute_of(in, item, attr, line) : item;
    bool r = test.empty() ? truthy(subject) : apply_test(in, test, subject, test_args, line);
    if (r == keep) out.push_back(item);
  }
  return make_list(std::move(out));
}

int64_t parse_int_prefix(const std::string& s, bool& ok) {
  std::string t = py_strip(s, true, true, nullptr);
  t.erase(std::remove(t.begin(), t.end(), '_'), t.end());
  ok = false;
  if (t.empty()) return 0;
  size_t idx = 0;
  try {
    long long v = std::stoll(t, &idx, 10);
    ok = idx == t.size();
    return v;
  } catch (const std::exception&) {
    return 0;
  }
}

}  // namespace

int compare_values(Interpreter& in, const Value& a, const Value& b, int line) {
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) {
      double x = a.as_double(), y = b.as_double();
      return x < y ? -1 : x > y ? 1 : 0;
    }
    int64_t x = a.as_int(), y = b.as_int();
    return x < y ? -1 : x > y ? 1 : 0;
  }
  if (a.is_string() && b.is_string()) {
    int c = a.str().compare(b.str());
    return c < 0 ? -1 : c > 0 ? 1 : 0;
  }
  if (a.is_list() && b.is_list()) {
    const List& x = *a.list();
    const List& y = *b.list();
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (equal(x[i], y[i])) continue;
      return compare_values(in, x[i], y[i], line);
    }
    return x.size() < y.size() ? -1 : x.size() > y.size() ? 1 : 0;
  }
  if (a.is_undefined() || b.is_undefined()) {
    in.fail(line, std::get<Undefined>((a.is_undefined() ? a : b).v).hint + " is undefined (compared with '<')");
  }
  in.fail(line,
          std::string("'<' not supported between instances of '") + type_name(a) + "' and '" + type_name(b) + "'");
}

Value apply_filter(Interpreter& in, const std::string& name, const Value& v, CallArgs& ca, int line) {
  auto undefined_error = [&]() {
    if (v.is_undefined()) {
      in.fail(line, std::get<Undefined>(v.v).hint + " is undefined (filter '" + name + "')");
    }
  };
  if (name == "default" || name == "d") {
    Args a(in, ca, name, line, {"default_value", "boolean"});
    bool use_default = v.is_undefined() || (a.boolean(1, false) && !truthy(v));
    if (!use_default) return v;
    const Value* d = a.get(0);
    return d ? *d : Value(std::string());
  }
  if (name == "length" || name == "count") {
    Args a(in, ca, name, line, {});
    if (v.is_undefined()) return Value(int64_t{0});
    if (v.is_string()) return Value(static_cast<int64_t>(utf8_length(v.str())));
    if (v.is_list()) return Value(static_cast<int64_t>(v.list()->size()));
    if (v.is_dict()) return Value(static_cast<int64_t>(v.dict()->entries.size()));
    if (v.is_namespace()) return Value(static_cast<int64_t>(v.ns()->attrs.entries.size()));
    in.fail(line, std::string("object of type '") + type_name(v) + "' has no len()");
  }
  if (name == "string") {
    Args a(in, ca, name, line, {});
    return Value(py_str(v));
  }
  if (name == "safe") {
    Args a(in, ca, name, line, {});
    return v;
  }
  if (name == "trim") {
    Args a(in, ca, name, line, {"chars"});
    std::string chars;
    bool has = a.has(0);
    if (has) chars = a.str(0, "");
    return Value(py_strip(py_str(v), true, true, has ? &chars : nullptr));
  }
  if (name == "tojson") {
    Args a(in, ca, name, line, {"ensure_ascii", "indent", "separators", "sort_keys"});
    int indent = a.has(1) ? static_cast<int>(std::clamp<int64_t>(a.integer(1, -1), 0, 64)) : -1;
    std::string item_sep, key_sep;
    bool seps = a.has(2);
    if (seps) {
      const Value* s = a.get(2);
      if (!s->is_list() || s->list()->size() != 2 || !(*s->list())[0].is_string() || !(*s->list())[1].is_string()) {
        in.fail(line, "tojson() separators must be a pair of strings");
      }
      item_sep = (*s->list())[0].str();
      key_sep = (*s->list())[1].str();
    }
    try {
      return Value(to_json(v, indent, a.boolean(3, false), seps ? &item_sep : nullptr, seps ? &key_sep : nullptr));
    } catch (const std::invalid_argument& e) {
      in.fail(line, std::string("tojson: ") + e.what());
    }
  }
  if (name == "items") {
    Args a(in, ca, name, line, {});
    if (v.is_undefined()) return make_list();
    const Dict* d = v.is_dict() ? v.dict().get() : v.is_namespace() ? &v.ns()->attrs : nullptr;
    if (!d) in.fail(line, std::string("items filter needs a mapping, got ") + type_name(v));
    List out;
    for (const auto& [k, val] : d->entries) out.push_back(make_tuple({Value(k), val}));
    return make_list(std::move(out));
  }
  if (name == "upper" || name == "lower" || name == "title" || name == "capitalize") {
    Args a(in, ca, name, line, {});
    std::string s = py_str(v);
    if (name == "upper") return Value(ascii_upper(s));
    if (name == "lower") return Value(ascii_lower(s));
    if (name == "title") return Value(py_title(s));
    return Value(py_capitalize(s));
  }
  if (name == "escape" || name == "e" || name == "forceescape") {
    Args a(in, ca, name, line, {});
    return Value(html_escape(py_str(v)));
  }
  if (name == "join") {
    Args a(in, ca, name, line, {"d", "attribute"});
    std::string sep = a.str(0, "");
    std::string attr = a.str(1, "");
    std::string out;
    bool first = true;
    for (const auto& item : in.iterate(v, line)) {
      if (!first) out += sep;
      first = false;
      out += py_str(attr.empty() ? item : attribute_of(in, item, attr, line));
      in.check_size(out.size(), line);
      in.step(line);
    }
    return Value(out);
  }
  if (name == "replace") {
    Args a(in, ca, name, line, {"old", "new", "count"});
    undefined_error();
    return Value(replace_all(in, py_str(v), a.str(0, ""), a.str(1, ""), a.integer(2, -1), line));
  }
  if (name == "list") {
    Args a(in, ca, name, line, {});
    return make_list(in.iterate(v, line));
  }
  if (name == "first" || name == "last") {
    Args a(in, ca, name, line, {});
    std::vector<Value> items = in.iterate(v, line);
    if (items.empty()) return Value::undefined("the " + name + " item of an empty sequence");
    return name == "first" ? items.front() : items.back();
  }
  if (name == "reverse") {
    Args a(in, ca, name, line, {});
    if (v.is_string()) {
      std::vector<uint32_t> cps = utf8_decode(v.str());
      std::reverse(cps.begin(), cps.end());
      return Value(utf8_encode(cps, 0, cps.size()));
    }
    std::vector<Value> items = in.iterate(v, line);
    std::reverse(items.begin(), items.end());
    return make_list(std::move(items));
  }
  if (name == "unique") {
    Args a(in, ca, name, line, {"case_sensitive", "attribute"});
    List out;
    for (const auto& item : in.iterate(v, line)) {
      in.step(line);
      bool seen = false;
      for (const auto& o : out) {
        if (equal(o, item)) {
          seen = true;
          break;
        }
      }
      if (!seen) out.push_back(item);
    }
    return make_list(std::move(out));
  }
  if (name == "sort" || name == "dictsort") {
    bool dictsort = name == "dictsort";
    Args a(in, ca, name, line,
           dictsort ? std::vector<std::string>{"case_sensitive", "by", "reverse"}
                    : std::vector<std::string>{"reverse", "case_sensitive", "attribute"});
    std::vector<Value> items;
    if (dictsort) {
      if (!v.is_dict()) in.fail(line, "dictsort needs a mapping");
      for (const auto& [k, val] : v.dict()->entries) items.push_back(make_tuple({Value(k), val}));
    } else {
      items = in.iterate(v, line);
    }
    bool reverse = dictsort ? a.boolean(2, false) : a.boolean(0, false);
    std::string attr = dictsort ? "" : a.str(2, "");
    bool by_value = dictsort && a.str(1, "key") == "value";
    auto key = [&](const Value& x) {
      if (dictsort) return (*x.list())[by_value ? 1 : 0];
      return attr.empty() ? x : attribute_of(in, x, attr, line);
    };
    std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
      in.step(line);
      int c = compare_values(in, key(x), key(y), line);
      return reverse ? c > 0 : c < 0;
    });
    return make_list(std::move(items));
  }
  if (name == "int") {
    Args a(in, ca, name, line, {"default", "base"});
    int64_t def = a.integer(0, 0);
    if (v.is_int()) return v;
    if (v.is_bool()) return Value(v.as_int());
    if (v.is_float()) {
      double d = v.as_double();
      if (!std::isfinite(d) || std::fabs(d) > 9.2e18) return Value(def);
      return Value(static_cast<int64_t>(d));
    }
    if (v.is_string()) {
      bool ok = false;
      int64_t r = parse_int_prefix(v.str(), ok);
      if (ok) return Value(r);
      char* end = nullptr;
      std::string t = py_strip(v.str(), true, true, nullptr);
      double d = std::strtod(t.c_str(), &end);
      if (!t.empty() && end == t.c_str() + t.size() && std::isfinite(d) && std::fabs(d) < 9.2e18) {
        return Value(static_cast<int64_t>(d));
      }
    }
    return Value(def);
  }
  if (name == "float") {
    Args a(in, ca, name, line, {"default"});
    if (v.is_number()) return Value(v.as_double());
    if (v.is_string()) {
      std::string t = py_strip(v.str(), true, true, nullptr);
      char* end = nullptr;
      double d = std::strtod(t.c_str(), &end);
      if (!t.empty() && end == t.c_str() + t.size()) return Value(d);
    }
    const Value* d = a.get(0);
    return d ? *d : Value(0.0);
  }
  if (name == "abs") {
    Args a(in, ca, name, line, {});
    if (v.is_float()) return Value(std::fabs(v.as_double()));
    if (v.is_number()) {
      int64_t x = v.as_int();
      return x == INT64_MIN ? Value(-static_cast<double>(x)) : Value(x < 0 ? -x : x);
    }
    in.fail(line, std::string("bad operand type for abs(): '") + type_name(v) + "'");
  }
  if (name == "round") {
    Args a(in, ca, name, line, {"precision", "method"});
    if (!v.is_number()) in.fail(line, std::string("round needs a number, got ") + type_name(v));
    int64_t prec = std::clamp<int64_t>(a.integer(0, 0), -20, 20);
    std::string method = a.str(1, "common");
    double m = std::pow(10.0, static_cast<double>(prec));
    double x = v.as_double() * m;
    // "common" is Python's round(): halves go to the even neighbour.
    double r = method == "ceil" ? std::ceil(x) : method == "floor" ? std::floor(x) : std::nearbyint(x);
    return Value(r / m);
  }
  if (name == "select" || name == "reject") return select_items(in, v, ca, false, name == "select", line, name);
  if (name == "selectattr" || name == "rejectattr") {
    return select_items(in, v, ca, true, name == "selectattr", line, name);
  }
  if (name == "map") {
    List out;
    const Value* attr = nullptr;
    const Value* def = nullptr;
    for (const auto& [k, val] : ca.keyword) {
      if (k == "attribute")
        attr = &val;
      else if (k == "default")
        def = &val;
    }
    if (attr) {
      if (!attr->is_string()) in.fail(line, "map(attribute=...) needs a string");
      for (const auto& item : in.iterate(v, line)) {
        in.step(line);
        Value x = attribute_of(in, item, attr->str(), line);
        out.push_back(x.is_undefined() && def ? *def : x);
      }
      return make_list(std::move(out));
    }
    if (ca.positional.empty() || !ca.positional[0].is_string())
      in.fail(line, "map() needs a filter name or attribute=");
    std::string filter = ca.positional[0].str();
    CallArgs rest;
    rest.positional.assign(ca.positional.begin() + 1, ca.positional.end());
    rest.keyword = ca.keyword;
    for (const auto& item : in.iterate(v, line)) {
      in.step(line);
      CallArgs copy = rest;
      out.push_back(apply_filter(in, filter, item, copy, line));
    }
    return make_list(std::move(out));
  }
  if (name == "sum") {
    Args a(in, ca, name, line, {"attribute", "start"});
    std::string attr = a.str(0, "");
    Value acc = a.get(1) ? *a.get(1) : Value(int64_t{0});
    for (const auto& item : in.iterate(v, line)) {
      in.step(line);
      Value x = attr.empty() ? item : attribute_of(in, item, attr, line);
      if (!acc.is_number() || !x.is_number()) in.fail(line, "sum() needs numbers");
      acc = acc.is_float() || x.is_float() ? Value(acc.as_double() + x.as_double()) : Value(acc.as_int() + x.as_int());
    }
    return acc;
  }
  if (name == "min" || name == "max") {
    Args a(in, ca, name, line, {"case_sensitive", "attribute"});
    std::vector<Value> items = in.iterate(v, line);
    if (items.empty()) return Value::undefined("the " + name + " of an empty sequence");
    Value best = items[0];
    for (const auto& x : items) {
      int c = compare_values(in, x, best, line);
      if (name == "min" ? c < 0 : c > 0) best = x;
    }
    return best;
  }
  if (name == "attr") {
    Args a(in, ca, name, line, {"name"});
    std::string n = a.str(0, "");
    if (v.is_dict()) {
      const Value* x = v.dict()->find(n);
      return x ? *x : Value::undefined("'" + n + "'");
    }
    if (v.is_namespace()) {
      const Value* x = v.ns()->attrs.find(n);
      return x ? *x : Value::undefined("'" + n + "'");
    }
    return Value::undefined("'" + n + "'");
  }
  if (name == "indent") {
    Args a(in, ca, name, line, {"width", "first", "blank"});
    std::string pad = a.get(0) && a.get(0)->is_string()
                          ? a.get(0)->str()
                          : std::string(static_cast<size_t>(std::clamp<int64_t>(a.integer(0, 4), 0, 1024)), ' ');
    bool first = a.boolean(1, false), blank = a.boolean(2, false);
    std::string s = py_str(v);
    std::string out;
    size_t pos = 0;
    bool is_first = true;
    while (true) {
      size_t nl = s.find('\n', pos);
      std::string ln = s.substr(pos, nl == std::string::npos ? std::string::npos : nl - pos);
      bool indent_it = (is_first ? first : true) && (blank || !py_strip(ln, true, true, nullptr).empty());
      if (indent_it) out += pad;
      out += ln;
      in.check_size(out.size(), line);
      if (nl == std::string::npos) break;
      out += '\n';
      pos = nl + 1;
      is_first = false;
    }
    return Value(out);
  }
  if (name == "wordcount") {
    Args a(in, ca, name, line, {});
    Value words = py_split(in, py_str(v), nullptr, -1, line);
    return Value(static_cast<int64_t>(words.list()->size()));
  }
  in.fail(line, "unknown filter '" + name + "'");
}

bool apply_test(Interpreter& in, const std::string& name, const Value& v, CallArgs& ca, int line) {
  auto arg = [&](size_t i) -> const Value& {
    if (i >= ca.positional.size()) in.fail(line, "test '" + name + "' needs an argument");
    return ca.positional[i];
  };
  if (name == "defined") return !v.is_undefined();
  if (name == "undefined") return v.is_undefined();
  if (name == "none") return v.is_none();
  if (name == "boolean") return v.is_bool();
  if (name == "true") return v.is_bool() && std::get<bool>(v.v);
  if (name == "false") return v.is_bool() && !std::get<bool>(v.v);
  if (name == "integer") return v.is_int();
  if (name == "float") return v.is_float();
  if (name == "number") return v.is_number();
  if (name == "string") return v.is_string();
  if (name == "mapping") return v.is_dict();
  if (name == "iterable") return v.is_list() || v.is_dict() || v.is_string() || v.is_undefined();
  if (name == "sequence") return v.is_list() || v.is_dict() || v.is_string();
  if (name == "callable") return v.is_callable();
  if (name == "escaped") return false;
  if (name == "lower" || name == "upper") {
    if (!v.is_string()) return false;
    const std::string& s = v.str();
    bool cased = false;
    for (char c : s) {
      unsigned char u = static_cast<unsigned char>(c);
      if (std::isalpha(u)) {
        cased = true;
        if (name == "lower" ? std::isupper(u) : std::islower(u)) return false;
      }
    }
    return cased;
  }
  if (name == "even" || name == "odd" || name == "divisibleby") {
    if (!v.is_int() && !v.is_bool()) in.fail(line, "test '" + name + "' needs an integer, got " + type_name(v));
    int64_t x = v.as_int();
    if (name == "even") return x % 2 == 0;
    if (name == "odd") return x % 2 != 0;
    const Value& d = arg(0);
    if (!d.is_int() || d.as_int() == 0) in.fail(line, "divisibleby needs a non-zero integer");
    return x % d.as_int() == 0;
  }
  if (name == "eq" || name == "equalto" || name == "==") return equal(v, arg(0));
  if (name == "ne" || name == "!=") return !equal(v, arg(0));
  if (name == "sameas") {
    const Value& o = arg(0);
    if (v.v.index() != o.v.index()) return false;
    if (v.is_none() || v.is_undefined()) return true;
    if (v.is_bool()) return std::get<bool>(v.v) == std::get<bool>(o.v);
    if (v.is_list()) return v.list() == o.list();
    if (v.is_dict()) return v.dict() == o.dict();
    return equal(v, o);
  }
  if (name == "lt" || name == "lessthan" || name == "<") return compare_values(in, v, arg(0), line) < 0;
  if (name == "le" || name == "<=") return compare_values(in, v, arg(0), line) <= 0;
  if (name == "gt" || name == "greaterthan" || name == ">") return compare_values(in, v, arg(0), line) > 0;
  if (name == "ge" || name == ">=") return compare_values(in, v, arg(0), line) >= 0;
  if (name == "in") {
    const Value& c = arg(0);
    if (c.is_string()) return v.is_string() && c.str().find(v.str()) != std::string::npos;
    if (c.is_list()) {
      for (const auto& e : *c.list()) {
        if (equal(e, v)) return true;
      }
      return false;
    }
    if (c.is_dict()) return v.is_string() && c.dict()->find(v.str()) != nullptr;
    return false;
  }
  in.fail(line, "unknown test '" + name + "'");
}

bool has_method(const Value& obj, const std::string& name) {
  static const char* kStr[] = {"strip",    "lstrip",  "rstrip",     "split",   "rsplit",     "replace",   "startswith",
                               "endswith", "upper",   "lower",      "title",   "capitalize", "find",      "rfind",
                               "count",    "join",    "splitlines", "isdigit", "isalpha",    "isalnum",   "isspace",
                               "islower",  "isupper", "format",     "index",   "rindex",     "partition", "rpartition"};
  static const char* kDict[] = {"get", "items",  "keys",       "values", "copy",
                                "pop", "update", "setdefault", "clear",  "popitem"};
  static const char* kList[] = {"append", "extend",  "insert", "pop",   "remove", "clear",
                                "sort",   "reverse", "index",  "count", "copy"};
  auto in_set = [&](auto& set) {
    for (const char* m : set) {
      if (name == m) return true;
    }
    return false;
  };
  if (obj.is_string()) return in_set(kStr);
  if (obj.is_dict()) return in_set(kDict);
  if (obj.is_list()) return in_set(kList);
  return false;
}

Value call_method(Interpreter& in, const Value& obj, const std::string& name, CallArgs& ca, int line) {
  const std::string fn = std::string(type_name(obj)) + "." + name;
  if (obj.is_string()) {
    const std::string& s = obj.str();
    if (name == "strip" || name == "lstrip" || name == "rstrip") {
      Args a(in, ca, fn, line, {"chars"});
      std::string chars;
      bool has = a.has(0);
      if (has) chars = a.str(0, "");
      return Value(py_strip(s, name != "rstrip", name != "lstrip", has ? &chars : nullptr));
    }
    if (name == "split" || name == "rsplit") {
      Args a(in, ca, fn, line, {"sep", "maxsplit"});
      int64_t maxsplit = a.integer(1, -1);
      if (name == "rsplit" && maxsplit >= 0) {
        // Split from the right: reverse, split with the reversed separator, reverse back.
        const Value* sep = a.get(0);
        if (sep && sep->is_string() && !sep->str().empty()) {
          std::string rs(s.rbegin(), s.rend());
          std::string rsep(sep->str().rbegin(), sep->str().rend());
          Value rsepv(rsep);
          Value parts = py_split(in, rs, &rsepv, maxsplit, line);
          List out;
          for (auto it = parts.list()->rbegin(); it != parts.list()->rend(); ++it) {
            out.emplace_back(std::string(it->str().rbegin(), it->str().rend()));
          }
          return make_list(std::move(out));
        }
      }
      return py_split(in, s, a.get(0), maxsplit, line);
    }
    if (name == "replace") {
      Args a(in, ca, fn, line, {"old", "new", "count"});
      return Value(replace_all(in, s, a.str(0, ""), a.str(1, ""), a.integer(2, -1), line));
    }
    if (name == "startswith" || name == "endswith") {
      Args a(in, ca, fn, line, {"prefix"});
      if (!a.get(0)) in.fail(line, fn + "() needs an argument");
      return Value(starts_or_ends(in, s, *a.get(0), name == "startswith", line));
    }
    if (name == "upper") return Value(ascii_upper(s));
    if (name == "lower") return Value(ascii_lower(s));
    if (name == "title") return Value(py_title(s));
    if (name == "capitalize") return Value(py_capitalize(s));
    if (name == "find" || name == "rfind" || name == "index" || name == "rindex" || name == "count") {
      Args a(in, ca, fn, line, {"sub"});
      std::string sub = a.str(0, "");
      if (name == "count") {
        if (sub.empty()) return Value(static_cast<int64_t>(utf8_length(s) + 1));
        int64_t n = 0;
        for (size_t p = s.find(sub); p != std::string::npos; p = s.find(sub, p + sub.size())) ++n;
        return Value(n);
      }
      size_t p = (name == "find" || name == "index") ? s.find(sub) : s.rfind(sub);
      if (p == std::string::npos) {
        if (name == "index" || name == "rindex") in.fail(line, "substring not found");
        return Value(int64_t{-1});
      }
      return Value(static_cast<int64_t>(utf8_length(std::string_view(s).substr(0, p))));
    }
    if (name == "join") {
      Args a(in, ca, fn, line, {"iterable"});
      if (!a.get(0)) in.fail(line, fn + "() needs an argument");
      std::string out;
      bool first = true;
      for (const auto& item : in.iterate(*a.get(0), line)) {
        if (!item.is_string()) in.fail(line, std::string("join() expects strings, found ") + type_name(item));
        if (!first) out += s;
        first = false;
        out += item.str();
        in.check_size(out.size(), line);
      }
      return Value(out);
    }
    if (name == "splitlines") {
      List out;
      size_t pos = 0;
      while (pos < s.size()) {
        size_t nl = s.find_first_of("\n\r", pos);
        if (nl == std::string::npos) {
          out.emplace_back(s.substr(pos));
          break;
        }
        out.emplace_back(s.substr(pos, nl - pos));
        pos = nl + (s[nl] == '\r' && nl + 1 < s.size() && s[nl + 1] == '\n' ? 2 : 1);
      }
      return make_list(std::move(out));
    }
    if (name == "partition" || name == "rpartition") {
      Args a(in, ca, fn, line, {"sep"});
      std::string sep = a.str(0, "");
      if (sep.empty()) in.fail(line, "empty separator");
      size_t p = name == "partition" ? s.find(sep) : s.rfind(sep);
      if (p == std::string::npos) {
        return name == "partition" ? make_tuple({Value(s), Value(""), Value("")})
                                   : make_tuple({Value(""), Value(""), Value(s)});
      }
      return make_tuple({Value(s.substr(0, p)), Value(sep), Value(s.substr(p + sep.size()))});
    }
    if (name.rfind("is", 0) == 0) {
      std::vector<uint32_t> cps = utf8_decode(s);
      if (cps.empty()) return Value(false);
      auto all = [&](auto pred) { return std::all_of(cps.begin(), cps.end(), pred); };
      auto ascii = [](uint32_t c, int (*f)(int)) { return c < 0x80 && f(static_cast<int>(c)) != 0; };
      if (name == "isdigit") return Value(all([&](uint32_t c) { return ascii(c, ::isdigit); }));
      if (name == "isalpha") return Value(all([&](uint32_t c) { return ascii(c, ::isalpha); }));
      if (name == "isalnum") return Value(all([&](uint32_t c) { return ascii(c, ::isalnum); }));
      if (name == "isspace") return Value(all([](uint32_t c) { return is_py_space(c); }));
      Value sv(s);
      CallArgs none;
      return Value(apply_test(in, name == "islower" ? "lower" : "upper", sv, none, line));
    }
    in.fail(line, "str." + name + "() is not supported");
  }
  if (obj.is_dict()) {
    const Dict& d = *obj.dict();
    if (name == "get") {
      Args a(in, ca, fn, line, {"key", "default"});
      const Value* k = a.get(0);
      if (!k) in.fail(line, "dict.get() needs a key");
      const Value* found = k->is_string() ? d.find(k->str()) : nullptr;
      if (found) return *found;
      return a.get(1) ? *a.get(1) : Value(None{});
    }
    if (name == "items" || name == "keys" || name == "values") {
      Args a(in, ca, fn, line, {});
      List out;
      for (const auto& [k, val] : d.entries) {
        if (name == "items")
          out.push_back(make_tuple({Value(k), val}));
        else if (name == "keys")
          out.emplace_back(k);
        else
          out.push_back(val);
      }
      return make_list(std::move(out));
    }
    if (name == "copy") {
      Args a(in, ca, fn, line, {});
      return Value(std::make_shared<Dict>(d));
    }
  }
  if (obj.is_list()) {
    const List& l = *obj.list();
    if (name == "index" || name == "count") {
      Args a(in, ca, fn, line, {"value"});
      if (!a.get(0)) in.fail(line, fn + "() needs an argument");
      int64_t n = 0;
      for (size_t i = 0; i < l.size(); ++i) {
        if (equal(l[i], *a.get(0))) {
          if (name == "index") return Value(static_cast<int64_t>(i));
          ++n;
        }
      }
      if (name == "index") in.fail(line, "list.index(x): x not in list");
      return Value(n);
    }
    if (name == "copy") return make_list(l);
  }
  // What is left mutates: transformers renders in an ImmutableSandboxedEnvironment, which refuses it.
  in.fail(line, "access to " + fn + "() is unsafe: the template environment is immutable");
}

Value global_function(const std::string& name) {
  static const std::vector<std::string> kNames = {"range", "namespace", "dict", "raise_exception", "strftime_now"};
  if (std::find(kNames.begin(), kNames.end(), name) == kNames.end()) return Value();
  auto c = std::make_shared<Callable>();
  c->name = name;
  if (name == "range") {
    c->fn = [](Interpreter& in, CallArgs& a, int line) -> Value {
      if (!a.keyword.empty() || a.positional.empty() || a.positional.size() > 3) {
        in.fail(line, "range() takes 1 to 3 integer arguments");
      }
      std::vector<int64_t> xs;
      for (const auto& v : a.positional) {
        if (!v.is_int() && !v.is_bool()) in.fail(line, std::string("range() needs integers, got ") + type_name(v));
        xs.push_back(v.as_int());
      }
      int64_t start = xs.size() == 1 ? 0 : xs[0];
      int64_t stop = xs.size() == 1 ? xs[0] : xs[1];
      int64_t st = xs.size() == 3 ? xs[2] : 1;
      if (st == 0) in.fail(line, "range() arg 3 must not be zero");
      double count =
          std::max(0.0, std::ceil((static_cast<double>(stop) - static_cast<double>(start)) / static_cast<double>(st)));
      if (count > static_cast<double>(in.budget().max_steps)) {
        in.fail(line, "range() of " + std::to_string(static_cast<uint64_t>(count)) + " items exceeds the work budget");
      }
      List out;
      for (int64_t i = start; st > 0 ? i < stop : i > stop; i += st) {
        out.emplace_back(i);
        in.step(line);
      }
      return make_list(std::move(out));
    };
  } else if (name == "namespace" || name == "dict") {
    bool ns = name == "namespace";
    c->fn = [ns](Interpreter& in, CallArgs& a, int line) -> Value {
      Dict d;
      for (const auto& p : a.positional) {
        if (!p.is_dict())
          in.fail(line, std::string(ns ? "namespace" : "dict") + "() positional argument must be a mapping");
        for (const auto& [k, v] : p.dict()->entries) d.set(k, v);
      }
      for (const auto& [k, v] : a.keyword) d.set(k, v);
      if (ns) {
        for (const auto& [k, v] : d.entries) {
          if (!k.empty() && k[0] == '_') {
            in.fail(line, "namespace attributes cannot start with '_' (got '" + k + "')");
          }
        }
      }
      if (!ns) return Value(std::make_shared<Dict>(std::move(d)));
      auto n = std::make_shared<Namespace>();
      n->attrs = std::move(d);
      return Value(n);
    };
  } else if (name == "raise_exception") {
    c->fn = [](Interpreter& in, CallArgs& a, int line) -> Value {
      std::string msg = a.positional.empty() ? "" : py_str(a.positional[0]);
      in.fail(line, "raise_exception: " + msg);
    };
  } else {
    c->fn = [](Interpreter& in, CallArgs& a, int line) -> Value {
      if (a.positional.size() != 1 || !a.positional[0].is_string())
        in.fail(line, "strftime_now() needs a format string");
      std::time_t now = std::time(nullptr);
      std::tm tm{};
      localtime_r(&now, &tm);
      char buf[512];
      size_t n = std::strftime(buf, sizeof buf, a.positional[0].str().c_str(), &tm);
      return Value(std::string(buf, n));
    };
  }
  return Value(c);
}

}  // namespace chimera::chat::jinja
