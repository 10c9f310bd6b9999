// Errors: one exception type carrying the category that decides the process exit status.
//   kInvalidInput -> exit 2 (bad usage, bad file, bad config, bad tensor)
//   kRuntime      -> exit 1 (something failed while running valid input)
//   kOverloaded   -> exit 1 (valid input refused for now: the engine's waiting queue is full; a server answers
//                    503 with Retry-After)
// Exceptions rather than Status returns: the CPU reference path is deep (loader -> model -> ops) and every
// failure is fatal for the request, so unwinding to the CLI / request boundary is the simple, honest shape.
// This header has no fmt dependency so that CUDA sources (compiled by nvcc) can throw too.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace chimera {

enum class ErrorKind { kInvalidInput, kRuntime, kOverloaded };

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
  ErrorKind kind() const { return kind_; }
  int exit_code() const { return kind_ == ErrorKind::kInvalidInput ? 2 : 1; }

 private:
  ErrorKind kind_;
};

// str_cat("ops::", name, ": ", n, " rows") for code that cannot use fmt (CUDA sources).
template <typename... Args>
std::string str_cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

[[noreturn]] inline void throw_runtime(const std::string& message) { throw Error(ErrorKind::kRuntime, message); }

}  // namespace chimera
