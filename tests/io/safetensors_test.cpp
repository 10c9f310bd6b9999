#include "io/safetensors.h"

#include <cstring>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/compare.h"
#include "io/io_test_util.h"

namespace chimera {
namespace {

using test::read_file;
using test::TempDir;
using test::write_file;

// A host tensor of `dtype` filled with random bytes (any bit pattern is fine for a byte round trip).
Tensor random_tensor(test::Rng& rng, DType dtype, Shape shape) {
  Tensor t = Tensor::empty(dtype, std::move(shape));
  auto* p = static_cast<unsigned char*>(t.data());
  for (size_t i = 0; i < t.nbytes(); ++i) p[i] = static_cast<unsigned char>(rng.integer(0, 255));
  return t;
}

// [u64 LE header length][header][data]
std::string raw_file(const std::string& header, const std::string& data, std::optional<uint64_t> len = {}) {
  const uint64_t n = len.value_or(header.size());
  std::string r(8, '\0');
  for (int i = 0; i < 8; ++i) r[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  return r + header + data;
}

uint64_t header_len_of(const std::string& bytes) {
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[static_cast<size_t>(i)]);
  return n;
}

TEST(Safetensors, RoundTripEveryDtype) {
  TempDir dir;
  auto rng = test::Rng::for_test();
  std::vector<std::pair<std::string, Tensor>> tensors = {
      {"f32", random_tensor(rng, DType::kF32, {3, 5})},     {"bf16", random_tensor(rng, DType::kBF16, {7})},
      {"f16", random_tensor(rng, DType::kF16, {2, 3, 1})},  {"f8", random_tensor(rng, DType::kF8E4M3, {19})},
      {"u8", random_tensor(rng, DType::kU8, {1})},          {"i8", random_tensor(rng, DType::kI8, {3, 3})},
      {"i32", random_tensor(rng, DType::kI32, {11})},       {"i64", random_tensor(rng, DType::kI64, {2, 2})},
      {"scalar", random_tensor(rng, DType::kF32, {})},      {"empty", random_tensor(rng, DType::kBF16, {0, 4})},
  };
  const auto path = dir / "model.safetensors";
  write_safetensors(path, tensors, {{"format", "pt"}});

  // HF layout: header padded with spaces to a multiple of 8, keys sorted.
  const std::string bytes = read_file(path);
  const uint64_t hlen = header_len_of(bytes);
  EXPECT_EQ(hlen % 8, 0u);
  const std::string header = bytes.substr(8, hlen);
  EXPECT_EQ(header.find_last_not_of(' '), header.rfind('}'));  // only spaces after the JSON
  EXPECT_TRUE(nlohmann::json::accept(header));
  EXPECT_LT(header.find("\"__metadata__\""), header.find("\"bf16\""));
  EXPECT_LT(header.find("\"bf16\""), header.find("\"f16\""));
  EXPECT_LT(header.find("\"i64\""), header.find("\"u8\""));

  Tensor keep;
  {
    auto f = SafetensorsFile::open(path);
    EXPECT_EQ(f->metadata().at("format"), "pt");
    std::vector<std::string> want_names;
    for (const auto& [name, t] : tensors) want_names.push_back(name);
    std::sort(want_names.begin(), want_names.end());
    EXPECT_EQ(f->names(), want_names);
    for (const auto& [name, want] : tensors) {
      SCOPED_TRACE(name);
      ASSERT_TRUE(f->contains(name));
      const TensorInfo& info = f->info(name);
      EXPECT_EQ(info.dtype, want.dtype());
      EXPECT_EQ(info.shape, want.shape());
      EXPECT_EQ(info.file, path);
      const Tensor got = f->tensor(name);
      EXPECT_EQ(got.dtype(), want.dtype());
      EXPECT_EQ(got.shape(), want.shape());
      EXPECT_TRUE(test::bit_equal(got, want));
    }
    EXPECT_FALSE(f->contains("nope"));
    EXPECT_INVALID(f->info("nope"), path.string(), "'nope'");
    keep = f->tensor("i32");
  }
  // The view keeps the mapping alive after the file object is gone.
  EXPECT_TRUE(test::bit_equal(keep, tensors[6].second));
}

TEST(Safetensors, TruncatedDataSection) {
  TempDir dir;
  auto rng = test::Rng::for_test();
  const auto path = dir / "model.safetensors";
  write_safetensors(path, {{"a", random_tensor(rng, DType::kF32, {4})}, {"b", random_tensor(rng, DType::kF32, {8})}});
  std::filesystem::resize_file(path, std::filesystem::file_size(path) - 5);
  EXPECT_INVALID(SafetensorsFile::open(path), path.string(), "tensor 'b'", "data_offsets [16, 48]",
                 "beyond the data section of 43 bytes");
}

TEST(Safetensors, HeaderLengthBeyondFile) {
  TempDir dir;
  const auto path = dir / "x.safetensors";
  write_file(path, raw_file("{}", "", 1000));
  EXPECT_INVALID(SafetensorsFile::open(path), path.string(), "header length field exceeds the 2 bytes after it");
}

TEST(Safetensors, FileOfThreeBytes) {
  TempDir dir;
  const auto path = dir / "tiny.safetensors";
  write_file(path, "abc");
  EXPECT_INVALID(SafetensorsFile::open(path), path.string(), "file is 3 bytes");
}

TEST(Safetensors, MissingFile) {
  TempDir dir;
  EXPECT_INVALID(SafetensorsFile::open(dir / "absent.safetensors"), "absent.safetensors", "cannot open");
}

TEST(Safetensors, MalformedHeaderJson) {
  TempDir dir;
  const auto path = dir / "bad.safetensors";
  write_file(path, raw_file("{\"a\": {\"dtype\": ", ""));
  EXPECT_INVALID(SafetensorsFile::open(path), path.string(), "header: not valid JSON");
  write_file(path, raw_file("[1, 2]", ""));
  EXPECT_INVALID(SafetensorsFile::open(path), path.string(), "header must be a JSON object", "array");
}

TEST(Safetensors, MetadataMustMapStringsToStrings) {
  TempDir dir;
  const auto path = dir / "meta.safetensors";
  write_file(path, raw_file(R"({"__metadata__": {"format": 1}})", ""));
  EXPECT_INVALID(SafetensorsFile::open(path), path.string(), "'__metadata__' entry 'format' must be a string");
  write_file(path, raw_file(R"({"__metadata__": "pt"})", ""));
  EXPECT_INVALID(SafetensorsFile::open(path), path.string(), "'__metadata__' must be an object");
}

TEST(Safetensors, OverlappingOffsets) {
  TempDir dir;
  const auto path = dir / "overlap.safetensors";
  write_file(path, raw_file(R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},)"
                            R"( "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}})",
                            std::string(16, '\0')));
  EXPECT_INVALID(SafetensorsFile::open(path), path.string(), "tensor 'b'", "overlap tensor 'a'");
}

