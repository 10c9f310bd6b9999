// Helpers for the io tests: a fresh temporary directory per test, raw file writing, an assertion that a call
// throws kInvalidInput with every expected piece of text in its message, and a config's layer counts by kind.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <ostream>
#include <string>

#include <unistd.h>

#include <gtest/gtest.h>

#include "core/error.h"
#include "io/model_config.h"

namespace chimera::test {

class TempDir {
 public:
  TempDir() {
    static std::atomic<int> counter{0};
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::string name = "chimera_io_" + std::to_string(::getpid()) + "_" + std::to_string(counter++);
    if (info) name += std::string("_") + info->name();
    path_ = std::filesystem::temp_directory_path() / name;
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

 private:
  std::filesystem::path path_;
};

inline void write_file(const std::filesystem::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

inline std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Passes when `fn` throws chimera::Error of kind kInvalidInput whose message contains every piece.
inline ::testing::AssertionResult throws_invalid(const std::function<void()>& fn,
                                                 std::initializer_list<std::string> pieces) {
  try {
    fn();
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::kInvalidInput) {
      return ::testing::AssertionFailure() << "error kind is not kInvalidInput: " << e.what();
    }
    const std::string msg = e.what();
    for (const auto& p : pieces) {
      if (msg.find(p) == std::string::npos) {
        return ::testing::AssertionFailure() << "message \"" << msg << "\" lacks \"" << p << "\"";
      }
    }
    return ::testing::AssertionSuccess() << msg;
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw a non-chimera exception: " << e.what();
  }
  return ::testing::AssertionFailure() << "did not throw";
}

#define EXPECT_INVALID(stmt, ...) EXPECT_TRUE(::chimera::test::throws_invalid([&] { stmt; }, {__VA_ARGS__}))

// The layers of each kind of a config, compared as one value: EXPECT_EQ(layer_counts(c), (LayerCounts{24, 4, 24, 0}))
// prints all four counts of both sides on a mismatch.
struct LayerCounts {
  int64_t mamba = 0, attention = 0, mlp = 0, moe = 0;
  bool operator==(const LayerCounts&) const = default;
};
inline LayerCounts layer_counts(const ModelConfig& c) {
  auto n = [&](LayerKind k) { return static_cast<int64_t>(std::count(c.layers.begin(), c.layers.end(), k)); };
  return {n(LayerKind::kMamba), n(LayerKind::kAttention), n(LayerKind::kMlp), n(LayerKind::kMoe)};
}
inline void PrintTo(const LayerCounts& k, std::ostream* os) {
  *os << "{mamba " << k.mamba << ", attention " << k.attention << ", mlp " << k.mlp << ", moe " << k.moe << "}";
}

}  // namespace chimera::test
