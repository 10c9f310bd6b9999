// dist::HostGroup (src/dist/host_group.h) over nodes: tensor-parallel ranks spread over processes joined over TCP.
// Each test forks one child process per node on 127.0.0.1; a child runs its node's ranks on threads, checks its
// results against the serial ones (computed before the fork, so the child inherits them), writes what went wrong
// to a pipe and _exits (0: every check passed). The parent only waits and reports.
#include "dist/host_group.h"

#include <gtest/gtest.h>

#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "common/free_port.h"
#include "common/run_ranks.h"
#include "core/counter_rng.h"
#include "core/error.h"

namespace chimera::dist {
namespace {

using std::chrono::milliseconds;

using test::run_ranks;

// Forks one child per node; node(k) returns what went wrong on node k ("" for nothing). The parent's result:
// per node, the child's report, with its exit status when it did not exit 0.
std::vector<std::string> run_nodes(int nnodes, const std::function<std::string(int)>& node) {
  std::vector<pid_t> pids;
  std::vector<int> reads;
  for (int k = 0; k < nnodes; ++k) {
    int fds[2];
    if (::pipe(fds) != 0) {
      ADD_FAILURE() << "pipe: " << std::strerror(errno);
      break;
    }
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::close(fds[0]);
      ::alarm(20);  // a hung child dies instead of hanging the test
      std::string report;
      try {
        report = node(k);
      } catch (const std::exception& e) {
        report = std::string("uncaught: ") + e.what();
      }
      size_t off = 0;
      while (off < report.size()) {
        const ssize_t n = ::write(fds[1], report.data() + off, report.size() - off);
        if (n <= 0) break;
        off += static_cast<size_t>(n);
      }
      ::_exit(report.empty() ? 0 : 1);
    }
    ::close(fds[1]);
    pids.push_back(pid);
    reads.push_back(fds[0]);
  }
  std::vector<std::string> reports(pids.size());
  for (size_t k = 0; k < pids.size(); ++k) {
    char buf[4096];
    ssize_t n;
    while ((n = ::read(reads[k], buf, sizeof(buf))) > 0) reports[k].append(buf, static_cast<size_t>(n));
    ::close(reads[k]);
    int status = 0;
    ::waitpid(pids[k], &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      reports[k] += fmt::format(" [node {} exited with status {}]", k, status);
    }
  }
  return reports;
}

std::string join_errors(const std::vector<std::string>& errors) {
  std::string all;
  for (const std::string& e : errors) {
    if (!e.empty()) all += e + "; ";
  }
  return all;
}

std::vector<float> values(int rank, size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i)
    v[i] = static_cast<float>(counter_uniform(200 + static_cast<uint64_t>(rank), i)) - 0.5f;
  return v;
}

struct Shape {
  int size;
  int nnodes;
};
void PrintTo(const Shape& s, std::ostream* os) {
  *os << s.size << " ranks over " << s.nnodes << " nodes";
}

class HostGroupNodesTest : public ::testing::TestWithParam<Shape> {};

TEST_P(HostGroupNodesTest, CollectivesGiveTheSerialBits) {
  const auto [n, nnodes] = GetParam();
  const size_t len = 1000, gather_len = 37;
  // The reference, serial in this process before the fork: the sum in rank order 0..n-1, the ranks' values back to
  // back, the root's bytes.
  std::vector<float> sum(len, 0.0f), gathered;
  for (int r = 0; r < n; ++r) {
    const std::vector<float> v = values(r, len), g = values(r, gather_len);
    for (size_t i = 0; i < len; ++i) sum[i] += v[i];
    gathered.insert(gathered.end(), g.begin(), g.end());
  }
  const std::vector<int32_t> bcast(5, 7);

  const int port = test::free_port();
  const auto reports = run_nodes(nnodes, [&](int node) -> std::string {
    HostGroup group(n, nnodes, node, "127.0.0.1", port, std::chrono::seconds(10));
    std::vector<std::string> wrong(static_cast<size_t>(n));
    auto errors = run_ranks(group.first_rank(), group.local_size(), [&](int r) {
      std::string& w = wrong[static_cast<size_t>(r)];
      for (int step = 0; step < 20; ++step) {  // repeated calls reuse the group
        std::vector<float> v = values(r, len);
        group.all_reduce_sum(r, v);
        if (std::memcmp(v.data(), sum.data(), len * sizeof(float)) != 0)
          w = fmt::format("rank {}: all_reduce_sum bits differ from the serial sum's", r);
      }
      std::vector<float> g(gather_len * static_cast<size_t>(n));
      group.all_gather(r, values(r, gather_len), g);
      if (g != gathered) w = fmt::format("rank {}: all_gather differs", r);
      std::vector<int32_t> b(5, r == n - 1 ? 7 : -r);
      group.broadcast(r, std::as_writable_bytes(std::span<int32_t>(b)), n - 1);
      if (b != bcast) w = fmt::format("rank {}: broadcast from rank {} differs", r, n - 1);
      std::vector<int32_t> b0(3, r == 0 ? 11 : -1);
      group.broadcast(r, std::as_writable_bytes(std::span<int32_t>(b0)), 0);
      if (b0 != std::vector<int32_t>(3, 11)) w = fmt::format("rank {}: broadcast from rank 0 differs", r);
      // Back to back, nothing in between: a fast rank's next call must never be taken for a slow one's.
      for (int i = 0; i < 100; ++i) {
        std::vector<float> ones(3, 1.0f);
        group.barrier(r);
        group.all_reduce_sum(r, ones);
        if (ones[0] != static_cast<float>(n)) w = fmt::format("rank {}: wrong sum {}", r, ones[0]);
      }
      std::vector<float> none;
      group.all_reduce_sum(r, none);  // empty buffers are a valid call
    });
    errors.insert(errors.end(), wrong.begin(), wrong.end());
    return join_errors(errors);
  });
  for (int k = 0; k < nnodes; ++k) EXPECT_EQ(reports[static_cast<size_t>(k)], "") << "node " << k;
}

