// parallel_for: split [0, n) into contiguous ranges over a few threads. The CPU reference backend uses it
// for the loops that dominate (GEMM rows, heads); results never depend on the thread count because every
// output element is computed by exactly one thread in a fixed order.
#pragma once

#include <cstdint>
#include <functional>

namespace chimera {

// Number of worker threads (CHIMERA_NUM_THREADS is read once by the CLI and passed in; default: cores).
void set_num_threads(int n);
int num_threads();

// fn(begin, end) is called on disjoint ranges covering [0, n). `grain`: minimum items per range.
void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

}  // namespace chimera
