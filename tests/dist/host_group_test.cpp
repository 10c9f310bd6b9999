// dist::HostGroup (src/dist/host_group.h) on one node: every rank a thread of this process, as the CPU backend's
// tensor parallelism runs it. Results must be identical on every rank, and a missing rank must end the others' wait
// (host_group_nodes_test.cpp: the same over processes).
#include "dist/host_group.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "common/run_ranks.h"
#include "core/counter_rng.h"
#include "core/error.h"

namespace chimera::dist {
namespace {

// Every rank of a one-node group, from rank 0.
std::vector<std::string> run_ranks(int n, const std::function<void(int)>& fn) {
  return test::run_ranks(0, n, fn);
}

std::vector<float> values(int rank, size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i)
    v[i] = static_cast<float>(counter_uniform(100 + static_cast<uint64_t>(rank), i)) - 0.5f;
  return v;
}

class HostGroupTest : public ::testing::TestWithParam<int> {};

TEST_P(HostGroupTest, AllReduceSumsInRankOrderWithIdenticalBits) {
  const int n = GetParam();
  HostGroup group(n);
  const size_t len = 1000;
  std::vector<float> expected(len, 0.0f);
  for (int r = 0; r < n; ++r) {
    const std::vector<float> v = values(r, len);
    for (size_t i = 0; i < len; ++i) expected[i] += v[i];  // rank order 0..n-1
  }
  std::vector<std::vector<float>> got(static_cast<size_t>(n));
  const auto errors = run_ranks(n, [&](int r) {
    for (int step = 0; step < 20; ++step) {  // repeated calls reuse the group
      got[static_cast<size_t>(r)] = values(r, len);
      group.all_reduce_sum(r, got[static_cast<size_t>(r)]);
    }
  });
  for (int r = 0; r < n; ++r) {
    ASSERT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
    ASSERT_EQ(std::memcmp(got[static_cast<size_t>(r)].data(), expected.data(), len * sizeof(float)), 0) << "rank " << r;
  }
}

TEST_P(HostGroupTest, AllGatherBroadcastAndBarrier) {
  const int n = GetParam();
  HostGroup group(n);
  const size_t len = 37;
  std::vector<std::vector<float>> gathered(static_cast<size_t>(n), std::vector<float>(len * static_cast<size_t>(n)));
  std::vector<std::vector<int32_t>> bcast(static_cast<size_t>(n));
  const auto errors = run_ranks(n, [&](int r) {
    const std::vector<float> mine = values(r, len);
    group.all_gather(r, mine, gathered[static_cast<size_t>(r)]);
    std::vector<int32_t>& b = bcast[static_cast<size_t>(r)];
    b.assign(5, r == n - 1 ? 7 : -r);
    group.broadcast(r, std::as_writable_bytes(std::span<int32_t>(b)), n - 1);
    group.barrier(r);
  });
  for (int r = 0; r < n; ++r) {
    ASSERT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
    for (int src = 0; src < n; ++src) {
      const std::vector<float> v = values(src, len);
      ASSERT_EQ(std::memcmp(gathered[static_cast<size_t>(r)].data() + static_cast<size_t>(src) * len, v.data(),
                            len * sizeof(float)),
                0)
          << "rank " << r << " block " << src;
    }
    EXPECT_EQ(bcast[static_cast<size_t>(r)], std::vector<int32_t>(5, 7)) << "rank " << r;
  }
}

TEST_P(HostGroupTest, BackToBackBarriersAndCollectives) {
  // Calls with nothing in between: a fast rank's next post must never be taken for a slow rank's current one.
  const int n = GetParam();
  HostGroup group(n);
  const auto errors = run_ranks(n, [&](int r) {
    for (int i = 0; i < 200; ++i) {
      std::vector<float> v(3, 1.0f);
      group.barrier(r);
      group.all_reduce_sum(r, v);
      group.barrier(r);
      if (v[0] != static_cast<float>(n)) throw Error(ErrorKind::kRuntime, "wrong sum");
    }
  });
  for (const std::string& e : errors) EXPECT_EQ(e, "");
}

INSTANTIATE_TEST_SUITE_P(Ranks, HostGroupTest, ::testing::Values(1, 2, 3, 4, 8));

TEST(HostGroup, MissingRankTimesOutNamingIt) {
  HostGroup group(3, std::chrono::milliseconds(200));
  const auto t0 = std::chrono::steady_clock::now();
  const auto errors = run_ranks(3, [&](int r) {
    if (r == 2) return;  // never arrives
    std::vector<float> v(4, 1.0f);
    group.all_reduce_sum(r, v);
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(seconds, 5.0);
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[static_cast<size_t>(r)].find("rank(s) 2 of 3 did not arrive within 200 ms"), std::string::npos)
        << errors[static_cast<size_t>(r)];
  }
  EXPECT_EQ(errors[2], "");
  // The group stays broken: a late rank fails at once instead of waiting.
  std::vector<float> v(4, 1.0f);
  try {
    group.all_reduce_sum(2, v);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kRuntime);
    EXPECT_NE(std::string(e.what()).find("did not arrive"), std::string::npos) << e.what();
  }
}

TEST(HostGroup, AbortEndsTheOthersWait) {
  HostGroup group(2, std::chrono::seconds(60));
  const auto t0 = std::chrono::steady_clock::now();
  const auto errors = run_ranks(2, [&](int r) {
    if (r == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      group.abort(1, "its step threw");
      return;
    }
    group.barrier(r);
  });
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 5.0);
  EXPECT_NE(errors[0].find("rank 1 aborted: its step threw"), std::string::npos) << errors[0];
  // health() says so from any thread, as a watchdog asks it.
  EXPECT_EQ(group.health(), "rank 1 aborted: its step threw");
  EXPECT_EQ(HostGroup(2).health(), "");
}

TEST(HostGroup, MismatchedCollectivesAreAnError) {
  HostGroup group(2, std::chrono::seconds(5));
  const auto errors = run_ranks(2, [&](int r) {
    std::vector<float> v(r == 0 ? 4 : 5, 1.0f);
    group.all_reduce_sum(r, v);
  });
  for (const std::string& e : errors) EXPECT_NE(e.find("count"), std::string::npos) << e;
}

TEST(HostGroup, InvalidSizesAndRanks) {
  EXPECT_THROW(HostGroup(0), Error);
  HostGroup group(2);
  std::vector<float> v(1);
  EXPECT_THROW(group.all_reduce_sum(2, v), Error);
}

}  // namespace
}  // namespace chimera::dist
