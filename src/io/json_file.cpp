#include "io/json_file.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <set>
#include <vector>

#include "core/error.h"

namespace chimera {

namespace fs = std::filesystem;
using json = nlohmann::json;

json parse_json(std::string_view text, const std::string& source, DuplicateKeys duplicates) {
  // One set of keys per open object: object_start pushes, key inserts, object_end pops. Arrays need no entry
  // since keys only occur directly inside objects.
  std::vector<std::set<std::string>> open_objects;
  const json::parser_callback_t check = [&](int depth, json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start:
        if (depth >= kMaxJsonDepth) {
          invalid_input("{}: JSON nested deeper than {} levels", source, kMaxJsonDepth);
        }
        if (event == json::parse_event_t::object_start && duplicates == DuplicateKeys::kReject) {
          open_objects.emplace_back();
        }
        break;
      case json::parse_event_t::object_end:
        if (duplicates == DuplicateKeys::kReject && !open_objects.empty()) open_objects.pop_back();
        break;
      case json::parse_event_t::key:
        if (duplicates == DuplicateKeys::kReject && !open_objects.empty() &&
            !open_objects.back().insert(parsed.get<std::string>()).second) {
          invalid_input("{}: key '{}' appears twice in one object", source, parsed.get<std::string>());
        }
        break;
      default: break;
    }
    return true;
  };
  try {
    return json::parse(text.begin(), text.end(), check);
  } catch (const json::out_of_range& e) {
    // 406: a number the lexer read as +-inf (1e400): outside a double.
    invalid_input("{}: {}", source,
                  e.id == 406 ? std::string("a number is outside the range of a double: ") + e.what() : e.what());
  } catch (const json::exception& e) {
    invalid_input("{}: not valid JSON: {}", source, e.what());
  }
}

std::string read_text_file(const fs::path& path, const std::string& what, size_t max_bytes) {
  const std::string p = path.string();
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (ec || !fs::exists(st)) invalid_input("{}: {} does not exist", p, what);
  if (fs::is_directory(st)) invalid_input("{}: {} is a directory, expected a file", p, what);
  if (!fs::is_regular_file(st)) invalid_input("{}: {} is not a regular file", p, what);
  const uintmax_t size = fs::file_size(path, ec);
  if (ec) invalid_input("{}: cannot read the size of the {}: {}", p, what, ec.message());
  if (size > max_bytes) {
    invalid_input("{}: {} is {} bytes, more than the {} bytes accepted", p, what, size, max_bytes);
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) invalid_input("{}: cannot open the {}: {}", p, what, std::strerror(errno));
  std::string text(static_cast<size_t>(size), '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  if (static_cast<uintmax_t>(in.gcount()) != size) invalid_input("{}: reading the {} failed", p, what);
  return text;
}

}  // namespace chimera
