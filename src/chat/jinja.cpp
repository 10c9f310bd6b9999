#include "chat/jinja.h"

#include "chat/jinja_ast.h"
#include "chat/jinja_interp.h"

namespace chimera::chat::jinja {

Template Template::parse(const std::string& source, std::string origin) {
  Template t;
  t.origin_ = std::move(origin);
  t.root_ = parse_template(source, t.origin_);
  return t;
}

std::string Template::render(const nlohmann::ordered_json& vars, const Budget& budget) const {
  Interpreter in(origin_, budget);
  return in.run(*root_, vars);
}

}  // namespace chimera::chat::jinja
