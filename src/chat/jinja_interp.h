// The evaluator's state, shared by jinja_eval.cpp (statements, expressions) and jinja_builtins.cpp (filters,
// tests, methods, globals).
#pragma once

#include <string>
#include <unordered_map>
#include <vector>

#include "chat/jinja.h"
#include "chat/jinja_ast.h"
#include "chat/jinja_value.h"

namespace chimera::chat::jinja {

class Interpreter {
 public:
  Interpreter(const std::string& origin, const Budget& budget);

  std::string run(const Node& root, const nlohmann::ordered_json& vars);

  [[noreturn]] void fail(int line, const std::string& msg) const;
  void step(int line);                            // one unit of work against the budget
  // `units` units of work at once: an op whose cost grows with the value it copies or builds (one unit per list
  // item, per 64 bytes of string), so that such an op inside a loop cannot run unbounded work per step.
  void charge(uint64_t units, int line);
  void check_size(size_t bytes, int line) const;  // a string / list about to be built
  Value eval(const Node& n);
  Value call(const Value& callee, CallArgs& args, int line);
  std::vector<Value> iterate(const Value& v, int line);
  std::string render_body(const Node& body);  // a macro / caller / filter block's output
  const Budget& budget() const { return budget_; }

  // Scopes: frames[0] holds the template's variables; a macro call starts a frame that sees only itself,
  // its enclosing macro-free frames and frames[0].
  struct Frame {
    std::unordered_map<std::string, Value> vars;
    bool function = false;
  };
  Value lookup(const std::string& name, int line) const;
  void assign(const std::string& name, Value v) { frames_.back().vars[name] = std::move(v); }

 private:
  enum class Flow { kNormal, kBreak, kContinue };
  struct DepthGuard {
    Interpreter& in;
    DepthGuard(Interpreter& interp, int line);
    ~DepthGuard() { --in.depth_; }
  };

  Flow exec(const Node& n, std::string& out);
  Flow exec_for(const Node& n, std::string& out);
  void emit(std::string& out, std::string_view s, int line);
  Value eval_binary(const Node& n);
  Value eval_compare(const Node& n);
  Value eval_call(const Node& n);
  Value eval_attr(const Value& obj, const std::string& name, int line);
  Value eval_item(const Value& obj, const Value& key, int line);
  Value eval_slice(const Node& n);
  Value make_macro(const Node& n);
  CallArgs eval_args(const Node& n);
  void bind_targets(const std::vector<std::string>& names, const Value& v, int line);

  const std::string& origin_;
  Budget budget_;
  uint64_t steps_ = 0;
  uint64_t output_bytes_ = 0;
  uint32_t call_depth_ = 0;
  int depth_ = 0;
  std::vector<Frame> frames_;
  friend struct MacroCall;
};

// jinja_builtins.cpp
Value apply_filter(Interpreter& in, const std::string& name, const Value& operand, CallArgs& args, int line);
bool apply_test(Interpreter& in, const std::string& name, const Value& operand, CallArgs& args, int line);
bool has_method(const Value& obj, const std::string& name);
Value call_method(Interpreter& in, const Value& obj, const std::string& name, CallArgs& args, int line);
Value global_function(const std::string& name);  // range, namespace, dict, raise_exception, ...; undefined if none
int compare_values(Interpreter& in, const Value& a, const Value& b, int line);  // <0, 0, >0; error if unordered

}  // namespace chimera::chat::jinja
