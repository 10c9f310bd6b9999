// Lexer and parser: template source -> Node tree.
// Whitespace follows Jinja2's lexer with transformers' settings: newlines normalized to "\n", one trailing
// newline dropped (keep_trailing_newline off), trim_blocks (the first "\n" after %} or #} is removed),
// lstrip_blocks (spaces / tabs between a line start and {% or {# are removed), and the "-" / "+" markers.
#include <charconv>
#include <string_view>

#include "chat/jinja.h"
#include "chat/jinja_ast.h"
#include "core/error.h"

namespace chimera::chat::jinja {
namespace {

enum class Tok { kText, kVarBegin, kVarEnd, kBlockBegin, kBlockEnd, kName, kString, kInt, kFloat, kOp, kEnd };

struct Token {
  Tok type;
  std::string text;
  int64_t ival = 0;
  double fval = 0;
  int line = 0;
};

bool is_ws(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

// Python str.rstrip() / the regex \s, on UTF-8.
std::string rstrip_py(std::string_view s) {
  return py_strip(s, false, true, nullptr);
}
bool all_py_space(std::string_view s) {
  if (s.empty()) return false;
  for (uint32_t cp : utf8_decode(s)) {
    if (!is_py_space(cp)) return false;
  }
  return true;
}
// Skips Python whitespace from pos (UTF-8 aware for the multi-byte spaces).
size_t skip_py_space(const std::string& s, size_t pos) {
  while (pos < s.size()) {
    unsigned char c = static_cast<unsigned char>(s[pos]);
    if (c < 0x80) {
      if (!is_py_space(c)) break;
      ++pos;
      continue;
    }
    size_t len = (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 1;
    auto cps = utf8_decode(std::string_view(s).substr(pos, len));
    if (cps.size() != 1 || !is_py_space(cps[0])) break;
    pos += len;
  }
  return pos;
}

class Lexer {
 public:
  Lexer(const std::string& source, const std::string& origin) : origin_(origin) {
    src_.reserve(source.size());
    for (size_t i = 0; i < source.size(); ++i) {
      if (source[i] == '\r') {
        src_ += '\n';
        if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
      } else {
        src_ += source[i];
      }
    }
    if (!src_.empty() && src_.back() == '\n') src_.pop_back();
  }

  std::vector<Token> run() {
    size_t pos = 0;
    bool line_starting = true;
    while (pos < src_.size()) {
      size_t p = find_tag(pos);
      if (p == std::string::npos) {
        emit_text(src_.substr(pos), pos);
        break;
      }
      char kind = src_[p + 1];
      char sign = p + 2 < src_.size() && (src_[p + 2] == '-' || src_[p + 2] == '+') ? src_[p + 2] : 0;
      std::string text = src_.substr(pos, p - pos);
      if (sign == '-') {
        text = rstrip_py(text);
      } else if (sign != '+' && kind != '{') {
        size_t l_pos = text.rfind('\n');
        l_pos = l_pos == std::string::npos ? 0 : l_pos + 1;
        if ((l_pos > 0 || line_starting) && all_py_space(std::string_view(text).substr(l_pos))) {
          text.resize(l_pos);
        }
      }
      emit_text(std::move(text), pos);
      line_ = line_at(p);
      size_t body = p + 2 + (sign ? 1 : 0);
      size_t end;
      if (kind == '#') {
        end = lex_comment(body);
      } else if (kind == '%' && is_raw(body)) {
        end = lex_raw(body);
      } else {
        end = lex_tag(kind, body);
      }
      line_starting = end > 0 && src_[end - 1] == '\n';
      pos = end;
    }
    tokens_.push_back(Token{Tok::kEnd, "", 0, 0, line_at(src_.size())});
    return std::move(tokens_);
  }

 private:
  [[noreturn]] void fail(int line, const std::string& msg) { invalid_input("{} line {}: {}", origin_, line, msg); }

  int line_at(size_t pos) {
    // Lines are counted incrementally: positions only move forward.
    while (line_pos_ < pos && line_pos_ < src_.size()) {
      if (src_[line_pos_] == '\n') ++line_count_;
      ++line_pos_;
    }
    return line_count_;
  }

  size_t find_tag(size_t pos) const {
    while (true) {
      size_t p = src_.find('{', pos);
      if (p == std::string::npos || p + 1 >= src_.size()) return std::string::npos;
      char c = src_[p + 1];
      if (c == '{' || c == '%' || c == '#') return p;
      pos = p + 1;
    }
  }

  void emit_text(std::string text, size_t at) {
    if (text.empty()) return;
    tokens_.push_back(Token{Tok::kText, std::move(text), 0, 0, line_at(at)});
  }

  // After a tag's closing delimiter at `end` (just past it): "-" strips all whitespace, trim_blocks one "\n".
  size_t after_close(size_t end, char close_sign, bool trim) {
    if (close_sign == '-') return skip_py_space(src_, end);
    if (close_sign != '+' && trim && end < src_.size() && src_[end] == '\n') return end + 1;
    return end;
  }

  size_t lex_comment(size_t body) {
    int open_line = line_;
    size_t q = src_.find("#}", body);
    if (q == std::string::npos) fail(open_line, "unclosed comment ({# without #})");
    char close_sign = q > body && (src_[q - 1] == '-' || src_[q - 1] == '+') ? src_[q - 1] : 0;
    return after_close(q + 2, close_sign, true);
  }

  // {% raw %} ... {% endraw %}: the text between is literal.
  bool is_raw(size_t body) const {
    size_t i = body;
    while (i < src_.size() && is_ws(src_[i])) ++i;
    if (src_.compare(i, 3, "raw") != 0) return false;
    i += 3;
    while (i < src_.size() && is_ws(src_[i])) ++i;
    if (i < src_.size() && (src_[i] == '-' || src_[i] == '+')) ++i;
    return src_.compare(i, 2, "%}") == 0;
  }

  size_t lex_raw(size_t body) {
    int open_line = line_;
    size_t close = src_.find("%}", body);
    char open_close_sign = src_[close - 1] == '-' || src_[close - 1] == '+' ? src_[close - 1] : 0;
    size_t start = after_close(close + 2, open_close_sign, true);
    size_t search = start;
    while (true) {
      size_t p = src_.find("{%", search);
      if (p == std::string::npos) fail(open_line, "unclosed {% raw %} (no {% endraw %})");
      size_t i = p + 2;
      char sign = i < src_.size() && (src_[i] == '-' || src_[i] == '+') ? src_[i] : 0;
      if (sign) ++i;
      while (i < src_.size() && is_ws(src_[i])) ++i;
      if (src_.compare(i, 6, "endraw") != 0) {
        search = p + 2;
        continue;
      }
      i += 6;
      while (i < src_.size() && is_ws(src_[i])) ++i;
      char close_sign = i < src_.size() && (src_[i] == '-' || src_[i] == '+') ? src_[i] : 0;
      if (close_sign) ++i;
      if (src_.compare(i, 2, "%}") != 0) {
        search = p + 2;
        continue;
      }
      std::string text = src_.substr(start, p - start);
      if (sign == '-') text = rstrip_py(text);
      emit_text(std::move(text), start);
      return after_close(i + 2, close_sign, true);
    }
  }

  size_t lex_tag(char kind, size_t body) {
    int open_line = line_;
    tokens_.push_back(Token{kind == '{' ? Tok::kVarBegin : Tok::kBlockBegin, "", 0, 0, open_line});
    char close = kind == '{' ? '}' : '%';
    size_t i = body;
    int balance = 0;
    while (true) {
      while (i < src_.size() && is_ws(src_[i])) ++i;
      if (i >= src_.size()) {
        fail(open_line,
             kind == '{' ? "unexpected end of template: {{ without }}" : "unexpected end of template: {% without %}");
      }
      int line = line_at(i);
      char c = src_[i];
      if (balance == 0) {
        size_t k = i;
        char close_sign = 0;
        if ((c == '-' || c == '+') && k + 1 < src_.size()) {
          close_sign = c;
          ++k;
        }
        if (src_[k] == close && k + 1 < src_.size() && src_[k + 1] == '}' && (close_sign != '+' || kind == '%')) {
          tokens_.push_back(Token{kind == '{' ? Tok::kVarEnd : Tok::kBlockEnd, "", 0, 0, line});
          return after_close(k + 2, close_sign, kind == '%');
        }
      }
      if (c == '\'' || c == '"') {
        i = lex_string(i, line);
      } else if (c >= '0' && c <= '9') {
        i = lex_number(i, line);
      } else if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        size_t j = i;
        while (j < src_.size() && (std::isalnum(static_cast<unsigned char>(src_[j])) || src_[j] == '_')) ++j;
        tokens_.push_back(Token{Tok::kName, src_.substr(i, j - i), 0, 0, line});
        i = j;
      } else {
        static const char* kOps2[] = {"**", "//", "==", "!=", "<=", ">="};
        std::string op;
        for (const char* o : kOps2) {
          if (src_.compare(i, 2, o) == 0) op = o;
        }
        if (op.empty()) {
          if (std::string_view("+-*/%~<>=()[]{},.:|").find(c) == std::string_view::npos) {
            fail(line, std::string("unexpected character '") + c + "' in tag");
          }
          op = std::string(1, c);
          if (c == '(' || c == '[' || c == '{') ++balance;
          if ((c == ')' || c == ']' || c == '}') && balance > 0) --balance;
        }
        tokens_.push_back(Token{Tok::kOp, op, 0, 0, line});
        i += op.size();
      }
    }
  }

  // Python string literal with unicode-escape decoding (what Jinja2 applies to its string tokens).
  size_t lex_string(size_t i, int line) {
    char q = src_[i];
    std::string out;
    size_t j = i + 1;
    while (true) {
      if (j >= src_.size()) fail(line, "unterminated string literal");
      char c = src_[j];
      if (c == q) break;
      if (c == '\\' && j + 1 < src_.size()) {
        char e = src_[j + 1];
        j += 2;
        switch (e) {
          case 'n': out += '\n'; break;
          case 't': out += '\t'; break;
          case 'r': out += '\r'; break;
          case '\\': out += '\\'; break;
          case '\'': out += '\''; break;
          case '"': out += '"'; break;
          case 'a': out += '\a'; break;
          case 'b': out += '\b'; break;
          case 'f': out += '\f'; break;
          case 'v': out += '\v'; break;
          case '\n': break;  // line continuation
          case 'x':
          case 'u':
          case 'U': {
            size_t n = e == 'x' ? 2 : e == 'u' ? 4 : 8;
            uint32_t cp = 0;
            if (j + n > src_.size()) fail(line, "truncated \\" + std::string(1, e) + " escape in string literal");
            auto r = std::from_chars(src_.data() + j, src_.data() + j + n, cp, 16);
            if (r.ptr != src_.data() + j + n || cp > 0x10FFFF) {
              fail(line, "malformed \\" + std::string(1, e) + " escape in string literal");
            }
            out += utf8_encode({cp}, 0, 1);
            j += n;
            break;
          }
          default:
            if (e >= '0' && e <= '7') {
              uint32_t cp = static_cast<uint32_t>(e - '0');
              for (int k = 0; k < 2 && j < src_.size() && src_[j] >= '0' && src_[j] <= '7'; ++k, ++j) {
                cp = cp * 8 + static_cast<uint32_t>(src_[j] - '0');
              }
              out += utf8_encode({cp}, 0, 1);
            } else {
              out += '\\';  // unknown escapes stay as written
              out += e;
            }
        }
        continue;
      }
      out += c;
      ++j;
    }
    tokens_.push_back(Token{Tok::kString, std::move(out), 0, 0, line});
    return j + 1;
  }

  size_t lex_number(size_t i, int line) {
    size_t j = i;
    auto digits = [&] {
      while (j < src_.size() && (std::isdigit(static_cast<unsigned char>(src_[j])) || src_[j] == '_')) ++j;
    };
    digits();
    bool is_float = false;
    if (j + 1 < src_.size() && src_[j] == '.' && std::isdigit(static_cast<unsigned char>(src_[j + 1]))) {
      is_float = true;
      ++j;
      digits();
    }
    if (j < src_.size() && (src_[j] == 'e' || src_[j] == 'E')) {
      size_t k = j + 1;
      if (k < src_.size() && (src_[k] == '+' || src_[k] == '-')) ++k;
      if (k < src_.size() && std::isdigit(static_cast<unsigned char>(src_[k]))) {
        is_float = true;
        j = k;
        digits();
      }
    }
    std::string text;
    for (size_t k = i; k < j; ++k) {
      if (src_[k] != '_') text += src_[k];
    }
    Token t{is_float ? Tok::kFloat : Tok::kInt, text, 0, 0, line};
    if (is_float) {
      t.fval = std::strtod(text.c_str(), nullptr);
    } else {
      auto r = std::from_chars(text.data(), text.data() + text.size(), t.ival);
      if (r.ec != std::errc()) {  // beyond int64: Python would keep it exact; a float is the closest here
        t.type = Tok::kFloat;
        t.fval = std::strtod(text.c_str(), nullptr);
      }
    }
    tokens_.push_back(std::move(t));
    return j;
  }

  std::string src_;
  const std::string& origin_;
  std::vector<Token> tokens_;
  int line_ = 1;
  size_t line_pos_ = 0;
  int line_count_ = 1;
};

bool is_keyword(const std::string& s) {
  return s == "and" || s == "or" || s == "not" || s == "in" || s == "is" || s == "if" || s == "else";
}

class Parser {
 public:
  Parser(std::vector<Token> tokens, const std::string& origin) : t_(std::move(tokens)), origin_(origin) {}

  NodePtr parse_root() {
    std::string which;
    NodePtr body = parse_body({}, &which, 0);
    return body;
  }

 private:
  struct DepthGuard {
    Parser& p;
    explicit DepthGuard(Parser& parser) : p(parser) {
      if (++p.depth_ > Template::kMaxParseDepth) {
        p.fail(p.peek().line, "template nests deeper than " + std::to_string(Template::kMaxParseDepth) + " levels");
      }
    }
    ~DepthGuard() { --p.depth_; }
  };

  [[noreturn]] void fail(int line, const std::string& msg) { invalid_input("{} line {}: {}", origin_, line, msg); }

  const Token& peek(size_t k = 0) const { return t_[std::min(i_ + k, t_.size() - 1)]; }
  const Token& next() {
    const Token& t = t_[i_];
    if (i_ + 1 < t_.size()) ++i_;
    return t;
  }
  bool is_op(const char* op, size_t k = 0) const { return peek(k).type == Tok::kOp && peek(k).text == op; }
  bool is_name(const char* name, size_t k = 0) const { return peek(k).type == Tok::kName && peek(k).text == name; }
  static std::string describe(const Token& t) {
    switch (t.type) {
      case Tok::kText: return "text";
      case Tok::kVarBegin: return "'{{'";
      case Tok::kVarEnd: return "'}}'";
      case Tok::kBlockBegin: return "'{%'";
      case Tok::kBlockEnd: return "'%}'";
      case Tok::kName: return "'" + t.text + "'";
      case Tok::kString: return "a string";
      case Tok::kInt:
      case Tok::kFloat: return "a number";
      case Tok::kOp: return "'" + t.text + "'";
      default: return "end of template";
    }
  }
  void expect_op(const char* op) {
    if (!is_op(op)) fail(peek().line, std::string("expected '") + op + "', got " + describe(peek()));
    next();
  }
  void expect(Tok type, const char* what) {
    if (peek().type != type) fail(peek().line, std::string("expected ") + what + ", got " + describe(peek()));
    next();
  }
  std::string expect_name() {
    if (peek().type != Tok::kName) fail(peek().line, "expected a name, got " + describe(peek()));
    return next().text;
  }
  NodePtr node(NodeKind kind, int line) {
    auto n = std::make_shared<Node>();
    n->kind = kind;
    n->line = line;
    return n;
  }

  // Statements until a {% <one of ends> ...: consumes "{%" and the end name, stores it in *which.
  NodePtr parse_body(const std::vector<std::string>& ends, std::string* which, int open_line) {
    DepthGuard g(*this);
    NodePtr body = node(NodeKind::kBody, peek().line);
    while (true) {
      const Token& t = peek();
      if (t.type == Tok::kEnd) {
        if (!ends.empty()) {
          fail(open_line, "unexpected end of template: the block opened here needs {% " + ends.back() + " %}");
        }
        return body;
      }
      if (t.type == Tok::kText) {
        NodePtr n = node(NodeKind::kText, t.line);
        n->text = next().text;
        body->kids.push_back(n);
      } else if (t.type == Tok::kVarBegin) {
        NodePtr n = node(NodeKind::kOutput, next().line);
        n->a = parse_tuple(true);
        expect(Tok::kVarEnd, "'}}'");
        body->kids.push_back(n);
      } else if (t.type == Tok::kBlockBegin) {
        const Token& name = peek(1);
        if (name.type != Tok::kName) fail(name.line, "expected a tag name after {%, got " + describe(name));
        for (const auto& e : ends) {
          if (name.text == e) {
            next();
            *which = next().text;
            return body;
          }
        }
        next();
        body->kids.push_back(parse_statement());
      } else {
        fail(t.line, "unexpected " + describe(t));
      }
    }
  }

  void end_tag() { expect(Tok::kBlockEnd, "'%}'"); }

  NodePtr parse_statement() {
    const Token& name = next();
    int line = name.line;
    const std::string& kw = name.text;
    std::string which;
    if (kw == "if") {
      NodePtr n = node(NodeKind::kIf, line);
      n->kids.push_back(parse_tuple(false));
      end_tag();
      while (true) {
        n->kids.push_back(parse_body({"elif", "else", "endif"}, &which, line));
        if (which == "elif") {
          n->kids.push_back(parse_tuple(false));
          end_tag();
        } else if (which == "else") {
          end_tag();
          n->b = parse_body({"endif"}, &which, line);
          end_tag();
          return n;
        } else {
          end_tag();
          return n;
        }
      }
    }
    if (kw == "for") {
      NodePtr n = node(NodeKind::kFor, line);
      parse_targets(n->names);
      if (!is_name("in")) fail(peek().line, "expected 'in' in for loop, got " + describe(peek()));
      next();
      n->a = parse_tuple(false);
      if (is_name("if")) {
        next();
        n->d = parse_expression(true);
      }
      if (is_name("recursive")) fail(peek().line, "recursive for loops are not supported");
      end_tag();
      n->b = parse_body({"else", "endfor"}, &which, line);
      end_tag();
      if (which == "else") {
        n->c = parse_body({"endfor"}, &which, line);
        end_tag();
      }
      return n;
    }
    if (kw == "set") {
      std::string first = expect_name();
      if (is_op(".")) {
        next();
        NodePtr n = node(NodeKind::kSet, line);
        n->attr_target = true;
        n->names.push_back(first);
        n->text = expect_name();
        expect_op("=");
        n->a = parse_tuple(true);
        end_tag();
        return n;
      }
      std::vector<std::string> targets{first};
      while (is_op(",")) {
        next();
        targets.push_back(expect_name());
      }
      if (is_op("=")) {
        next();
        NodePtr n = node(NodeKind::kSet, line);
        n->names = targets;
        n->a = parse_tuple(true);
        end_tag();
        return n;
      }
      if (targets.size() != 1) fail(line, "a block set takes one name");
      NodePtr n = node(NodeKind::kSetBlock, line);
      n->names = targets;
      while (is_op("|")) {
        next();
        n->kids.push_back(parse_filter(nullptr));
      }
      end_tag();
      n->a = parse_body({"endset"}, &which, line);
      end_tag();
      return n;
    }
    if (kw == "macro") {
      NodePtr n = node(NodeKind::kMacro, line);
      n->text = expect_name();
      parse_params(n);
      end_tag();
      n->a = parse_body({"endmacro"}, &which, line);
      if (peek().type == Tok::kName) next();  // {% endmacro name %}
      end_tag();
      return n;
    }
    if (kw == "call") {
      NodePtr n = node(NodeKind::kCallBlock, line);
      if (is_op("(")) parse_params(n);
      n->a = parse_expression(true);
      if (n->a->kind != NodeKind::kCall) fail(line, "{% call %} needs a call expression");
      end_tag();
      n->b = parse_body({"endcall"}, &which, line);
      end_tag();
      return n;
    }
    if (kw == "filter") {
      NodePtr n = node(NodeKind::kFilterBlock, line);
      n->kids.push_back(parse_filter(nullptr));
      while (is_op("|")) {
        next();
        n->kids.push_back(parse_filter(nullptr));
      }
      end_tag();
      n->a = parse_body({"endfilter"}, &which, line);
      end_tag();
      return n;
    }
    if (kw == "generation") {  // transformers' AssistantTracker: renders its body unchanged
      end_tag();
      NodePtr body = parse_body({"endgeneration"}, &which, line);
      end_tag();
      return body;
    }
    if (kw == "break" || kw == "continue") {
      end_tag();
      return node(kw == "break" ? NodeKind::kBreak : NodeKind::kContinue, line);
    }
    fail(line, "unknown or unsupported tag '" + kw + "'");
  }

  void parse_targets(std::vector<std::string>& out) {
    bool paren = is_op("(");
    if (paren) next();
    out.push_back(expect_name());
    while (is_op(",")) {
      next();
      if (peek().type != Tok::kName) break;
      out.push_back(expect_name());
    }
    if (paren) expect_op(")");
  }

  void parse_params(NodePtr& n) {
    expect_op("(");
    while (!is_op(")")) {
      n->names.push_back(expect_name());
      if (is_op("=")) {
        next();
        n->kids.push_back(parse_expression(true));
      } else {
        n->kids.push_back(nullptr);
      }
      if (!is_op(",")) break;
      next();
    }
    expect_op(")");
  }

  NodePtr parse_tuple(bool with_cond) {
    int line = peek().line;
    NodePtr first = parse_expression(with_cond);
    if (!is_op(",")) return first;
    NodePtr t = node(NodeKind::kTuple, line);
    t->kids.push_back(first);
    while (is_op(",")) {
      next();
      if (peek().type == Tok::kVarEnd || peek().type == Tok::kBlockEnd || is_op(")") || is_name("if")) break;
      t->kids.push_back(parse_expression(with_cond));
    }
    return t;
  }

  NodePtr parse_expression(bool with_cond) {
    DepthGuard g(*this);
    if (!with_cond) return parse_or();
    NodePtr expr = parse_or();
    while (is_name("if")) {
      int line = next().line;
      NodePtr n = node(NodeKind::kCond, line);
      n->b = expr;
      n->a = parse_or();
      if (is_name("else")) {
        next();
        n->c = parse_expression(true);
      }
      expr = n;
    }
    return expr;
  }

  NodePtr binary(const std::string& op, NodePtr a, NodePtr b, int line) {
    NodePtr n = node(NodeKind::kBinary, line);
    n->text = op;
    n->a = std::move(a);
    n->b = std::move(b);
    return n;
  }

  NodePtr parse_or() {
    NodePtr a = parse_and();
    while (is_name("or")) {
      int line = next().line;
      a = binary("or", a, parse_and(), line);
    }
    return a;
  }
  NodePtr parse_and() {
    NodePtr a = parse_not();
    while (is_name("and")) {
      int line = next().line;
      a = binary("and", a, parse_not(), line);
    }
    return a;
  }
  NodePtr parse_not() {
    if (is_name("not")) {
      DepthGuard g(*this);
      NodePtr n = node(NodeKind::kNot, next().line);
      n->a = parse_not();
      return n;
    }
    return parse_compare();
  }
  NodePtr parse_compare() {
    int line = peek().line;
    NodePtr first = parse_math1();
    NodePtr n;
    while (true) {
      std::string op;
      if (peek().type == Tok::kOp && (peek().text == "==" || peek().text == "!=" || peek().text == "<" ||
                                      peek().text == ">" || peek().text == "<=" || peek().text == ">=")) {
        op = next().text;
      } else if (is_name("in")) {
        next();
        op = "in";
      } else if (is_name("not") && is_name("in", 1)) {
        next();
        next();
        op = "notin";
      } else {
        break;
      }
      if (!n) {
        n = node(NodeKind::kCompare, line);
        n->a = first;
      }
      n->names.push_back(op);
      n->kids.push_back(parse_math1());
    }
    return n ? n : first;
  }
  NodePtr parse_math1() {
    NodePtr a = parse_concat();
    while (is_op("+") || is_op("-")) {
      const Token& t = next();
      a = binary(t.text, a, parse_concat(), t.line);
    }
    return a;
  }
  NodePtr parse_concat() {
    NodePtr a = parse_math2();
    while (is_op("~")) {
      int line = next().line;
      a = binary("~", a, parse_math2(), line);
    }
    return a;
  }
  NodePtr parse_math2() {
    NodePtr a = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const Token& t = next();
      a = binary(t.text, a, parse_pow(), t.line);
    }
    return a;
  }
  NodePtr parse_pow() {
    NodePtr a = parse_unary(true);
    while (is_op("**")) {
      int line = next().line;
      a = binary("**", a, parse_unary(true), line);
    }
    return a;
  }
  NodePtr parse_unary(bool with_filter) {
    DepthGuard g(*this);
    NodePtr n;
    if (is_op("-") || is_op("+")) {
      const Token& t = next();
      n = node(t.text == "-" ? NodeKind::kNeg : NodeKind::kPos, t.line);
      n->a = parse_unary(false);
    } else {
      n = parse_postfix(parse_primary());
    }
    if (with_filter) n = parse_filter_expr(n);
    return n;
  }

  NodePtr parse_primary() {
    DepthGuard g(*this);
    const Token& t = peek();
    int line = t.line;
    if (t.type == Tok::kName) {
      next();
      NodePtr n = node(NodeKind::kLiteral, line);
      if (t.text == "true" || t.text == "True")
        n->value = Value(true);
      else if (t.text == "false" || t.text == "False")
        n->value = Value(false);
      else if (t.text == "none" || t.text == "None")
        n->value = Value(None{});
      else {
        n->kind = NodeKind::kName;
        n->text = t.text;
      }
      return n;
    }
    if (t.type == Tok::kString) {
      std::string s;
      while (peek().type == Tok::kString) s += next().text;
      NodePtr n = node(NodeKind::kLiteral, line);
      n->value = Value(std::move(s));
      return n;
    }
    if (t.type == Tok::kInt || t.type == Tok::kFloat) {
      next();
      NodePtr n = node(NodeKind::kLiteral, line);
      n->value = t.type == Tok::kInt ? Value(t.ival) : Value(t.fval);
      return n;
    }
    if (is_op("(")) {
      next();
      if (is_op(")")) {
        next();
        return node(NodeKind::kTuple, line);
      }
      NodePtr inner = parse_tuple(true);
      if (inner->kind == NodeKind::kTuple || !is_op(",")) {
        expect_op(")");
        return inner;
      }
      expect_op(")");
      return inner;
    }
    if (is_op("[")) {
      next();
      NodePtr n = node(NodeKind::kList, line);
      while (!is_op("]")) {
        n->kids.push_back(parse_expression(true));
        if (!is_op(",")) break;
        next();
      }
      expect_op("]");
      return n;
    }
    if (is_op("{")) {
      next();
      NodePtr n = node(NodeKind::kDictLit, line);
      while (!is_op("}")) {
        n->kids.push_back(parse_expression(true));
        expect_op(":");
        n->kids.push_back(parse_expression(true));
        if (!is_op(",")) break;
        next();
      }
      expect_op("}");
      return n;
    }
    fail(line, "unexpected " + describe(t) + " in expression");
  }

  void parse_call_args(NodePtr& n) {
    expect_op("(");
    while (!is_op(")")) {
      if (peek().type == Tok::kName && is_op("=", 1)) {
        n->kwnames.push_back(next().text);
        next();
        n->kwargs.push_back(parse_expression(true));
      } else {
        if (!n->kwnames.empty()) fail(peek().line, "positional argument after keyword argument");
        n->kids.push_back(parse_expression(true));
      }
      if (!is_op(",")) break;
      next();
    }
    expect_op(")");
  }

  NodePtr parse_postfix(NodePtr n) {
    while (true) {
      DepthGuard g(*this);
      int line = peek().line;
      if (is_op(".")) {
        next();
        if (peek().type == Tok::kInt) {
          NodePtr item = node(NodeKind::kItem, line);
          item->a = n;
          item->b = node(NodeKind::kLiteral, line);
          item->b->value = Value(next().ival);
          n = item;
          continue;
        }
        NodePtr attr = node(NodeKind::kAttr, line);
        attr->a = n;
        attr->text = expect_name();
        n = attr;
      } else if (is_op("[")) {
        next();
        NodePtr start, stop, step;
        bool slice = false;
        if (!is_op(":")) start = parse_expression(true);
        if (is_op(":")) {
          slice = true;
          next();
          if (!is_op(":") && !is_op("]")) stop = parse_expression(true);
          if (is_op(":")) {
            next();
            if (!is_op("]")) step = parse_expression(true);
          }
        }
        expect_op("]");
        if (slice) {
          NodePtr s = node(NodeKind::kSlice, line);
          s->a = n;
          s->b = start;
          s->c = stop;
          s->d = step;
          n = s;
        } else {
          NodePtr item = node(NodeKind::kItem, line);
          item->a = n;
          item->b = start;
          n = item;
        }
      } else if (is_op("(")) {
        NodePtr call = node(NodeKind::kCall, line);
        call->a = n;
        parse_call_args(call);
        n = call;
      } else {
        return n;
      }
    }
  }

  NodePtr parse_filter(NodePtr operand) {
    int line = peek().line;
    NodePtr f = node(NodeKind::kFilter, line);
    f->text = expect_name();
    while (is_op(".")) {  // dotted filter names
      next();
      f->text += "." + expect_name();
    }
    f->a = std::move(operand);
    if (is_op("(")) parse_call_args(f);
    return f;
  }

  NodePtr parse_filter_expr(NodePtr n) {
    while (true) {
      DepthGuard g(*this);
      if (is_op("|")) {
        next();
        n = parse_filter(n);
      } else if (is_name("is")) {
        int line = next().line;
        NodePtr t = node(NodeKind::kTest, line);
        if (is_name("not")) {
          next();
          t->negated = true;
        }
        t->text = expect_name();
        t->a = n;
        if (is_op("(")) {
          parse_call_args(t);
        } else if ((peek().type == Tok::kName && !is_keyword(peek().text)) || peek().type == Tok::kString ||
                   peek().type == Tok::kInt || peek().type == Tok::kFloat || is_op("[") || is_op("{")) {
          t->kids.push_back(parse_postfix(parse_primary()));
        }
        n = t;
      } else if (is_op("(")) {
        NodePtr call = node(NodeKind::kCall, peek().line);
        call->a = n;
        parse_call_args(call);
        n = call;
      } else {
        return n;
      }
    }
  }

  std::vector<Token> t_;
  size_t i_ = 0;
  const std::string& origin_;
  int depth_ = 0;
};

}  // namespace

NodePtr parse_template(const std::string& source, const std::string& origin) {
  std::vector<Token> tokens = Lexer(source, origin).run();
  return Parser(std::move(tokens), origin).parse_root();
}

}  // namespace chimera::chat::jinja
