// Errors: one exception type carrying the category that decides the process exit status.
//   kInvalidInput -> exit 2 (bad usage, bad file, bad config, bad tensor)
//   kRuntime      -> exit 1 (something failed while running valid input)
// Exceptions rather than Status returns: the CPU reference path is deep (loader -> model -> ops) and every
// failure is fatal for the request, so unwinding to the CLI / request boundary is the simple, honest shape.
#pragma once

#include <stdexcept>
#include <string>
#include <utility>

#include <fmt/format.h>

namespace chimera {

enum class ErrorKind { kInvalidInput, kRuntime };

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
  ErrorKind kind() const { return kind_; }
  int exit_code() const { return kind_ == ErrorKind::kInvalidInput ? 2 : 1; }

 private:
  ErrorKind kind_;
};

// invalid_input("{}: tensor '{}' has shape {}, expected {}", file, name, a, b)
template <typename... Args>
[[noreturn]] void invalid_input(fmt::format_string<Args...> f, Args&&... args) {
  throw Error(ErrorKind::kInvalidInput, fmt::format(f, std::forward<Args>(args)...));
}

template <typename... Args>
[[noreturn]] void runtime_error(fmt::format_string<Args...> f, Args&&... args) {
  throw Error(ErrorKind::kRuntime, fmt::format(f, std::forward<Args>(args)...));
}

// CHIMERA_CHECK(cond, "fmt", args...): an internal invariant (programming error) -> kRuntime.
#define CHIMERA_CHECK(cond, ...)                                                                    \
  do {                                                                                              \
    if (!(cond)) {                                                                                  \
      throw ::chimera::Error(::chimera::ErrorKind::kRuntime,                                        \
                             fmt::format("check failed at {}:{}: {}: {}", __FILE__, __LINE__,       \
                                         #cond, fmt::format(__VA_ARGS__)));                         \
    }                                                                                               \
  } while (0)

}  // namespace chimera
