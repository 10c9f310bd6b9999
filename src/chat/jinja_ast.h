// The syntax tree of a parsed template (jinja_parser.cpp builds it, jinja_eval.cpp walks it).
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "chat/jinja_value.h"

namespace chimera::chat::jinja {

enum class NodeKind {
  // statements
  kBody,         // kids: statements
  kText,         // text
  kOutput,       // a: expression
  kIf,           // kids: cond0, body0, cond1, body1, ...; b: else body (may be null)
  kFor,          // names: targets; a: iterable; b: body; c: else body; d: filter condition
  kSet,          // names: targets (or names[0] = namespace, text = attribute when attr_target); a: value
  kSetBlock,     // names[0]: target; a: body; kids: filters (kFilter nodes with a null operand)
  kMacro,        // text: name; names: parameters; kids: defaults (null where none); a: body
  kCallBlock,    // a: the call expression; b: body; names: caller parameters; kids: their defaults
  kFilterBlock,  // a: body; kids: filters (kFilter nodes with a null operand)
  kBreak,
  kContinue,
  // expressions
  kLiteral,  // value
  kName,     // text
  kAttr,     // a: object; text: attribute
  kItem,     // a: object; b: key
  kSlice,    // a: object; b, c, d: start, stop, step (each may be null)
  kCall,     // a: callee; kids: positional; kwnames + kwargs
  kFilter,   // text: name; a: operand; kids / kwnames + kwargs: arguments
  kTest,     // text: name; a: operand; kids: arguments; negated
  kNot,      // a
  kNeg,      // a
  kPos,      // a
  kBinary,   // text: + - * / // % ** ~ and or; a, b
  kCompare,  // a: first operand; kids: further operands; names: operators (== != < > <= >= in notin)
  kCond,     // a: condition; b: then; c: else (may be null)
  kList,     // kids
  kTuple,    // kids
  kDictLit,  // kids: key0, value0, key1, value1, ...
};

struct Node;
using NodePtr = std::shared_ptr<Node>;

struct Node {
  NodeKind kind;
  int line = 0;
  std::string text;
  Value value;
  NodePtr a, b, c, d;
  std::vector<NodePtr> kids;
  std::vector<std::string> names;
  std::vector<std::string> kwnames;
  std::vector<NodePtr> kwargs;
  bool negated = false;
  bool attr_target = false;
};

NodePtr parse_template(const std::string& source, const std::string& origin);

}  // namespace chimera::chat::jinja
