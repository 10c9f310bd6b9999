// Formatted errors (fmt, format strings checked at compile time). The Error type itself is in error_base.h,
// which CUDA translation units include instead: nvcc cannot compile fmt's consteval format checks.
#pragma once

#include <string>
#include <utility>

#include <fmt/format.h>

#include "core/error_base.h"

namespace chimera {

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