TEST(Safetensors, DuplicateNameInHeader) {
  TempDir dir;
  const auto path = dir / "dup.safetensors";
  write_file(path, raw_file(R"({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},)"
                            R"( "a": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}})",
                            "xy"));
  EXPECT_INVALID(SafetensorsFile::open(path), path.string(), "key 'a' appears twice");
}

TEST(Safetensors, HolesAreAllowed) {
  TempDir dir;
  const auto path = dir / "holes.safetensors";
  std::string data(24, '\0');
  const float v = 3.5f;
  std::memcpy(&data[20], &v, 4);
  write_file(path, raw_file(R"({"a": {"dtype": "U8", "shape": [3], "data_offsets": [1, 4]},)"
                            R"( "b": {"dtype": "F32", "shape": [1], "data_offsets": [20, 24]}})",
                            data));
  auto f = SafetensorsFile::open(path);
  // The view may be misaligned for F32 (the data section starts 8 + header length bytes in): read by memcpy.
  float got = 0.0f;
  std::memcpy(&got, f->tensor("b").data(), 4);
  EXPECT_EQ(got, 3.5f);
}

TEST(Safetensors, ByteLengthMustMatchShape) {
  TempDir dir;
  const auto path = dir / "model.safetensors";
  write_file(path, raw_file(R"({"backbone.norm_f.weight": {"dtype": "BF16", "shape": [64], "data_offsets": [0, 100]}})",
                            std::string(128, '\0')));
  EXPECT_INVALID(SafetensorsFile::open(path),
                 path.string() + ": tensor 'backbone.norm_f.weight': data_offsets [0, 100] hold 100 bytes but "
                                 "BF16[64] needs 128");
}

