// Statements and expressions. Scoping follows Jinja2: {% if %} opens no scope; a for loop's body and a
// macro's body assign into their own frame, invisible after the loop / call; namespace() objects carry
// values out of loops.
#include <cmath>
#include <limits>

#include "chat/jinja_interp.h"
#include "core/error.h"

namespace chimera::chat::jinja {

namespace {
constexpr int kMaxEvalDepth = 3000;  // nested evaluations (AST depth x macro depth), well within the stack
constexpr size_t kMaxListItems = 1u << 22;
}  // namespace

Interpreter::Interpreter(const std::string& origin, const Budget& budget) : origin_(origin), budget_(budget) {}

Interpreter::DepthGuard::DepthGuard(Interpreter& interp, int line) : in(interp) {
  if (++in.depth_ > kMaxEvalDepth) {
    --in.depth_;
    in.fail(line, "template evaluation nests too deeply (over " + std::to_string(kMaxEvalDepth) + " levels)");
  }
}

void Interpreter::fail(int line, const std::string& msg) const {
  invalid_input("{} line {}: {}", origin_, line, msg);
}

void Interpreter::step(int line) {
  if (++steps_ > budget_.max_steps) {
    fail(line, "template exceeded its work budget of " + std::to_string(budget_.max_steps) + " steps");
  }
}

void Interpreter::charge(uint64_t units, int line) {
  steps_ += units;
  if (steps_ > budget_.max_steps) {
    fail(line, "template exceeded its work budget of " + std::to_string(budget_.max_steps) + " steps");
  }
}

void Interpreter::check_size(size_t bytes, int line) const {
  if (bytes > budget_.max_output_bytes) {
    fail(line, "template built a value of " + std::to_string(bytes) + " bytes, over its budget of " +
                   std::to_string(budget_.max_output_bytes));
  }
}

void Interpreter::emit(std::string& out, std::string_view s, int line) {
  output_bytes_ += s.size();
  if (output_bytes_ > budget_.max_output_bytes) {
    fail(line, "template output exceeded its budget of " + std::to_string(budget_.max_output_bytes) + " bytes");
  }
  out.append(s);
}

std::string Interpreter::run(const Node& root, const nlohmann::ordered_json& vars) {
  frames_.clear();
  frames_.emplace_back();
  if (vars.is_object()) {
    for (const auto& [k, v] : vars.items()) frames_[0].vars[k] = from_json(v);
  }
  std::string out;
  Flow f = exec(root, out);
  if (f != Flow::kNormal) fail(root.line, "break / continue outside a loop");
  return out;
}

Value Interpreter::lookup(const std::string& name, int line) const {
  (void)line;
  for (size_t i = frames_.size(); i-- > 0;) {
    auto it = frames_[i].vars.find(name);
    if (it != frames_[i].vars.end()) return it->second;
    if (frames_[i].function) {
      auto root = frames_[0].vars.find(name);
      if (root != frames_[0].vars.end()) return root->second;
      break;
    }
  }
  Value g = global_function(name);
  if (!g.is_undefined()) return g;
  return Value::undefined("'" + name + "'");
}

std::vector<Value> Interpreter::iterate(const Value& v, int line) {
  if (v.is_list()) {
    charge(v.list()->size(), line);  // a copy of every item (the loops and filters over a sequence)
    return *v.list();
  }
  if (v.is_undefined()) return {};
  if (v.is_dict()) {
    std::vector<Value> keys;
    for (const auto& [k, val] : v.dict()->entries) keys.emplace_back(k);
    return keys;
  }
  if (v.is_string()) {
    std::vector<uint32_t> cps = utf8_decode(v.str());
    std::vector<Value> out;
    out.reserve(cps.size());
    for (size_t i = 0; i < cps.size(); ++i) out.emplace_back(utf8_encode(cps, i, i + 1));
    return out;
  }
  fail(line, std::string("'") + type_name(v) + "' object is not iterable");
}

std::string Interpreter::render_body(const Node& body) {
  std::string out;
  Flow f = exec(body, out);
  if (f != Flow::kNormal) fail(body.line, "break / continue outside a loop");
  return out;
}

Interpreter::Flow Interpreter::exec(const Node& n, std::string& out) {
  DepthGuard g(*this, n.line);
  step(n.line);
  switch (n.kind) {
    case NodeKind::kBody:
      for (const auto& k : n.kids) {
        Flow f = exec(*k, out);
        if (f != Flow::kNormal) return f;
      }
      return Flow::kNormal;
    case NodeKind::kText: emit(out, n.text, n.line); return Flow::kNormal;
    case NodeKind::kOutput: {
      Value v = eval(*n.a);
      if (v.is_callable()) fail(n.line, "cannot print a function (missing '()'?)");
      emit(out, py_str(v), n.line);
      return Flow::kNormal;
    }
    case NodeKind::kIf:
      for (size_t i = 0; i + 1 < n.kids.size(); i += 2) {
        if (truthy(eval(*n.kids[i]))) return exec(*n.kids[i + 1], out);
      }
      if (n.b) return exec(*n.b, out);
      return Flow::kNormal;
    case NodeKind::kFor: return exec_for(n, out);
    case NodeKind::kSet: {
      Value v = eval(*n.a);
      if (n.attr_target) {
        Value target = lookup(n.names[0], n.line);
        if (!target.is_namespace()) {
          fail(n.line, "cannot assign attribute '" + n.text + "' on '" + n.names[0] + "' (" + type_name(target) +
                           "): only namespace() objects take attributes");
        }
        if (!n.text.empty() && n.text[0] == '_') {
          fail(n.line, "namespace attributes cannot start with '_' (got '" + n.text + "')");
        }
        target.ns()->attrs.set(n.text, std::move(v));
      } else {
        bind_targets(n.names, v, n.line);
      }
      return Flow::kNormal;
    }
    case NodeKind::kSetBlock: {
      Value v(render_body(*n.a));
      for (const auto& f : n.kids) {
        CallArgs args = eval_args(*f);
        v = apply_filter(*this, f->text, v, args, f->line);
      }
      assign(n.names[0], std::move(v));
      return Flow::kNormal;
    }
    case NodeKind::kFilterBlock: {
      Value v(render_body(*n.a));
      for (const auto& f : n.kids) {
        CallArgs args = eval_args(*f);
        v = apply_filter(*this, f->text, v, args, f->line);
      }
      emit(out, py_str(v), n.line);
      return Flow::kNormal;
    }
    case NodeKind::kMacro: assign(n.text, make_macro(n)); return Flow::kNormal;
    case NodeKind::kCallBlock: {
      // caller(): renders the block body with the caller parameters bound.
      auto caller = std::make_shared<Callable>();
      caller->name = "caller";
      const Node* block = &n;
      caller->fn = [block](Interpreter& in, CallArgs& args, int line) -> Value {
        in.frames_.emplace_back();
        struct Pop {
          Interpreter& i;
          ~Pop() { i.frames_.pop_back(); }
        } pop{in};
        for (size_t i = 0; i < block->names.size(); ++i) {
          Value v;
          if (i < args.positional.size())
            v = args.positional[i];
          else if (block->kids[i])
            v = in.eval(*block->kids[i]);
          else
            v = Value::undefined("'" + block->names[i] + "'");
          in.assign(block->names[i], v);
        }
        (void)line;
        return Value(in.render_body(*block->b));
      };
      const Node& call_node = *n.a;
      Value callee = eval(*call_node.a);
      CallArgs args = eval_args(call_node);
      args.keyword.emplace_back("caller", Value(caller));
      emit(out, py_str(call(callee, args, n.line)), n.line);
      return Flow::kNormal;
    }
    case NodeKind::kBreak: return Flow::kBreak;
    case NodeKind::kContinue: return Flow::kContinue;
    default: fail(n.line, "internal: expression node used as a statement");
  }
}

void Interpreter::bind_targets(const std::vector<std::string>& names, const Value& v, int line) {
  if (names.size() == 1) {
    assign(names[0], v);
    return;
  }
  std::vector<Value> items = iterate(v, line);
  if (items.size() != names.size()) {
    fail(line,
         "cannot unpack " + std::to_string(items.size()) + " values into " + std::to_string(names.size()) + " names");
  }
  for (size_t i = 0; i < names.size(); ++i) assign(names[i], items[i]);
}

Interpreter::Flow Interpreter::exec_for(const Node& n, std::string& out) {
  Value iterable = eval(*n.a);
  std::vector<Value> items = iterate(iterable, n.line);
  frames_.emplace_back();
  struct Pop {
    Interpreter& in;
    ~Pop() { in.frames_.pop_back(); }
  } pop{*this};
  if (n.d) {  // {% for x in xs if cond %}: filtered before loop.* is computed, as Jinja2 does
    std::vector<Value> kept;
    for (const auto& item : items) {
      step(n.line);
      bind_targets(n.names, item, n.line);
      if (truthy(eval(*n.d))) kept.push_back(item);
    }
    items = std::move(kept);
  }
  if (items.empty()) {
    if (n.c) return exec(*n.c, out);
    return Flow::kNormal;
  }
  const int64_t len = static_cast<int64_t>(items.size());
  for (int64_t i = 0; i < len; ++i) {
    step(n.line);
    auto loop = std::make_shared<Dict>();
    loop->set("index", Value(i + 1));
    loop->set("index0", Value(i));
    loop->set("revindex", Value(len - i));
    loop->set("revindex0", Value(len - i - 1));
    loop->set("first", Value(i == 0));
    loop->set("last", Value(i == len - 1));
    loop->set("length", Value(len));
    loop->set("depth", Value(1));
    loop->set("depth0", Value(0));
    loop->set("previtem", i > 0 ? items[static_cast<size_t>(i - 1)] : Value::undefined("'loop.previtem'"));
    loop->set("nextitem", i + 1 < len ? items[static_cast<size_t>(i + 1)] : Value::undefined("'loop.nextitem'"));
    auto cycle = std::make_shared<Callable>();
    cycle->name = "loop.cycle";
    cycle->fn = [i](Interpreter& in, CallArgs& args, int line) -> Value {
      if (args.positional.empty()) in.fail(line, "loop.cycle() needs at least one argument");
      return args.positional[static_cast<size_t>(i) % args.positional.size()];
    };
    loop->set("cycle", Value(cycle));
    // Each iteration starts from a fresh frame: what the body assigns is gone by the next iteration.
    frames_.back().vars.clear();
    assign("loop", Value(loop));
    bind_targets(n.names, items[static_cast<size_t>(i)], n.line);
    Flow f = exec(*n.b, out);
    if (f == Flow::kBreak) break;
  }
  return Flow::kNormal;
}

namespace {
struct FrameGuard {
  std::vector<Interpreter::Frame>& frames;
  ~FrameGuard() { frames.pop_back(); }
};
}  // namespace

struct MacroCall {
  static Value invoke(Interpreter& in, const Node& m, CallArgs& args, int line) {
    if (++in.call_depth_ > in.budget_.max_depth) {
      --in.call_depth_;
      in.fail(line, "macro '" + m.text + "' recursed deeper than " + std::to_string(in.budget_.max_depth) + " calls");
    }
    struct DepthPop {
      Interpreter& i;
      ~DepthPop() { --i.call_depth_; }
    } depth_pop{in};
    in.frames_.emplace_back();
    in.frames_.back().function = true;
    FrameGuard guard{in.frames_};
    size_t np = m.names.size();
    std::vector<bool> bound(np, false);
    auto varargs = std::make_shared<List>();
    for (size_t i = 0; i < args.positional.size(); ++i) {
      if (i < np) {
        in.assign(m.names[i], args.positional[i]);
        bound[i] = true;
      } else {
        varargs->push_back(args.positional[i]);
      }
    }
    auto kwargs = std::make_shared<Dict>();
    for (auto& [k, v] : args.keyword) {
      bool found = false;
      for (size_t i = 0; i < np; ++i) {
        if (m.names[i] == k) {
          if (bound[i]) in.fail(line, "macro '" + m.text + "' got multiple values for argument '" + k + "'");
          in.assign(k, v);
          bound[i] = true;
          found = true;
        }
      }
      if (!found) {
        if (k == "caller")
          in.assign("caller", v);
        else
          kwargs->set(k, v);
      }
    }
    for (size_t i = 0; i < np; ++i) {
      if (bound[i]) continue;
      if (m.kids[i])
        in.assign(m.names[i], in.eval(*m.kids[i]));
      else
        in.assign(m.names[i], Value::undefined("'" + m.names[i] + "'"));
    }
    Value va(varargs);
    va.tuple = true;
    in.assign("varargs", va);
    in.assign("kwargs", Value(kwargs));
    return Value(in.render_body(*m.a));
  }
};

Value Interpreter::make_macro(const Node& n) {
  auto c = std::make_shared<Callable>();
  c->name = n.text;
  const Node* m = &n;
  c->fn = [m](Interpreter& in, CallArgs& args, int line) { return MacroCall::invoke(in, *m, args, line); };
  return Value(c);
}

CallArgs Interpreter::eval_args(const Node& n) {
  CallArgs args;
  for (const auto& k : n.kids) args.positional.push_back(eval(*k));
  for (size_t i = 0; i < n.kwnames.size(); ++i) args.keyword.emplace_back(n.kwnames[i], eval(*n.kwargs[i]));
  return args;
}

Value Interpreter::call(const Value& callee, CallArgs& args, int line) {
  if (callee.is_undefined()) fail(line, std::get<Undefined>(callee.v).hint + " is undefined and cannot be called");
  if (!callee.is_callable()) fail(line, std::string("'") + type_name(callee) + "' object is not callable");
  return callee.callable()->fn(*this, args, line);
}

Value Interpreter::eval_attr(const Value& obj, const std::string& name, int line) {
  if (obj.is_undefined()) fail(line, std::get<Undefined>(obj.v).hint + " is undefined (looking up '." + name + "')");
  if (obj.is_namespace()) {
    const Value* v = obj.ns()->attrs.find(name);
    return v ? *v : Value::undefined("'" + name + "'");
  }
  if (has_method(obj, name)) {
    // A bound method: Jinja2 resolves obj.name through getattr first, so dict.items is the method.
    auto c = std::make_shared<Callable>();
    c->name = name;
    Value self = obj;
    c->fn = [self, name](Interpreter& in, CallArgs& args, int l) { return call_method(in, self, name, args, l); };
    return Value(c);
  }
  if (obj.is_dict()) {
    const Value* v = obj.dict()->find(name);
    return v ? *v : Value::undefined("'" + name + "'");
  }
  return Value::undefined("'" + name + "'");
}

Value Interpreter::eval_item(const Value& obj, const Value& key, int line) {
  if (obj.is_undefined()) fail(line, std::get<Undefined>(obj.v).hint + " is undefined (indexing it)");
  if (obj.is_dict()) {
    if (key.is_string()) {
      const Value* v = obj.dict()->find(key.str());
      if (v) return *v;
      return Value::undefined("'" + key.str() + "'");
    }
    return Value::undefined(py_repr(key));
  }
  if (obj.is_namespace() && key.is_string()) return eval_attr(obj, key.str(), line);
  if ((obj.is_list() || obj.is_string()) && (key.is_int() || key.is_bool())) {
    int64_t i = key.as_int();
    if (obj.is_list()) {
      int64_t n = static_cast<int64_t>(obj.list()->size());
      if (i < 0) i += n;
      if (i < 0 || i >= n) return Value::undefined("index " + std::to_string(key.as_int()));
      return (*obj.list())[static_cast<size_t>(i)];
    }
    std::vector<uint32_t> cps = utf8_decode(obj.str());
    int64_t n = static_cast<int64_t>(cps.size());
    if (i < 0) i += n;
    if (i < 0 || i >= n) return Value::undefined("index " + std::to_string(key.as_int()));
    return Value(utf8_encode(cps, static_cast<size_t>(i), static_cast<size_t>(i) + 1));
  }
  if (key.is_string()) return eval_attr(obj, key.str(), line);
  return Value::undefined(py_repr(key));
}

Value Interpreter::eval_slice(const Node& n) {
  Value obj = eval(*n.a);
  auto bound = [&](const NodePtr& p, const char* what) -> std::optional<int64_t> {
    if (!p) return std::nullopt;
    Value v = eval(*p);
    if (v.is_none()) return std::nullopt;
    if (!v.is_int() && !v.is_bool()) fail(n.line, std::string("slice ") + what + " must be an integer or None");
    return v.as_int();
  };
  std::optional<int64_t> start = bound(n.b, "start"), stop = bound(n.c, "stop"), stepv = bound(n.d, "step");
  int64_t st = stepv.value_or(1);
  if (st == 0) fail(n.line, "slice step cannot be zero");
  auto run = [&](int64_t len, auto&& take) {
    // Python's slice.indices()
    auto clamp = [&](std::optional<int64_t> v, int64_t def) {
      if (!v) return def;
      int64_t x = *v;
      if (x < 0) {
        x += len;
        if (x < 0) x = st < 0 ? -1 : 0;
      } else if (x >= len) {
        x = st < 0 ? len - 1 : len;
      }
      return x;
    };
    int64_t b = clamp(start, st < 0 ? len - 1 : 0);
    int64_t e = clamp(stop, st < 0 ? -1 : len);
    if (st > 0) {
      for (int64_t i = b; i < e; i += st) take(static_cast<size_t>(i));
    } else {
      for (int64_t i = b; i > e; i += st) take(static_cast<size_t>(i));
    }
  };
  if (obj.is_list()) {
    const List& l = *obj.list();
    List out;
    run(static_cast<int64_t>(l.size()), [&](size_t i) { out.push_back(l[i]); });
    return make_list(std::move(out));
  }
  if (obj.is_string()) {
    std::vector<uint32_t> cps = utf8_decode(obj.str());
    std::vector<uint32_t> out;
    run(static_cast<int64_t>(cps.size()), [&](size_t i) { out.push_back(cps[i]); });
    return Value(utf8_encode(out, 0, out.size()));
  }
  if (obj.is_undefined()) fail(n.line, std::get<Undefined>(obj.v).hint + " is undefined (slicing it)");
  fail(n.line, std::string("'") + type_name(obj) + "' object is not subscriptable");
}

Value Interpreter::eval_call(const Node& n) {
  const Node& callee = *n.a;
  if (callee.kind == NodeKind::kAttr) {
    Value obj = eval(*callee.a);
    if (!obj.is_undefined() && !obj.is_namespace() && has_method(obj, callee.text)) {
      CallArgs args = eval_args(n);
      return call_method(*this, obj, callee.text, args, n.line);
    }
    Value f = eval_attr(obj, callee.text, n.line);
    CallArgs args = eval_args(n);
    if (f.is_undefined()) {
      fail(n.line, std::string("'") + type_name(obj) + "' object has no method '" + callee.text + "'");
    }
    return call(f, args, n.line);
  }
  Value f = eval(callee);
  CallArgs args = eval_args(n);
  return call(f, args, n.line);
}

namespace {
int64_t floor_div(int64_t a, int64_t b) {
  int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}
}  // namespace

Value Interpreter::eval_binary(const Node& n) {
  const std::string& op = n.text;
  if (op == "and") {
    Value a = eval(*n.a);
    return truthy(a) ? eval(*n.b) : a;
  }
  if (op == "or") {
    Value a = eval(*n.a);
    return truthy(a) ? a : eval(*n.b);
  }
  Value a = eval(*n.a);
  Value b = eval(*n.b);
  if (op == "~") {
    std::string s = py_str(a);
    std::string t = py_str(b);
    check_size(s.size() + t.size(), n.line);
    charge((s.size() + t.size()) / 64, n.line);
    return Value(s + t);
  }
  auto undefined_operand = [&](const Value& v) {
    if (v.is_undefined()) fail(n.line, std::get<Undefined>(v.v).hint + " is undefined (operand of '" + op + "')");
  };
  undefined_operand(a);
  undefined_operand(b);
  auto type_error = [&]() -> Value {
    fail(n.line, "unsupported operand type(s) for " + op + ": '" + type_name(a) + "' and '" + type_name(b) + "'");
  };
  if (op == "+") {
    if (a.is_string() && b.is_string()) {
      check_size(a.str().size() + b.str().size(), n.line);
      charge((a.str().size() + b.str().size()) / 64, n.line);
      return Value(a.str() + b.str());
    }
    if (a.is_list() && b.is_list()) {
      if (a.list()->size() + b.list()->size() > kMaxListItems) fail(n.line, "list grew past its size budget");
      charge(a.list()->size() + b.list()->size(), n.line);
      List out = *a.list();
      out.insert(out.end(), b.list()->begin(), b.list()->end());
      return make_list(std::move(out));
    }
  }
  if (op == "*" && (((a.is_string() || a.is_list()) && (b.is_int() || b.is_bool())) ||
                    ((b.is_string() || b.is_list()) && (a.is_int() || a.is_bool())))) {
    const Value& seq = a.is_int() || a.is_bool() ? b : a;
    int64_t times = std::max<int64_t>(0, (a.is_int() || a.is_bool() ? a : b).as_int());
    // An empty sequence repeats to itself however large the count: never loop `times` times over nothing, which
    // no size check would stop (Python answers `10**12 * ""` at once too).
    if (seq.is_string() ? seq.str().empty() : seq.list()->empty()) times = 0;
    if (seq.is_string()) {
      check_size(seq.str().size() * static_cast<size_t>(std::min<int64_t>(times, 1ll << 40)), n.line);
      charge(seq.str().size() * static_cast<uint64_t>(times) / 64, n.line);
      std::string out;
      for (int64_t i = 0; i < times; ++i) out += seq.str();
      return Value(out);
    }
    if (seq.list()->size() * static_cast<size_t>(std::min<int64_t>(times, 1ll << 40)) > kMaxListItems) {
      fail(n.line, "list grew past its size budget");
    }
    charge(seq.list()->size() * static_cast<uint64_t>(times), n.line);
    List out;
    for (int64_t i = 0; i < times; ++i) out.insert(out.end(), seq.list()->begin(), seq.list()->end());
    return make_list(std::move(out));
  }
  if (!a.is_number() || !b.is_number()) return type_error();
  bool fl = a.is_float() || b.is_float();
  if (op == "/") {
    if (b.as_double() == 0) fail(n.line, "division by zero");
    return Value(a.as_double() / b.as_double());
  }
  if (fl) {
    double x = a.as_double(), y = b.as_double();
    if (op == "+") return Value(x + y);
    if (op == "-") return Value(x - y);
    if (op == "*") return Value(x * y);
    if (op == "**") return Value(std::pow(x, y));
    if (y == 0) fail(n.line, "division by zero");
    if (op == "//") return Value(std::floor(x / y));
    if (op == "%") {
      double r = std::fmod(x, y);
      if (r != 0 && ((r < 0) != (y < 0))) r += y;
      return Value(r);
    }
    return type_error();
  }
  int64_t x = a.as_int(), y = b.as_int();
  int64_t r = 0;
  if (op == "+") {
    if (__builtin_add_overflow(x, y, &r)) return Value(static_cast<double>(x) + static_cast<double>(y));
    return Value(r);
  }
  if (op == "-") {
    if (__builtin_sub_overflow(x, y, &r)) return Value(static_cast<double>(x) - static_cast<double>(y));
    return Value(r);
  }
  if (op == "*") {
    if (__builtin_mul_overflow(x, y, &r)) return Value(static_cast<double>(x) * static_cast<double>(y));
    return Value(r);
  }
  if (op == "**") {
    if (y < 0) return Value(std::pow(static_cast<double>(x), static_cast<double>(y)));
    // Exponentiation by squaring: log2(y) multiplications, exact until a product leaves int64 (then a float, as
    // the other overflowing operators here).
    int64_t acc = 1;
    int64_t base = x;
    for (int64_t e = y; e > 0; e >>= 1) {
      if ((e & 1) && __builtin_mul_overflow(acc, base, &acc)) {
        return Value(std::pow(static_cast<double>(x), static_cast<double>(y)));
      }
      if (e > 1 && __builtin_mul_overflow(base, base, &base)) {
        return Value(std::pow(static_cast<double>(x), static_cast<double>(y)));
      }
    }
    return Value(acc);
  }
  if (y == 0) fail(n.line, "integer division or modulo by zero");
  if (x == std::numeric_limits<int64_t>::min() && y == -1) return Value(-static_cast<double>(x));
  if (op == "//") return Value(floor_div(x, y));
  if (op == "%") return Value(x - floor_div(x, y) * y);
  return type_error();
}

Value Interpreter::eval_compare(const Node& n) {
  Value left = eval(*n.a);
  for (size_t i = 0; i < n.kids.size(); ++i) {
    Value right = eval(*n.kids[i]);
    const std::string& op = n.names[i];
    bool ok;
    if (op == "==")
      ok = equal(left, right);
    else if (op == "!=")
      ok = !equal(left, right);
    else if (op == "in" || op == "notin") {
      bool found = false;
      if (right.is_string()) {
        if (!left.is_string()) {
          fail(n.line, std::string("'in <string>' requires string as left operand, not ") + type_name(left));
        }
        found = right.str().find(left.str()) != std::string::npos;
      } else if (right.is_list()) {
        for (const auto& e : *right.list()) {
          if (equal(e, left)) {
            found = true;
            break;
          }
        }
      } else if (right.is_dict()) {
        found = left.is_string() && right.dict()->find(left.str()) != nullptr;
      } else if (right.is_namespace()) {
        found = left.is_string() && right.ns()->attrs.find(left.str()) != nullptr;
      } else if (!right.is_undefined()) {
        fail(n.line, std::string("argument of type '") + type_name(right) + "' is not iterable");
      }
      ok = op == "in" ? found : !found;
    } else {
      int c = compare_values(*this, left, right, n.line);
      ok = op == "<" ? c < 0 : op == ">" ? c > 0 : op == "<=" ? c <= 0 : c >= 0;
    }
    if (!ok) return Value(false);
    left = std::move(right);
  }
  return Value(true);
}

Value Interpreter::eval(const Node& n) {
  DepthGuard g(*this, n.line);
  step(n.line);
  switch (n.kind) {
    case NodeKind::kLiteral: return n.value;
    case NodeKind::kName: return lookup(n.text, n.line);
    case NodeKind::kAttr: return eval_attr(eval(*n.a), n.text, n.line);
    case NodeKind::kItem: {
      Value obj = eval(*n.a);
      return eval_item(obj, eval(*n.b), n.line);
    }
    case NodeKind::kSlice: return eval_slice(n);
    case NodeKind::kCall: return eval_call(n);
    case NodeKind::kFilter: {
      Value operand = eval(*n.a);
      CallArgs args = eval_args(n);
      return apply_filter(*this, n.text, operand, args, n.line);
    }
    case NodeKind::kTest: {
      Value operand = eval(*n.a);
      CallArgs args = eval_args(n);
      bool r = apply_test(*this, n.text, operand, args, n.line);
      return Value(n.negated ? !r : r);
    }
    case NodeKind::kNot: return Value(!truthy(eval(*n.a)));
    case NodeKind::kNeg:
    case NodeKind::kPos: {
      Value v = eval(*n.a);
      if (v.is_undefined()) fail(n.line, std::get<Undefined>(v.v).hint + " is undefined (unary operand)");
      if (!v.is_number()) fail(n.line, std::string("bad operand type for unary operator: '") + type_name(v) + "'");
      if (n.kind == NodeKind::kPos) return v.is_bool() ? Value(v.as_int()) : v;
      if (v.is_float()) return Value(-v.as_double());
      if (v.as_int() == std::numeric_limits<int64_t>::min()) return Value(-v.as_double());
      return Value(-v.as_int());
    }
    case NodeKind::kBinary: return eval_binary(n);
    case NodeKind::kCompare: return eval_compare(n);
    case NodeKind::kCond: {
      if (truthy(eval(*n.a))) return eval(*n.b);
      if (n.c) return eval(*n.c);
      return Value::undefined("the missing else branch");
    }
    case NodeKind::kList:
    case NodeKind::kTuple: {
      List items;
      for (const auto& k : n.kids) items.push_back(eval(*k));
      return n.kind == NodeKind::kTuple ? make_tuple(std::move(items)) : make_list(std::move(items));
    }
    case NodeKind::kDictLit: {
      auto d = std::make_shared<Dict>();
      for (size_t i = 0; i + 1 < n.kids.size(); i += 2) {
        Value k = eval(*n.kids[i]);
        if (!k.is_string()) fail(n.line, std::string("dict keys must be strings here, not ") + type_name(k));
        d->set(k.str(), eval(*n.kids[i + 1]));
      }
      return Value(d);
    }
    default: fail(n.line, "internal: statement node used as an expression");
  }
}

}  // namespace chimera::chat::jinja
