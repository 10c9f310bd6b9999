// parse_json / read_text_file: every way user-supplied JSON can be bad is kInvalidInput naming the source.
#include "io/json_file.h"

#include <gtest/gtest.h>

#include "io/io_test_util.h"

namespace chimera {
namespace {

using test::TempDir;
using test::write_file;

TEST(JsonFile, NumbersOutsideADoubleNameTheFile) {
  EXPECT_INVALID(parse_json(R"({"a": 1e400})", "cfg.json"), "cfg.json", "outside the range of a double", "1e400");
  EXPECT_INVALID(parse_json(R"([-1e999])", "x.json"), "x.json", "outside the range of a double");
  EXPECT_EQ(parse_json(R"({"a": 1e300})", "ok.json")["a"].get<double>(), 1e300);
}

TEST(JsonFile, SyntaxErrorsNameTheFile) {
  EXPECT_INVALID(parse_json(R"({"a": )", "cfg.json"), "cfg.json", "not valid JSON");
  EXPECT_INVALID(parse_json("", "empty.json"), "empty.json", "not valid JSON");
  EXPECT_INVALID(parse_json("{\"a\": \"\xff\"}", "bytes.json"), "bytes.json", "not valid JSON");
}

TEST(JsonFile, DuplicateKeysAtAnyDepthAreRejected) {
  EXPECT_INVALID(parse_json(R"({"a": 1, "a": 2})", "cfg.json"), "cfg.json", "key 'a' appears twice");
  EXPECT_INVALID(parse_json(R"({"x": [{"b": 1, "c": {"d": 1, "d": 1}}]})", "cfg.json"), "key 'd' appears twice");
  // The same key in sibling objects is not a duplicate.
  EXPECT_NO_THROW(parse_json(R"({"a": {"k": 1}, "b": {"k": 2}, "k": [{"k": 3}, {"k": 4}]})", "ok.json"));
  EXPECT_EQ(parse_json(R"({"a": 1, "a": 2})", "tok.json", DuplicateKeys::kKeepLast)["a"], 2);
}

TEST(JsonFile, DeepNestingIsRefusedNotACrash) {
  EXPECT_INVALID(parse_json(std::string(100000, '['), "deep.json"), "deep.json", "nested deeper than");
  std::string ok = std::string(kMaxJsonDepth - 1, '[') + std::string(kMaxJsonDepth - 1, ']');
  EXPECT_NO_THROW(parse_json(ok, "ok.json"));
}

TEST(JsonFile, ReadTextFileNamesMissingDirectoryAndOversizedFiles) {
  TempDir dir;
  EXPECT_INVALID(read_text_file(dir / "absent.json", "config file", 100), "absent.json", "does not exist");
  EXPECT_INVALID(read_text_file(dir.path(), "config file", 100), dir.path().string(), "is a directory");
  write_file(dir / "big.json", std::string(101, ' '));
  EXPECT_INVALID(read_text_file(dir / "big.json", "config file", 100), "big.json", "101 bytes", "100");
  write_file(dir / "ok.json", "{}");
  EXPECT_EQ(read_text_file(dir / "ok.json", "config file", 100), "{}");
}

}  // namespace
}  // namespace chimera