TEST(Safetensors, UnknownDtype) {
  TempDir dir;
  const auto path = dir / "f64.safetensors";
  write_file(path, raw_file(R"({"w": {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]}})", std::string(8, '\0')));
  EXPECT_INVALID(SafetensorsFile::open(path), path.string(), "tensor 'w'", "unsupported dtype 'F64'",
                 "F32, BF16, F16, F8_E4M3, U8, I8, I32, I64");
  write_file(path, raw_file(R"({"mask": {"dtype": "BOOL", "shape": [1], "data_offsets": [0, 1]}})", "x"));
  EXPECT_INVALID(SafetensorsFile::open(path), path.string(), "tensor 'mask'", "unsupported dtype 'BOOL'");
}

TEST(Safetensors, BadShapesAndOffsets) {
  TempDir dir;
  const auto path = dir / "bad.safetensors";
  write_file(path, raw_file(R"({"w": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 1]}})", "x"));
  EXPECT_INVALID(SafetensorsFile::open(path), path.string(), "tensor 'w'", "non-negative integers");
  write_file(path, raw_file(R"({"w": {"dtype": "U8", "shape": [1], "data_offsets": [1, 0]}})", "xx"));
  EXPECT_INVALID(SafetensorsFile::open(path), path.string(), "tensor 'w'", "begin > end");
  write_file(path, raw_file(R"({"w": {"dtype": "U8", "shape": [1]}})", "x"));
  EXPECT_INVALID(SafetensorsFile::open(path), path.string(), "tensor 'w'", "'data_offsets'");
  write_file(path, raw_file(R"({"w": {"shape": [1], "data_offsets": [0, 1]}})", "x"));
  EXPECT_INVALID(SafetensorsFile::open(path), path.string(), "tensor 'w'", "'dtype'");
  write_file(path, raw_file(R"({"w": {"dtype": "U8", "data_offsets": [0, 1]}})", "x"));
  EXPECT_INVALID(SafetensorsFile::open(path), path.string(), "tensor 'w'", "'shape'");
  write_file(path, raw_file(R"({"w": 7})", ""));
  EXPECT_INVALID(SafetensorsFile::open(path), path.string(), "tensor 'w'", "must be an object");
}

// ---- Checkpoint ------------------------------------------------------------------------------------

void write_index(const std::filesystem::path& dir, const std::map<std::string, std::string>& weight_map) {
  nlohmann::json j = {{"metadata", {{"total_size", 0}}}, {"weight_map", weight_map}};
  write_file(dir / "model.safetensors.index.json", j.dump(2));
}

TEST(Checkpoint, SingleFile) {
  TempDir dir;
  auto rng = test::Rng::for_test();
  const Tensor a = random_tensor(rng, DType::kBF16, {4, 3});
  write_safetensors(dir / "model.safetensors", {{"a", a}});
  write_safetensors(dir / "ignored.safetensors", {{"other", a}});  // model.safetensors wins over the glob
  const Checkpoint ck = Checkpoint::open(dir.path());
  EXPECT_EQ(ck.names(), std::vector<std::string>{"a"});
  EXPECT_TRUE(test::bit_equal(ck.tensor("a"), a));
  EXPECT_EQ(ck.dir(), dir.path());
  EXPECT_INVALID(ck.tensor("missing"), dir.path().string(), "'missing'");
}

