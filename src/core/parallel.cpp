#include "core/parallel.h"

#include <algorithm>
#include <atomic>
#include <thread>
#include <vector>

namespace chimera {
namespace {
std::atomic<int> g_threads{0};
}

void set_num_threads(int n) { g_threads = std::max(1, n); }

int num_threads() {
  int n = g_threads.load();
  if (n <= 0) n = std::max(1u, std::thread::hardware_concurrency());
  return n;
}

void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  const int64_t max_chunks = (n + grain - 1) / grain;
  const int workers = static_cast<int>(std::min<int64_t>(num_threads(), max_chunks));
  if (workers <= 1) {
    fn(0, n);
    return;
  }
  const int64_t per = (n + workers - 1) / workers;
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(workers - 1));
  for (int w = 1; w < workers; ++w) {
    const int64_t b = w * per, e = std::min(n, b + per);
    if (b < e) threads.emplace_back([&fn, b, e] { fn(b, e); });
  }
  fn(0, std::min(n, per));
  for (auto& t : threads) t.join();
}

}  // namespace chimera