INSTANTIATE_TEST_SUITE_P(Nodes, HostGroupNodesTest,
                         ::testing::Values(Shape{1, 1}, Shape{2, 1}, Shape{2, 2}, Shape{3, 3}, Shape{4, 2},
                                           Shape{6, 3}),
                         [](const ::testing::TestParamInfo<Shape>& p) {
                           return fmt::format("size{}_nodes{}", p.param.size, p.param.nnodes);
                         });

// The error message a node's constructor ends with, or "" when it returned.
std::string construct(int size, int nnodes, int node, int port, milliseconds timeout) {
  try {
    HostGroup group(size, nnodes, node, "127.0.0.1", port, timeout);
    return "";
  } catch (const Error& e) {
    return e.kind() == ErrorKind::kRuntime ? e.what() : std::string("not kRuntime: ") + e.what();
  }
}

// What a node reports when `message` is not in its error, or the seconds it took are too many.
std::string expect_error(const std::string& message, const std::string& expected, double seconds, double limit) {
  if (message.find(expected) == std::string::npos) return fmt::format("'{}' lacks '{}'", message, expected);
  if (seconds > limit) return fmt::format("took {} s", seconds);
  return "";
}

double since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

TEST(HostGroupNodes, NodeThatNeverJoinsTimesOutNamingIt) {
  const int port = test::free_port();
  const auto reports = run_nodes(2, [&](int node) -> std::string {
    const auto t0 = std::chrono::steady_clock::now();
    const std::string e = construct(6, 3, node, port, milliseconds(300));  // node 2 never starts
    return expect_error(e, "node 2 (ranks 4-5) did not join within 300 ms", since(t0), 3.0);
  });
  for (int k = 0; k < 2; ++k) EXPECT_EQ(reports[static_cast<size_t>(k)], "") << "node " << k;
}

TEST(HostGroupNodes, MasterThatNeverListensTimesOutNamingIt) {
  const int port = test::free_port();
  const auto t0 = std::chrono::steady_clock::now();
  const std::string e = construct(2, 2, 1, port, milliseconds(300));
  EXPECT_EQ(expect_error(
                e, fmt::format("could not connect to the master (node 0 (rank 0)) at 127.0.0.1:{} within 300 ms", port),
                since(t0), 3.0),
            "");
}

TEST(HostGroupNodes, NodesThatDisagreeOnTheSizeFailToJoin) {
  const int port = test::free_port();
  const auto reports = run_nodes(2, [&](int node) -> std::string {
    const std::string e = construct(node == 0 ? 2 : 4, 2, node, port, std::chrono::seconds(5));
    return expect_error(e, "node 1 was started with size 4 over 2 nodes, node 0 with size 2 over 2 nodes", 0, 1);
  });
  for (int k = 0; k < 2; ++k) EXPECT_EQ(reports[static_cast<size_t>(k)], "") << "node " << k;
}