TEST(Checkpoint, ShardedThroughIndex) {
  TempDir dir;
  auto rng = test::Rng::for_test();
  const Tensor a = random_tensor(rng, DType::kF32, {5});
  const Tensor b = random_tensor(rng, DType::kBF16, {2, 7});
  const Tensor c = random_tensor(rng, DType::kI64, {3});
  write_safetensors(dir / "model-00001-of-00002.safetensors", {{"a", a}, {"b", b}});
  write_safetensors(dir / "model-00002-of-00002.safetensors", {{"c", c}});
  write_index(dir.path(), {{"a", "model-00001-of-00002.safetensors"},
                           {"b", "model-00001-of-00002.safetensors"},
                           {"c", "model-00002-of-00002.safetensors"}});
  const Checkpoint ck = Checkpoint::open(dir.path());
  EXPECT_EQ(ck.names(), (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_TRUE(test::bit_equal(ck.tensor("a"), a));
  EXPECT_TRUE(test::bit_equal(ck.tensor("b"), b));
  EXPECT_TRUE(test::bit_equal(ck.tensor("c"), c));
  EXPECT_EQ(ck.info("c").file, dir / "model-00002-of-00002.safetensors");
}

TEST(Checkpoint, IndexNamesMissingShard) {
  TempDir dir;
  auto rng = test::Rng::for_test();
  write_safetensors(dir / "model-00001-of-00002.safetensors", {{"a", random_tensor(rng, DType::kF32, {2})}});
  write_index(dir.path(), {{"a", "model-00001-of-00002.safetensors"}, {"c", "model-00002-of-00002.safetensors"}});
  EXPECT_INVALID(Checkpoint::open(dir.path()), "model.safetensors.index.json", "model-00002-of-00002.safetensors",
                 "tensor 'c'", "does not exist");
}

TEST(Checkpoint, IndexNameMissingFromItsShard) {
  TempDir dir;
  auto rng = test::Rng::for_test();
  write_safetensors(dir / "model-00001-of-00002.safetensors", {{"a", random_tensor(rng, DType::kF32, {2})}});
  write_safetensors(dir / "model-00002-of-00002.safetensors", {{"c", random_tensor(rng, DType::kF32, {2})}});
  write_index(dir.path(), {{"a", "model-00001-of-00002.safetensors"},
                           {"b", "model-00002-of-00002.safetensors"},
                           {"c", "model-00002-of-00002.safetensors"}});
  EXPECT_INVALID(Checkpoint::open(dir.path()), "model.safetensors.index.json", "tensor 'b'",
                 "model-00002-of-00002.safetensors", "has no such tensor");
}

TEST(Checkpoint, MalformedIndex) {
  TempDir dir;
  write_file(dir / "model.safetensors.index.json", "{\"weight_map\": ");
  EXPECT_INVALID(Checkpoint::open(dir.path()), "model.safetensors.index.json", "not valid JSON");
  write_file(dir / "model.safetensors.index.json", R"({"metadata": {}})");
  EXPECT_INVALID(Checkpoint::open(dir.path()), "model.safetensors.index.json", "'weight_map'");
}

TEST(Checkpoint, DuplicateNamesAcrossShards) {
  TempDir dir;
  auto rng = test::Rng::for_test();
  write_safetensors(dir / "part-a.safetensors", {{"x", random_tensor(rng, DType::kF32, {2})}});
  write_safetensors(dir / "part-b.safetensors", {{"x", random_tensor(rng, DType::kF32, {2})}});
  EXPECT_INVALID(Checkpoint::open(dir.path()), "tensor 'x'", "part-a.safetensors", "part-b.safetensors");
}

TEST(Checkpoint, GlobFallbackReadsEveryFile) {
  TempDir dir;
  auto rng = test::Rng::for_test();
  const Tensor x = random_tensor(rng, DType::kF16, {3});
  const Tensor y = random_tensor(rng, DType::kU8, {9});
  write_safetensors(dir / "b.safetensors", {{"y", y}});
  write_safetensors(dir / "a.safetensors", {{"x", x}});
  const Checkpoint ck = Checkpoint::open(dir.path());
  EXPECT_EQ(ck.names(), (std::vector<std::string>{"x", "y"}));
  EXPECT_TRUE(test::bit_equal(ck.tensor("y"), y));
}

TEST(Checkpoint, MissingOrEmptyDirectory) {
  TempDir dir;
  const auto missing = dir / "no-such-model";
  EXPECT_INVALID(Checkpoint::open(missing), "model directory '" + missing.string() + "' does not exist");
  write_file(dir / "config.json", "{}");
  EXPECT_INVALID(Checkpoint::open(dir.path()), dir.path().string(), "model.safetensors.index.json",
                 "model.safetensors", "*.safetensors");
}

}  // namespace
}  // namespace chimera

