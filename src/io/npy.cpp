// .npy format (numpy/lib/format.py): "\x93NUMPY", major, minor, header length (u16 LE for 1.0, u32 LE for
// 2.0 / 3.0), then a Python dict literal {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), } padded
// with spaces and a final '\n', then the raw C-order data. Only little-endian hosts are supported.
#include "io/npy.h"

#include <bit>
#include <cctype>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>

#include "core/error.h"

namespace chimera {

namespace fs = std::filesystem;

static_assert(std::endian::native == std::endian::little, "npy I/O assumes a little-endian host");

namespace {

constexpr char kMagic[] = "\x93NUMPY";
constexpr size_t kMagicLen = 6;

std::optional<DType> dtype_from_descr(const std::string& d) {
  if (d == "<f4") return DType::kF32;
  if (d == "<i4") return DType::kI32;
  if (d == "<i8") return DType::kI64;
  return std::nullopt;
}

const char* descr_of(DType t) {
  switch (t) {
    case DType::kF32: return "<f4";
    case DType::kI32: return "<i4";
    case DType::kI64: return "<i8";
    default: return nullptr;
  }
}

// The value text after 'key': in the header dict, or "" if the key is missing.
std::string dict_value(const std::string& header, const std::string& key) {
  for (const char q : {'\'', '"'}) {
    const std::string k = std::string(1, q) + key + std::string(1, q);
    size_t pos = header.find(k);
    if (pos == std::string::npos) continue;
    pos = header.find(':', pos + k.size());
    if (pos == std::string::npos) return "";
    ++pos;
    while (pos < header.size() && std::isspace(static_cast<unsigned char>(header[pos]))) ++pos;
    if (pos >= header.size()) return "";
    if (header[pos] == '\'' || header[pos] == '"') {
      const size_t end = header.find(header[pos], pos + 1);
      return end == std::string::npos ? "" : header.substr(pos, end - pos + 1);
    }
    if (header[pos] == '(') {
      const size_t end = header.find(')', pos);
      return end == std::string::npos ? "" : header.substr(pos, end - pos + 1);
    }
    size_t end = pos;
    while (end < header.size() && std::isalnum(static_cast<unsigned char>(header[end]))) ++end;
    return header.substr(pos, end - pos);
  }
  return "";
}

}  // namespace

Tensor read_npy(const fs::path& path) {
  const std::string p = path.string();
  std::ifstream in(path, std::ios::binary);
  if (!in) invalid_input("{}: cannot open", p);
  std::ostringstream ss;
  ss << in.rdbuf();
  const std::string bytes = ss.str();

  if (bytes.size() < kMagicLen + 2 || std::memcmp(bytes.data(), kMagic, kMagicLen) != 0) {
    invalid_input("{}: not a .npy file (bad magic)", p);
  }
  const int major = static_cast<unsigned char>(bytes[6]);
  const int minor = static_cast<unsigned char>(bytes[7]);
  size_t header_len = 0, header_start = 0;
  auto byte = [&](size_t i) { return static_cast<size_t>(static_cast<unsigned char>(bytes[i])); };
  if (major == 1) {
    if (bytes.size() < 10) invalid_input("{}: truncated .npy header", p);
    header_len = byte(8) | (byte(9) << 8);
    header_start = 10;
  } else if (major == 2 || major == 3) {
    if (bytes.size() < 12) invalid_input("{}: truncated .npy header", p);
    header_len = byte(8) | (byte(9) << 8) | (byte(10) << 16) | (byte(11) << 24);
    header_start = 12;
  } else {
    invalid_input("{}: unsupported .npy version {}.{} (supported: 1.0, 2.0, 3.0)", p, major, minor);
  }
  if (header_start + header_len > bytes.size()) {
    invalid_input("{}: truncated .npy header ({} bytes declared, {} present)", p, header_len,
                  bytes.size() - header_start);
  }
  const std::string header = bytes.substr(header_start, header_len);

  std::string descr = dict_value(header, "descr");
  if (descr.size() < 2) invalid_input("{}: .npy header has no 'descr': {}", p, header);
  descr = descr.substr(1, descr.size() - 2);
  const auto dtype = dtype_from_descr(descr);
  if (!dtype) invalid_input("{}: unsupported .npy dtype '{}' (supported: '<f4', '<i4', '<i8')", p, descr);

  const std::string fortran = dict_value(header, "fortran_order");
  if (fortran == "True") invalid_input("{}: fortran_order True is not supported (C order only)", p);
  if (fortran != "False") invalid_input("{}: .npy header has no valid 'fortran_order': {}", p, header);

  const std::string shape_text = dict_value(header, "shape");
  if (shape_text.size() < 2 || shape_text.front() != '(') {
    invalid_input("{}: .npy header has no valid 'shape': {}", p, header);
  }
  Shape shape;
  {
    const std::string inner = shape_text.substr(1, shape_text.size() - 2);
    size_t i = 0;
    while (i < inner.size()) {
      while (i < inner.size() && (std::isspace(static_cast<unsigned char>(inner[i])) || inner[i] == ',')) ++i;
      if (i >= inner.size()) break;
      size_t j = i;
      while (j < inner.size() && std::isdigit(static_cast<unsigned char>(inner[j]))) ++j;
      if (j == i || j - i > 18) invalid_input("{}: .npy header has a bad shape {}", p, shape_text);
      shape.push_back(std::stoll(inner.substr(i, j - i)));
      i = j;
    }
  }

  const size_t data_start = header_start + header_len;
  uint64_t need = dtype_size(*dtype);
  for (int64_t d : shape) {
    if (__builtin_mul_overflow(need, static_cast<uint64_t>(d), &need)) {
      invalid_input("{}: .npy shape {} is too large", p, shape_str(shape));
    }
  }
  const size_t have = bytes.size() - data_start;
  if (have < need) {
    invalid_input("{}: truncated .npy data: {}{} needs {} bytes, file has {}", p, descr, shape_str(shape), need, have);
  }
  if (have > need) {
    invalid_input("{}: .npy file has {} trailing bytes after {}{} data", p, have - need, descr, shape_str(shape));
  }
  Tensor t = Tensor::empty(*dtype, shape);
  if (need) std::memcpy(t.data(), bytes.data() + data_start, need);
  return t;
}

void write_npy(const fs::path& path, const Tensor& t) {
  const std::string p = path.string();
  const char* descr = descr_of(t.dtype());
  if (!descr) invalid_input("{}: cannot write {} as .npy (supported: F32, I32, I64)", p, t.describe());
  CHIMERA_CHECK(t.device() == Device::kCpu, "write_npy: {} is not a host tensor", t.describe());

  std::string shape = "(";
  for (size_t i = 0; i < t.shape().size(); ++i) {
    shape += std::to_string(t.shape()[i]);
    shape += (t.shape().size() == 1 || i + 1 < t.shape().size()) ? "," : "";
    if (i + 1 < t.shape().size()) shape += " ";
  }
  shape += ")";
  std::string header = fmt::format("{{'descr': '{}', 'fortran_order': False, 'shape': {}, }}", descr, shape);
  // Pad with spaces and a '\n' so the data starts 64-byte aligned (numpy's ARRAY_ALIGN).
  const size_t prefix_len = kMagicLen + 2 + 2;
  const size_t total = (prefix_len + header.size() + 1 + 63) / 64 * 64;
  header.append(total - prefix_len - header.size() - 1, ' ');
  header += '\n';
  CHIMERA_CHECK(header.size() <= 65535, "write_npy: header of {} bytes needs format 2.0", header.size());

  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) invalid_input("{}: cannot open for writing", p);
  out.write(kMagic, kMagicLen);
  const char version[2] = {1, 0};
  out.write(version, 2);
  const char len[2] = {static_cast<char>(header.size() & 0xff), static_cast<char>(header.size() >> 8)};
  out.write(len, 2);
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  out.write(static_cast<const char*>(t.data()), static_cast<std::streamsize>(t.nbytes()));
  out.close();
  if (!out) runtime_error("{}: write failed", p);
}

}  // namespace chimera