TEST(HostGroupNodes, NodeThatExitsBreaksTheOthers) {
  const int port = test::free_port();
  const auto reports = run_nodes(3, [&](int node) -> std::string {
    HostGroup group(3, 3, node, "127.0.0.1", port, std::chrono::seconds(10));
    for (int i = 0; i < 5; ++i) {
      std::vector<float> v(8, 1.0f);
      group.all_reduce_sum(node, v);
    }
    if (node == 1) ::_exit(0);  // the process dies: its socket closes
    const auto t0 = std::chrono::steady_clock::now();
    std::string e;
    try {
      std::vector<float> v(8, 1.0f);
      group.all_reduce_sum(node, v);
      return "expected an error";
    } catch (const Error& err) {
      e = err.what();
    }
    std::string wrong = expect_error(e, "node 1 (rank 1) closed its connection", since(t0), 3.0);
    // The group stays broken: a later call fails at once, with the same reason.
    try {
      group.barrier(node);
      wrong += "; a later call succeeded";
    } catch (const Error& err) {
      wrong += expect_error(err.what(), "node 1 (rank 1) closed its connection", 0, 1);
    }
    return wrong;
  });
  EXPECT_EQ(reports[0], "");
  EXPECT_EQ(reports[1], "");
  EXPECT_EQ(reports[2], "");
}

TEST(HostGroupNodes, WaitBroadcastWaitsPastTheTimeoutForNodeZero) {
  // A server's other nodes idle between requests: node 0 sends after 4 timeouts and they still get its bytes.
  const int port = test::free_port();
  const auto reports = run_nodes(2, [&](int node) -> std::string {
    HostGroup group(4, 2, node, "127.0.0.1", port, milliseconds(200));
    std::string wrong;
    const auto errors = run_ranks(group.first_rank(), 2, [&](int rank) {
      // Node 0's ranks arrive together (their own rendezvous keeps its deadline).
      std::vector<std::byte> data(5, std::byte{0});
      if (node == 0) std::this_thread::sleep_for(milliseconds(800));
      if (rank == 0) {
        for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<std::byte>(i + 1);
      }
      group.wait_broadcast(rank, data);
      for (size_t i = 0; i < data.size(); ++i) {
        if (data[i] != static_cast<std::byte>(i + 1)) runtime_error("rank {}: wrong bytes", rank);
      }
    });
    for (const std::string& e : errors) wrong += e;
    // An ordinary broadcast keeps its deadline: node 0 late by 4 timeouts fails it on node 1.
    const auto t0 = std::chrono::steady_clock::now();
    const auto late = run_ranks(group.first_rank(), 2, [&](int rank) {
      std::vector<std::byte> data(5);
      if (node == 0) std::this_thread::sleep_for(milliseconds(800));
      group.broadcast(rank, data, 0);
    });
    if (node == 1) wrong += expect_error(late[0], "node 0 (ranks 0-1) did not answer within 400 ms", since(t0), 3.0);
    return wrong;
  });
  EXPECT_EQ(reports[0], "");
  EXPECT_EQ(reports[1], "");
}

TEST(HostGroupNodes, WaitBroadcastEndsWhenNodeZeroExits) {
  const int port = test::free_port();
  const auto reports = run_nodes(2, [&](int node) -> std::string {
    HostGroup group(2, 2, node, "127.0.0.1", port, milliseconds(200));
    if (node == 0) {
      std::this_thread::sleep_for(milliseconds(600));
      ::_exit(0);  // the process dies without sending: its socket closes
    }
    const auto t0 = std::chrono::steady_clock::now();
    try {
      std::vector<std::byte> data(4);
      group.wait_broadcast(node, data);
      return "expected an error";
    } catch (const Error& e) {
      return expect_error(e.what(), "node 0 (rank 0) closed its connection", since(t0), 3.0);
    }
  });
  EXPECT_EQ(reports[1], "");
}

TEST(HostGroupNodes, HealthFindsAClosedConnectionWithoutACollective) {
  // What a watchdog asks while the ranks are inside device collectives: node 1 exits between collectives.
  const int port = test::free_port();
  const auto reports = run_nodes(2, [&](int node) -> std::string {
    HostGroup group(2, 2, node, "127.0.0.1", port, std::chrono::seconds(10));
    group.barrier(node);
    // Node 0 asks before node 1 may leave: node 1 exits only after the next barrier, which node 0 enters after
    // this check (without it, a loaded machine lets node 1 exit first and the check sees it gone).
    if (node == 0 && !group.health().empty()) return "unhealthy before node 1 left: " + group.health();
    group.barrier(node);
    if (node == 1) ::_exit(0);
    const auto t0 = std::chrono::steady_clock::now();
    std::string h;
    while (h.empty() && since(t0) < 5.0) {
      std::this_thread::sleep_for(milliseconds(10));
      h = group.health();
    }
    std::string wrong = expect_error(h, "node 1 (rank 1) closed its connection", since(t0), 3.0);
    try {
      group.barrier(node);  // broken: at once, with the same reason
      wrong += "; a later call succeeded";
    } catch (const Error& e) {
      wrong += expect_error(e.what(), "node 1 (rank 1) closed its connection", 0, 1);
    }
    return wrong;
  });
  EXPECT_EQ(reports[0], "");
}