// ---- hostile checkpoints ---------------------------------------------------------------------------

namespace chimera {
namespace {

void write_index_json(const std::filesystem::path& dir, const std::string& text) {
  write_file(dir / "model.safetensors.index.json", text);
}

TEST(Checkpoint, IndexShardOutsideTheModelDirectoryIsRefusedNamingTheEntry) {
  TempDir root;
  const auto dir = root / "model";
  std::filesystem::create_directories(dir);
  auto rng = test::Rng::for_test();
  write_safetensors(dir / "model-00001-of-00001.safetensors", {{"a", random_tensor(rng, DType::kF32, {2})}});
  // Another model's valid file: opening it would load foreign weights.
  write_safetensors(root / "other.safetensors", {{"b", random_tensor(rng, DType::kF32, {2})}});
  write_file(root / "passwd", "root:x:0:0:root:/root:/bin/bash\n");
  for (const std::string& shard : {std::string("../other.safetensors"), std::string("../../../../etc/passwd"),
                                   (root / "other.safetensors").string(), std::string("/etc/passwd"),
                                   std::string("sub/../../passwd")}) {
    write_index_json(dir, nlohmann::json{{"weight_map", {{"a", "model-00001-of-00001.safetensors"}, {"b", shard}}}}
                              .dump());
    EXPECT_INVALID(Checkpoint::open(dir), "model.safetensors.index.json", "tensor 'b'", shard);
    try {
      Checkpoint::open(dir);
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()).find("header length"), std::string::npos) << "opened the file: " << e.what();
    }
  }
}

TEST(Checkpoint, ShardLinkLeavingTheModelDirectoryIsRefused) {
  TempDir root;
  const auto dir = root / "model";
  std::filesystem::create_directories(dir);
  auto rng = test::Rng::for_test();
  write_safetensors(root / "outside.safetensors", {{"a", random_tensor(rng, DType::kF32, {2})}});
  std::filesystem::create_symlink(root / "outside.safetensors", dir / "model-00001-of-00001.safetensors");
  write_index_json(dir, R"({"weight_map": {"a": "model-00001-of-00001.safetensors"}})");
  EXPECT_INVALID(Checkpoint::open(dir), "tensor 'a'", "outside the model directory");
  // The single-file layout and the *.safetensors fallback are confined the same way.
  std::filesystem::remove(dir / "model.safetensors.index.json");
  std::filesystem::rename(dir / "model-00001-of-00001.safetensors", dir / "model.safetensors");
  EXPECT_INVALID(Checkpoint::open(dir), "model.safetensors", "outside the model directory");
  std::filesystem::rename(dir / "model.safetensors", dir / "weights.safetensors");
  EXPECT_INVALID(Checkpoint::open(dir), "weights.safetensors", "outside the model directory");
}

