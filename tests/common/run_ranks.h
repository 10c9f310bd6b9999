// Ranks as threads, for the host-group tests: fn(rank) on one thread per rank in [first, first + n), joined; each
// rank's chimera::Error message ("" when it returned), in rank order.
#pragma once

#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"

namespace chimera::test {

inline std::vector<std::string> run_ranks(int first, int n, const std::function<void(int)>& fn) {
  std::vector<std::string> errors(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int i = 0; i < n; ++i) {
    threads.emplace_back([&, i] {
      try {
        fn(first + i);
      } catch (const Error& e) {
        errors[static_cast<size_t>(i)] = e.what();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  return errors;
}

}  // namespace chimera::test