TEST(HostGroupNodes, AbortReachesTheOtherNodes) {
  const int port = test::free_port();
  const auto reports = run_nodes(3, [&](int node) -> std::string {
    HostGroup group(3, 3, node, "127.0.0.1", port, std::chrono::seconds(60));
    group.barrier(node);
    if (node == 2) {
      std::this_thread::sleep_for(milliseconds(50));
      group.abort(2, "its step threw");
      return "";
    }
    const auto t0 = std::chrono::steady_clock::now();
    try {
      group.barrier(node);
      return "expected an error";
    } catch (const Error& e) {
      return expect_error(e.what(), "rank 2 aborted: its step threw", since(t0), 5.0);
    }
  });
  for (int k = 0; k < 3; ++k) EXPECT_EQ(reports[static_cast<size_t>(k)], "") << "node " << k;
}

TEST(HostGroupNodes, LocalRankThatNeverArrivesTimesOutOnEveryNode) {
  const int port = test::free_port();
  const auto reports = run_nodes(2, [&](int node) -> std::string {
    HostGroup group(4, 2, node, "127.0.0.1", port, milliseconds(300));
    const auto t0 = std::chrono::steady_clock::now();
    const auto errors = run_ranks(group.first_rank(), 2, [&](int r) {
      if (r == 3) return;  // never arrives
      // Node 0 comes later, so node 1's verdict about its own rank is the first (node 0 would otherwise report
      // node 1 missing at the same moment).
      if (node == 0) std::this_thread::sleep_for(milliseconds(100));
      group.barrier(r);
    });
    std::string wrong;
    for (int i = 0; i < 2; ++i) {
      if (group.first_rank() + i == 3) continue;
      wrong +=
          expect_error(errors[static_cast<size_t>(i)], "rank(s) 3 of 4 did not arrive within 300 ms", since(t0), 3.0);
    }
    return wrong;
  });
  for (int k = 0; k < 2; ++k) EXPECT_EQ(reports[static_cast<size_t>(k)], "") << "node " << k;
}

TEST(HostGroupNodes, MismatchedCollectivesAreAnError) {
  const int port = test::free_port();
  const auto reports = run_nodes(2, [&](int node) -> std::string {
    HostGroup group(2, 2, node, "127.0.0.1", port, std::chrono::seconds(5));
    std::vector<float> v(node == 0 ? 4 : 5, 1.0f);
    try {
      group.all_reduce_sum(node, v);
      return "expected an error";
    } catch (const Error& e) {
      return expect_error(e.what(), "node 1 (rank 1) called all_reduce_sum (count 5", 0, 1);
    }
  });
  for (int k = 0; k < 2; ++k) EXPECT_EQ(reports[static_cast<size_t>(k)], "") << "node " << k;
}

TEST(HostGroupNodes, InvalidArgumentsAreInvalidInput) {
  const auto kind = [](const std::function<void()>& make) {
    try {
      make();
    } catch (const Error& e) {
      return e.kind();
    }
    return ErrorKind::kOverloaded;  // "did not throw"
  };
  const auto make = [](int size, int nnodes, int node, int port) {
    return [=] { HostGroup group(size, nnodes, node, "127.0.0.1", port, milliseconds(100)); };
  };
  EXPECT_EQ(kind(make(3, 2, 0, 1234)), ErrorKind::kInvalidInput);  // 3 ranks do not split over 2 nodes
  EXPECT_EQ(kind(make(2, 2, 2, 1234)), ErrorKind::kInvalidInput);  // node rank out of range
  EXPECT_EQ(kind(make(2, 2, -1, 1234)), ErrorKind::kInvalidInput);
  EXPECT_EQ(kind(make(2, 2, 0, 0)), ErrorKind::kInvalidInput);  // port out of range
  EXPECT_EQ(kind(make(2, 2, 0, 65536)), ErrorKind::kInvalidInput);
  EXPECT_EQ(kind(make(0, 1, 0, 1234)), ErrorKind::kInvalidInput);
  EXPECT_EQ(kind(make(2, 0, 0, 1234)), ErrorKind::kInvalidInput);
  EXPECT_EQ(kind([] { HostGroup group(2, 2, 1, "", 1234, milliseconds(100)); }), ErrorKind::kInvalidInput);
  // A rank the node does not host.
  HostGroup group(2, 1, 0, "127.0.0.1", 1234, milliseconds(100));
  std::vector<float> v(1);
  EXPECT_THROW(group.all_reduce_sum(2, v), Error);
}

}  // namespace
}  // namespace chimera::dist