TEST(Checkpoint, LinksInsideTheDirectoryAndTheHfCacheLayoutLoad) {
  TempDir root;
  auto rng = test::Rng::for_test();
  const Tensor a = random_tensor(rng, DType::kF32, {3});
  // A link to a file in a subdirectory of the model directory.
  const auto dir = root / "model";
  std::filesystem::create_directories(dir / "store");
  write_safetensors(dir / "store" / "w.safetensors", {{"a", a}});
  std::filesystem::create_symlink("store/w.safetensors", dir / "model.safetensors");
  EXPECT_TRUE(test::bit_equal(Checkpoint::open(dir).tensor("a"), a));
  // HF hub cache: snapshots/REV/FILE -> ../../blobs/SHA.
  const auto snap = root / "models--x" / "snapshots" / "0123abc";
  std::filesystem::create_directories(snap);
  std::filesystem::create_directories(root / "models--x" / "blobs");
  write_safetensors(root / "models--x" / "blobs" / "deadbeef", {{"a", a}});
  std::filesystem::create_symlink("../../blobs/deadbeef", snap / "model-00001-of-00001.safetensors");
  write_index_json(snap, R"({"weight_map": {"a": "model-00001-of-00001.safetensors"}})");
  EXPECT_TRUE(test::bit_equal(Checkpoint::open(snap).tensor("a"), a));
}

TEST(Checkpoint, IndexJsonErrorsNameTheIndex) {
  TempDir dir;
  write_index_json(dir.path(), R"({"metadata": {"total_size": 1e400}, "weight_map": {}})");
  EXPECT_INVALID(Checkpoint::open(dir.path()), "model.safetensors.index.json", "outside the range of a double");
  write_index_json(dir.path(), R"({"weight_map": {"a": "x.safetensors", "a": "y.safetensors"}})");
  EXPECT_INVALID(Checkpoint::open(dir.path()), "model.safetensors.index.json", "key 'a' appears twice");
  write_index_json(dir.path(), R"({"weight_map": {"a": ""}})");
  EXPECT_INVALID(Checkpoint::open(dir.path()), "model.safetensors.index.json", "tensor 'a'", "empty");
}

TEST(Checkpoint, ModelDirectoryThatIsAFileSaysSo) {
  TempDir dir;
  write_file(dir / "f", "x");
  EXPECT_INVALID(Checkpoint::open(dir / "f"), "is a file");
}

TEST(Safetensors, HeaderNumberOutsideADoubleNamesTheFile) {
  TempDir dir;
  const auto path = dir / "big.safetensors";
  write_file(path, raw_file(R"({"w": {"dtype": "U8", "shape": [1e400], "data_offsets": [0, 1]}})", "x"));
  EXPECT_INVALID(SafetensorsFile::open(path), path.string(), "outside the range of a double");
}

TEST(Safetensors, AnotherFilesBytesAreNeverPrintedAsALength) {
  TempDir dir;
  const auto path = dir / "passwd";
  const std::string text = "root:x:0:0:root:/root:/bin/bash\n";
  write_file(path, text);
  uint64_t as_length = 0;
  for (int i = 7; i >= 0; --i) as_length = (as_length << 8) | static_cast<unsigned char>(text[static_cast<size_t>(i)]);
  EXPECT_INVALID(SafetensorsFile::open(path), path.string(), "not a safetensors file");
  try {
    SafetensorsFile::open(path);
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).find(std::to_string(as_length)), std::string::npos) << e.what();
  }
}

TEST(Safetensors, FromMemoryChecksLikeOpen) {
  const std::string bytes = raw_file(R"({"w": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}})", "ab");
  std::shared_ptr<void> buf(new char[bytes.size()], [](void* p) { delete[] static_cast<char*>(p); });
  std::memcpy(buf.get(), bytes.data(), bytes.size());
  const auto f = SafetensorsFile::from_memory(buf, bytes.size(), "mem.safetensors");
  EXPECT_EQ(f->names(), std::vector<std::string>{"w"});
  EXPECT_INVALID(SafetensorsFile::from_memory(buf, bytes.size() - 1, "mem.safetensors"), "mem.safetensors",
                 "tensor 'w'", "beyond the data section");
}

}  // namespace
}  // namespace chimera
