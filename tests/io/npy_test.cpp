#include "io/npy.h"

#include <cstring>

#include <gtest/gtest.h>

#include "common/compare.h"
#include "io/io_test_util.h"

namespace chimera {
namespace {

using test::read_file;
using test::TempDir;
using test::write_file;

// A .npy file with the given header dict text (padded to 64 bytes) and data bytes.
std::string npy_bytes(const std::string& dict, const std::string& data, int major = 1) {
  std::string header = dict;
  const size_t prefix = major == 1 ? 10 : 12;
  const size_t total = (prefix + header.size() + 1 + 63) / 64 * 64;
  header.append(total - prefix - header.size() - 1, ' ');
  header += '\n';
  std::string r = "\x93NUMPY";
  r += static_cast<char>(major);
  r += '\0';
  const size_t n = header.size();
  r += static_cast<char>(n & 0xff);
  r += static_cast<char>((n >> 8) & 0xff);
  if (major != 1) {
    r += static_cast<char>((n >> 16) & 0xff);
    r += static_cast<char>((n >> 24) & 0xff);
  }
  return r + header + data;
}

template <typename T>
std::string bytes_of(std::initializer_list<T> v) {
  std::string s(v.size() * sizeof(T), '\0');
  std::memcpy(s.data(), std::data(v), s.size());
  return s;
}

TEST(Npy, RoundTripF32I32I64) {
  TempDir dir;
  auto rng = test::Rng::for_test();
  const Tensor f = rng.normal_tensor({3, 7, 2});
  Tensor i32 = Tensor::empty(DType::kI32, {19});
  for (int64_t k = 0; k < i32.numel(); ++k) i32.i32()[k] = static_cast<int32_t>(rng.integer(-1000000, 1000000));
  Tensor i64 = Tensor::empty(DType::kI64, {2, 3});
  for (int64_t k = 0; k < i64.numel(); ++k) i64.data_as<int64_t>()[k] = rng.integer(INT64_MIN / 2, INT64_MAX / 2);
  const Tensor scalar = Tensor::from_f32({}, std::vector<float>{rng.normal()});
  const Tensor empty = Tensor::empty(DType::kF32, {0, 5});
  for (const Tensor& t : {f, i32, i64, scalar, empty}) {
    SCOPED_TRACE(t.describe());
    const auto path = dir / "t.npy";
    write_npy(path, t);
    const std::string bytes = read_file(path);
    EXPECT_EQ(bytes.substr(0, 8), std::string("\x93NUMPY\x01\x00", 8));
    const size_t hlen = static_cast<unsigned char>(bytes[8]) | (static_cast<unsigned char>(bytes[9]) << 8);
    EXPECT_EQ((10 + hlen) % 64, 0u);
    EXPECT_EQ(bytes[10 + hlen - 1], '\n');
    const Tensor back = read_npy(path);
    EXPECT_EQ(back.dtype(), t.dtype());
    EXPECT_EQ(back.shape(), t.shape());
    EXPECT_TRUE(test::bit_equal(back, t));
  }
}

TEST(Npy, WritesNumpyShapeSpelling) {
  TempDir dir;
  write_npy(dir / "a.npy", Tensor::from_f32({3}, std::vector<float>{1, 2, 3}));
  EXPECT_NE(read_file(dir / "a.npy").find("{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }"),
            std::string::npos);
  write_npy(dir / "b.npy", Tensor::zeros(DType::kI32, {2, 4}));
  EXPECT_NE(read_file(dir / "b.npy").find("'descr': '<i4', 'fortran_order': False, 'shape': (2, 4), }"),
            std::string::npos);
}

TEST(Npy, ReadsVersion2And3) {
  TempDir dir;
  for (int major : {2, 3}) {
    SCOPED_TRACE(major);
    const auto path = dir / "v.npy";
    write_file(path, npy_bytes("{'descr': '<i8', 'fortran_order': False, 'shape': (2,), }",
                               bytes_of<int64_t>({-5, 1LL << 40}), major));
    const Tensor t = read_npy(path);
    ASSERT_EQ(t.shape(), Shape{2});
    EXPECT_EQ(t.data_as<int64_t>()[0], -5);
    EXPECT_EQ(t.data_as<int64_t>()[1], 1LL << 40);
  }
}

TEST(Npy, BadFiles) {
  TempDir dir;
  const auto path = dir / "bad.npy";
  const std::string p = path.string();
  write_file(path, "PK\x03\x04 not numpy");
  EXPECT_INVALID(read_npy(path), p, "bad magic");
  write_file(path, "\x93NU");
  EXPECT_INVALID(read_npy(path), p, "bad magic");
  write_file(path, npy_bytes("{'descr': '<f8', 'fortran_order': False, 'shape': (1,), }", std::string(8, '\0')));
  EXPECT_INVALID(read_npy(path), p, "unsupported .npy dtype '<f8'", "'<f4', '<i4', '<i8'");
  write_file(path, npy_bytes("{'descr': '>f4', 'fortran_order': False, 'shape': (1,), }", std::string(4, '\0')));
  EXPECT_INVALID(read_npy(path), p, "'>f4'");
  write_file(path, npy_bytes("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 2), }", std::string(16, '\0')));
  EXPECT_INVALID(read_npy(path), p, "fortran_order True");
  write_file(path, npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }", std::string(20, '\0')));
  EXPECT_INVALID(read_npy(path), p, "truncated .npy data", "needs 24 bytes, file has 20");
  write_file(path, npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }", std::string(6, '\0')));
  EXPECT_INVALID(read_npy(path), p, "2 trailing bytes");
  write_file(path, npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (-1,), }", ""));
  EXPECT_INVALID(read_npy(path), p, "bad shape");
  write_file(path, npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }", "", 4));
  EXPECT_INVALID(read_npy(path), p, "unsupported .npy version 4.0");
  std::string cut = npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }", "");
  write_file(path, cut.substr(0, 30));
  EXPECT_INVALID(read_npy(path), p, "truncated .npy header");
  EXPECT_INVALID(read_npy(dir / "absent.npy"), "absent.npy", "cannot open");
}

TEST(Npy, WriteRejectsOtherDtypes) {
  TempDir dir;
  EXPECT_INVALID(write_npy(dir / "x.npy", Tensor::zeros(DType::kBF16, {2})), "x.npy", "BF16[2]", "F32, I32, I64");
}

}  // namespace
}  // namespace chimera
