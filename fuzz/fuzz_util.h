// Shared by the harnesses: the one outcome a harness accepts besides success is chimera::Error of kind
// kInvalidInput (a clear message about the input). Anything else escaping (another exception, kRuntime, a
// crash, a sanitizer report, a failed property) is a finding.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>

#include "core/error.h"

namespace chimera::fuzz {

template <typename Fn>
void expect_clean(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::kInvalidInput) {
      std::fprintf(stderr, "fuzz: kRuntime error on bad input: %s\n", e.what());
      std::abort();
    }
  }
}

// A property that must hold: aborts (a finding) with the message otherwise.
inline void require(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "fuzz: property failed: %s\n", what);
    std::abort();
  }
}

}  // namespace chimera::fuzz
