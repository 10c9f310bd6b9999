#include "dist/host_group.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "core/error.h"

namespace chimera::dist {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kMagic = 0x43544750;  // "PGTC"
// A frame is a FrameHeader and `bytes` of payload.
enum class Frame : uint32_t {
  kHello = 1,  // node k -> 0 on connecting: op = nnodes, root = node rank, count = size
  kReady,      // 0 -> every node: all joined
  kCall,       // node k -> 0: its local ranks' data for one collective
  kResult,     // 0 -> node k: the collective's result
  kAbort,      // either way: the group is broken; payload = why
};
struct FrameHeader {
  uint32_t magic = kMagic;
  uint32_t type = 0;
  uint32_t op = 0;
  int32_t root = 0;
  uint64_t count = 0;
  uint64_t seq = 0;  // the collective's number on the sending node, from 1
  uint64_t bytes = 0;
};
static_assert(sizeof(FrameHeader) == 40, "the header is sent as its bytes");

// A collective's call or result frame.
FrameHeader collective_header(Frame type, uint32_t op, int32_t root, uint64_t count, uint64_t seq, uint64_t bytes) {
  FrameHeader h;
  h.type = static_cast<uint32_t>(type);
  h.op = op;
  h.root = root;
  h.count = count;
  h.seq = seq;
  h.bytes = bytes;
  return h;
}
constexpr uint64_t kMaxAbortBytes = 1 << 16;

const char* op_name(uint32_t op) {
  switch (static_cast<HostGroup::Op>(op)) {
    case HostGroup::Op::kAllReduceSum: return "all_reduce_sum";
    case HostGroup::Op::kAllGather: return "all_gather";
    case HostGroup::Op::kBroadcast: return "broadcast";
    case HostGroup::Op::kBarrier: return "barrier";
  }
  return "an unknown collective";
}

int remaining_ms(Clock::time_point deadline) {
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left <= 0 ? 0 : static_cast<int>(std::min<int64_t>(left, 1 << 30));
}

void set_nonblocking_nodelay(int fd) {
  const int flags = fcntl(fd, F_GETFL, 0);
  fcntl(fd, F_SETFL, flags | O_NONBLOCK);
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  // Keepalive probes find a peer host that went away without closing the connection (power, network) while a
  // node waits without a deadline (wait_broadcast): after 5 idle seconds, a probe a second, 5 unanswered ones.
  const int idle = 5, interval = 1, count = 5;
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof(interval));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof(count));
}

// Writes all of `data` to a non-blocking socket by `deadline`; "" or why not.
std::string send_bytes(int fd, const void* data, size_t n, Clock::time_point deadline) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t sent = ::send(fd, p, n, MSG_NOSIGNAL);
    if (sent > 0) {
      p += sent;
      n -= static_cast<size_t>(sent);
      continue;
    }
    if (sent < 0 && errno == EINTR) continue;
    if (sent < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
      return errno == EPIPE || errno == ECONNRESET ? "closed its connection"
                                                   : fmt::format("send failed: {}", std::strerror(errno));
    }
    pollfd pfd{fd, POLLOUT, 0};
    const int ready = ::poll(&pfd, 1, remaining_ms(deadline));
    if (ready == 0) return "did not take the data in time";
    if (ready < 0 && errno != EINTR) return fmt::format("poll failed: {}", std::strerror(errno));
  }
  return "";
}

// A frame read piecewise from a non-blocking socket (the reads of several sockets interleave in one poll loop).
struct FrameReader {
  FrameHeader header;
  std::vector<std::byte> payload;
  size_t got = 0;  // bytes of the header, then of the payload
  bool header_done = false;
  bool done = false;

  void reset() { *this = FrameReader{}; }
  // Reads what the socket holds. "" (check header_done / done) or why the connection failed. At the end of the
  // header, `accept_header` says the payload's size is right ("") or why not; the payload is read after it.
  template <typename F>
  std::string read_some(int fd, const F& accept_header) {
    while (!done) {
      std::byte* dst = header_done ? payload.data() + got : reinterpret_cast<std::byte*>(&header) + got;
      const size_t want = (header_done ? payload.size() : sizeof(FrameHeader)) - got;
      if (want > 0) {
        const ssize_t n = ::recv(fd, dst, want, 0);
        if (n == 0) return "closed its connection";
        if (n < 0) {
          if (errno == EINTR) continue;
          if (errno == EAGAIN || errno == EWOULDBLOCK) return "";
          return errno == ECONNRESET ? "closed its connection" : fmt::format("recv failed: {}", std::strerror(errno));
        }
        got += static_cast<size_t>(n);
        if (static_cast<size_t>(n) < want) continue;
      }
      if (!header_done) {
        if (header.magic != kMagic) return "sent bytes that are not a Chimera HostGroup frame";
        std::string why = accept_header(header);
        if (!why.empty()) return why;
        header_done = true;
        got = 0;
        payload.resize(header.bytes);
      } else {
        done = true;
      }
    }
    return "";
  }
};

std::string abort_text(const FrameReader& r) {
  return std::string(reinterpret_cast<const char*>(r.payload.data()), r.payload.size());
}

// "ranks 2-3", "rank 2"
std::string rank_range(int first, int n) {
  return n == 1 ? fmt::format("rank {}", first) : fmt::format("ranks {}-{}", first, first + n - 1);
}

}  // namespace

struct HostGroup::Peer {
  int fd = -1;
  bool dead = false;   // an I/O error or a partial frame: nothing more is sent on it
  std::mutex send_mu;  // one frame at a time (an abort() from another thread may send beside an exchange)
  FrameReader reader;

  ~Peer() {
    if (fd >= 0) ::close(fd);
  }
  // Ends the connection so that the peer reads everything sent: a close with unread bytes here sends a reset,
  // which can discard what the peer has not read yet (an abort frame naming why the group broke). So: done
  // writing, then read and drop what still comes until the peer closes too, for a moment at most.
  void finish() {
    if (fd < 0) return;
    ::shutdown(fd, SHUT_WR);
    const auto deadline = Clock::now() + std::chrono::milliseconds(200);
    char buf[4096];
    for (;;) {
      const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
      if (n > 0) continue;
      if (n == 0) break;
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) break;
      pollfd pfd{fd, POLLIN, 0};
      if (::poll(&pfd, 1, remaining_ms(deadline)) <= 0) break;
    }
  }
  // Sends one frame; "" or why not (the connection is then dead: a partial frame cannot be followed by another).
  std::string send_frame(const FrameHeader& h, std::span<const std::byte> payload, Clock::time_point deadline) {
    std::lock_guard<std::mutex> lock(send_mu);
    if (dead) return "closed its connection";
    std::string why = send_bytes(fd, &h, sizeof(h), deadline);
    if (why.empty() && !payload.empty()) why = send_bytes(fd, payload.data(), payload.size(), deadline);
    if (!why.empty()) {
      dead = true;
      ::shutdown(fd, SHUT_RDWR);
    }
    return why;
  }
};

HostGroup::HostGroup(int size, int nnodes, int node_rank, const std::string& master_addr, int master_port,
                     std::chrono::milliseconds timeout)
    : size_(size),
      nnodes_(nnodes),
      node_rank_(node_rank),
      local_size_(nnodes > 0 && size > 0 ? size / nnodes : 0),
      timeout_(timeout) {
  if (size < 1) invalid_input("dist::HostGroup: size {} (at least 1 rank)", size);
  if (nnodes < 1) invalid_input("dist::HostGroup: nnodes {} (at least 1 node)", nnodes);
  if (size % nnodes != 0) {
    invalid_input("dist::HostGroup: size {} does not split over {} nodes (each node hosts size / nnodes ranks)", size,
                  nnodes);
  }
  if (node_rank < 0 || node_rank >= nnodes) {
    invalid_input("dist::HostGroup: node rank {} of {} nodes (0..{})", node_rank, nnodes, nnodes - 1);
  }
  if (nnodes > 1 && (master_port < 1 || master_port > 65535)) {
    invalid_input("dist::HostGroup: master port {} (1..65535)", master_port);
  }
  if (nnodes > 1 && master_addr.empty()) invalid_input("dist::HostGroup: an empty master address");
  if (timeout.count() <= 0) invalid_input("dist::HostGroup: timeout {} ms (must be positive)", timeout.count());
  arrived_at_.assign(static_cast<size_t>(local_size_), 0);
  posts_.resize(static_cast<size_t>(local_size_));
  peers_.resize(static_cast<size_t>(nnodes));
  if (nnodes == 1) return;  // every rank is local: no sockets
  if (::pipe(wake_) != 0) runtime_error("dist::HostGroup: pipe failed: {}", std::strerror(errno));
  for (int fd : wake_) fcntl(fd, F_SETFL, fcntl(fd, F_GETFL, 0) | O_NONBLOCK);
  try {
    if (node_rank == 0) {
      accept_nodes(master_addr, master_port);
    } else {
      connect_to_master(master_addr, master_port);
    }
  } catch (...) {
    peers_.clear();
    for (int fd : wake_) ::close(fd);
    throw;
  }
}

HostGroup::~HostGroup() {
  for (auto& p : peers_) {
    if (p) p->finish();
  }
  peers_.clear();
  for (int fd : wake_) {
    if (fd >= 0) ::close(fd);
  }
}

std::string HostGroup::node_name(int node) const {
  return fmt::format("node {} ({})", node, rank_range(node * local_size_, local_size_));
}

namespace {

// The addresses master_addr:master_port names (getaddrinfo); a name that does not resolve is kInvalidInput.
addrinfo* resolve(const std::string& addr, int port, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  if (passive) hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  const int rc = ::getaddrinfo(addr.c_str(), service.c_str(), &hints, &found);
  if (rc != 0) invalid_input("dist::HostGroup: master address '{}' does not resolve: {}", addr, gai_strerror(rc));
  return found;
}

}  // namespace

void HostGroup::accept_nodes(const std::string& master_addr, int master_port) {
  const auto deadline = Clock::now() + timeout_;
  const std::string me = fmt::format("dist::HostGroup on {}", node_name(0));
  // Listens on every interface of master_addr's family, so the other hosts reach it by whichever address they use.
  addrinfo* found = resolve(master_addr, master_port, true);
  const int family = found->ai_family;
  ::freeaddrinfo(found);
  sockaddr_storage any{};
  socklen_t any_len = 0;
  if (family == AF_INET6) {
    auto* a = reinterpret_cast<sockaddr_in6*>(&any);
    a->sin6_family = AF_INET6;
    a->sin6_addr = in6addr_any;
    a->sin6_port = htons(static_cast<uint16_t>(master_port));
    any_len = sizeof(sockaddr_in6);
  } else {
    auto* a = reinterpret_cast<sockaddr_in*>(&any);
    a->sin_family = AF_INET;
    a->sin_addr.s_addr = htonl(INADDR_ANY);
    a->sin_port = htons(static_cast<uint16_t>(master_port));
    any_len = sizeof(sockaddr_in);
  }
  const int listener = ::socket(family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (listener < 0) runtime_error("{}: socket failed: {}", me, std::strerror(errno));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{listener};
  const int one = 1;
  setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(listener, reinterpret_cast<const sockaddr*>(&any), any_len) != 0) {
    runtime_error("{}: cannot listen on port {} (master {}:{}): {}", me, master_port, master_addr, master_port,
                  std::strerror(errno));
  }
  if (::listen(listener, nnodes_) != 0) runtime_error("{}: listen failed: {}", me, std::strerror(errno));

  // Connections whose hello is still being read, then the joined nodes in peers_.
  std::vector<std::unique_ptr<Peer>> pending;
  int joined = 0;
  std::string why;
  // Fails the constructor, telling the joined nodes (and `also`, the one whose hello was refused) why.
  auto refuse = [&](const std::string& w, Peer* also = nullptr) {
    FrameHeader h;
    h.type = static_cast<uint32_t>(Frame::kAbort);
    h.bytes = std::min<uint64_t>(w.size(), kMaxAbortBytes);
    const auto text = std::as_bytes(std::span<const char>(w.data(), h.bytes));
    for (auto& p : peers_) {
      if (p) p->send_frame(h, text, Clock::now() + timeout_);
    }
    if (also != nullptr) also->send_frame(h, text, Clock::now() + timeout_);
    runtime_error("{}: {}", me, w);
  };
  while (joined < nnodes_ - 1) {
    std::vector<pollfd> fds{{listener, POLLIN, 0}};
    for (auto& p : pending) fds.push_back({p->fd, POLLIN, 0});
    const int ready = ::poll(fds.data(), fds.size(), remaining_ms(deadline));
    if (ready < 0 && errno != EINTR) refuse(fmt::format("poll failed: {}", std::strerror(errno)));
    if (ready == 0 && Clock::now() >= deadline) {
      std::string missing;
      for (int k = 1; k < nnodes_; ++k) {
        if (!peers_[static_cast<size_t>(k)]) missing += fmt::format("{}{}", missing.empty() ? "" : ", ", node_name(k));
      }
      refuse(fmt::format("{} did not join within {} ms (master {}:{})", missing, timeout_.count(), master_addr,
                         master_port));
    }
    if (fds[0].revents & POLLIN) {
      const int fd = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd >= 0) {
        set_nonblocking_nodelay(fd);
        pending.push_back(std::make_unique<Peer>());
        pending.back()->fd = fd;
      }
    }
    for (size_t i = 0; i + 1 < fds.size(); ++i) {
      if (fds[i + 1].revents == 0) continue;
      Peer& p = *pending[i];
      why = p.reader.read_some(p.fd, [](const FrameHeader& h) -> std::string {
        if (h.type != static_cast<uint32_t>(Frame::kHello) || h.bytes != 0) return "sent no hello";
        return "";
      });
      if (!why.empty()) {
        p.dead = true;  // a connection that is not a node (or went away before its hello): dropped
        continue;
      }
      if (!p.reader.done) continue;
      const FrameHeader h = p.reader.header;
      const int node = h.root;
      if (static_cast<int>(h.op) != nnodes_ || static_cast<int64_t>(h.count) != size_) {
        refuse(fmt::format("node {} was started with size {} over {} nodes, node 0 with size {} over {} nodes", node,
                           h.count, h.op, size_, nnodes_),
               &p);
      }
      if (node < 1 || node >= nnodes_) {
        refuse(fmt::format("a node joined with node rank {} of {} nodes", node, nnodes_), &p);
      }
      if (peers_[static_cast<size_t>(node)]) refuse(fmt::format("two processes joined as node {}", node), &p);
      p.reader.reset();
      peers_[static_cast<size_t>(node)] = std::move(pending[i]);
      ++joined;
    }
    std::erase_if(pending, [](const std::unique_ptr<Peer>& p) { return !p || p->dead; });
  }
  FrameHeader ready;
  ready.type = static_cast<uint32_t>(Frame::kReady);
  for (int k = 1; k < nnodes_; ++k) {
    why = peers_[static_cast<size_t>(k)]->send_frame(ready, {}, deadline + timeout_);
    if (!why.empty()) refuse(fmt::format("{} {} while joining", node_name(k), why));
  }
}

void HostGroup::connect_to_master(const std::string& master_addr, int master_port) {
  const auto deadline = Clock::now() + timeout_;
  const std::string me = fmt::format("dist::HostGroup on {}", node_name(node_rank_));
  const std::string master = fmt::format("the master ({}) at {}:{}", node_name(0), master_addr, master_port);
  addrinfo* found = resolve(master_addr, master_port, false);
  auto peer = std::make_unique<Peer>();
  std::string last_error = "no address";
  // The master may start later than this node: refused connections are retried until the deadline.
  while (peer->fd < 0) {
    for (addrinfo* a = found; a != nullptr && peer->fd < 0; a = a->ai_next) {
      const int fd = ::socket(a->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
      if (fd < 0) continue;
      int rc = ::connect(fd, a->ai_addr, a->ai_addrlen);
      if (rc != 0 && errno == EINPROGRESS) {
        pollfd pfd{fd, POLLOUT, 0};
        rc = ::poll(&pfd, 1, remaining_ms(deadline)) == 1 ? 0 : -1;
        int err = rc == 0 ? 0 : ETIMEDOUT;
        socklen_t len = sizeof(err);
        if (rc == 0) getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
        errno = err;
        rc = err == 0 ? 0 : -1;
      }
      if (rc == 0) {
        peer->fd = fd;
      } else {
        last_error = std::strerror(errno);
        ::close(fd);
      }
    }
    if (peer->fd >= 0) break;
    if (Clock::now() >= deadline) {
      ::freeaddrinfo(found);
      runtime_error("{}: could not connect to {} within {} ms: {}", me, master, timeout_.count(), last_error);
    }
    std::this_thread::sleep_for(
        std::min(std::chrono::milliseconds(20), std::chrono::milliseconds(std::max(1, remaining_ms(deadline)))));
  }
  ::freeaddrinfo(found);
  set_nonblocking_nodelay(peer->fd);
  FrameHeader hello;
  hello.type = static_cast<uint32_t>(Frame::kHello);
  hello.op = static_cast<uint32_t>(nnodes_);
  hello.root = node_rank_;
  hello.count = static_cast<uint64_t>(size_);
  std::string why = peer->send_frame(hello, {}, deadline);
  if (!why.empty()) runtime_error("{}: {} {}", me, master, why);
  // Node 0 answers within its own timeout, which began before this node connected; twice it leaves room.
  const auto ready_deadline = Clock::now() + 2 * timeout_;
  FrameReader& r = peer->reader;
  while (!r.done) {
    pollfd pfd{peer->fd, POLLIN, 0};
    if (::poll(&pfd, 1, remaining_ms(ready_deadline)) == 0) {
      runtime_error("{}: {} did not confirm the group within {} ms", me, master, 2 * timeout_.count());
    }
    why = r.read_some(peer->fd, [](const FrameHeader& h) -> std::string {
      if (h.type == static_cast<uint32_t>(Frame::kAbort) && h.bytes <= kMaxAbortBytes) return "";
      if (h.type == static_cast<uint32_t>(Frame::kReady) && h.bytes == 0) return "";
      return "sent an unexpected frame";
    });
    if (!why.empty()) runtime_error("{}: {} {} while joining", me, master, why);
  }
  if (r.header.type == static_cast<uint32_t>(Frame::kAbort)) runtime_error("{}: {}", me, abort_text(r));
  r.reset();
  peers_[0] = std::move(peer);
}

void HostGroup::fail(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!broken_.empty()) return;
    broken_ = why;
    is_broken_ = true;
    cv_.notify_all();
  }
  if (wake_[1] >= 0) {
    const char c = 1;
    [[maybe_unused]] const ssize_t n = ::write(wake_[1], &c, 1);
  }
  FrameHeader h;
  h.type = static_cast<uint32_t>(Frame::kAbort);
  h.bytes = std::min<uint64_t>(why.size(), kMaxAbortBytes);
  for (auto& p : peers_) {
    if (p) p->send_frame(h, std::as_bytes(std::span<const char>(why.data(), h.bytes)), Clock::now() + timeout_);
  }
}

void HostGroup::collective(int rank, const Post& post) {
  const char* op = op_name(static_cast<uint32_t>(post.op));
  const int local = rank - first_rank();
  if (local < 0 || local >= local_size_) {
    runtime_error("dist::HostGroup::{}: rank {} is not one of {}'s", op, rank, node_name(node_rank_));
  }
  std::unique_lock<std::mutex> lock(mu_);
  if (!broken_.empty()) runtime_error("dist::HostGroup::{} on rank {}: {}", op, rank, broken_);
  const uint64_t gen = generation_;
  posts_[static_cast<size_t>(local)] = post;
  arrived_at_[static_cast<size_t>(local)] = gen + 1;
  if (++arrived_ == local_size_) {
    arrived_ = 0;
    exchanging_ = true;
    lock.unlock();
    std::string why;
    // Every local rank posted the same call, or the group is broken on every node (they are out of step).
    const Post& first = posts_[0];
    for (int r = 0; r < local_size_ && why.empty(); ++r) {
      const Post& p = posts_[static_cast<size_t>(r)];
      if (p.op != first.op || p.count != first.count || p.root != first.root) {
        why = fmt::format("rank {} called {} (count {}, root {}) while rank {} called {} (count {}, root {})",
                          first_rank() + r, op_name(static_cast<uint32_t>(p.op)), p.count, p.root, first_rank(),
                          op_name(static_cast<uint32_t>(first.op)), first.count, first.root);
      }
    }
    if (why.empty()) {
      try {
        exchange(gen + 1);
      } catch (const Error& e) {
        why = e.what();
      }
    }
    if (!why.empty()) fail(why);
    lock.lock();
    exchanging_ = false;
    generation_ok_ = why.empty();
    ++generation_;
    cv_.notify_all();
    if (!generation_ok_) runtime_error("dist::HostGroup::{} on rank {}: {}", op, rank, broken_);
    return;
  }
  // Wait for the other local ranks (bounded by the timeout); once all are in, for the exchange, whose every
  // network wait is bounded by the timeout itself.
  const bool all_in =
      cv_.wait_for(lock, timeout_, [&] { return generation_ != gen || exchanging_ || !broken_.empty(); });
  if (all_in && generation_ == gen && exchanging_) cv_.wait(lock, [&] { return generation_ != gen; });
  if (generation_ != gen) {
    if (generation_ok_) return;
    runtime_error("dist::HostGroup::{} on rank {}: {}", op, rank, broken_);
  }
  if (!all_in) {
    std::string missing;
    for (int r = 0; r < local_size_; ++r) {
      if (arrived_at_[static_cast<size_t>(r)] != gen + 1)
        missing += fmt::format("{}{}", missing.empty() ? "" : ", ", first_rank() + r);
    }
    const std::string why =
        fmt::format("rank(s) {} of {} did not arrive within {} ms ({})", missing, size_, timeout_.count(), op);
    lock.unlock();
    fail(why);
    lock.lock();
  }
  runtime_error("dist::HostGroup::{} on rank {}: {}", op, rank, broken_);
}

size_t HostGroup::payload_bytes(const Post& p, int node, bool result) const {
  switch (p.op) {
    case Op::kAllReduceSum: return p.count * sizeof(float) * (result ? 1 : static_cast<size_t>(local_size_));
    case Op::kAllGather: return p.count * sizeof(float) * static_cast<size_t>(result ? size_ : local_size_);
    case Op::kBroadcast: return result || p.root / local_size_ == node ? p.count : 0;
    case Op::kBarrier: return 0;
  }
  return 0;
}

void HostGroup::exchange(uint64_t seq) {
  if (nnodes_ == 1 || node_rank_ == 0) {
    exchange_master(seq);
  } else {
    exchange_worker(seq);
  }
}

void HostGroup::exchange_master(uint64_t seq) {
  const Post& mine = posts_[0];
  const char* op = op_name(static_cast<uint32_t>(mine.op));
  const auto deadline = Clock::now() + timeout_;
  // Every other node's call frame, read as they arrive (one poll over all connections).
  int waiting = nnodes_ - 1;
  while (waiting > 0) {
    std::vector<pollfd> fds{{wake_[0], POLLIN, 0}};
    std::vector<int> nodes;
    for (int k = 1; k < nnodes_; ++k) {
      Peer& p = *peers_[static_cast<size_t>(k)];
      if (!p.reader.done) {
        fds.push_back({p.fd, POLLIN, 0});
        nodes.push_back(k);
      }
    }
    const int ready = ::poll(fds.data(), fds.size(), remaining_ms(deadline));
    if (is_broken_) runtime_error("{}", broken_);
    if (ready < 0 && errno != EINTR) runtime_error("poll failed: {}", std::strerror(errno));
    if (ready == 0 && Clock::now() >= deadline) {
      std::string missing;
      for (int k : nodes) missing += fmt::format("{}{}", missing.empty() ? "" : ", ", node_name(k));
      runtime_error("{} did not arrive within {} ms ({}, call {})", missing, timeout_.count(), op, seq);
    }
    for (size_t i = 0; i < nodes.size(); ++i) {
      if (fds[i + 1].revents == 0) continue;
      const int k = nodes[i];
      Peer& p = *peers_[static_cast<size_t>(k)];
      const std::string why = p.reader.read_some(p.fd, [&](const FrameHeader& h) -> std::string {
        if (h.type == static_cast<uint32_t>(Frame::kAbort)) return h.bytes <= kMaxAbortBytes ? "" : "sent a bad abort";
        if (h.type != static_cast<uint32_t>(Frame::kCall)) return "sent an unexpected frame";
        if (h.op != static_cast<uint32_t>(mine.op) || h.count != mine.count || h.root != mine.root || h.seq != seq) {
          return fmt::format(
              "called {} (count {}, root {}, call {}) while node 0 called {} (count {}, root {}, call {})",
              op_name(h.op), h.count, h.root, h.seq, op, mine.count, mine.root, seq);
        }
        if (h.bytes != payload_bytes(mine, k, false)) return fmt::format("sent {} bytes for {}", h.bytes, op);
        return "";
      });
      if (!why.empty()) runtime_error("{} {} ({}, call {})", node_name(k), why, op, seq);
      if (p.reader.done && p.reader.header.type == static_cast<uint32_t>(Frame::kAbort)) {
        runtime_error("{}", abort_text(p.reader));
      }
      if (p.reader.done) --waiting;
    }
  }
  // The result, from every node's data in rank order.
  auto input = [&](int rank) -> const std::byte* {
    const int node = rank / local_size_;
    const int local = rank % local_size_;
    const size_t block = mine.count * (mine.op == Op::kBroadcast ? 1 : sizeof(float));
    if (node == 0) return static_cast<const std::byte*>(posts_[static_cast<size_t>(local)].in);
    return peers_[static_cast<size_t>(node)]->reader.payload.data() +
           (mine.op == Op::kBroadcast ? 0 : static_cast<size_t>(local) * block);
  };
  std::vector<std::byte> result(payload_bytes(mine, 0, true));
  if (mine.op == Op::kAllReduceSum) {
    std::vector<float> sum(mine.count, 0.0f);
    for (int r = 0; r < size_; ++r) {
      const std::byte* src = input(r);
      for (size_t i = 0; i < sum.size(); ++i) {
        float v;
        std::memcpy(&v, src + i * sizeof(float), sizeof(float));
        sum[i] += v;
      }
    }
    if (!sum.empty()) std::memcpy(result.data(), sum.data(), result.size());
  } else if (mine.op == Op::kAllGather) {
    const size_t block = mine.count * sizeof(float);
    for (int r = 0; r < size_ && block > 0; ++r)
      std::memcpy(result.data() + static_cast<size_t>(r) * block, input(r), block);
  } else if (mine.op == Op::kBroadcast && !result.empty()) {
    std::memcpy(result.data(), input(mine.root), result.size());
  }
  const FrameHeader h =
      collective_header(Frame::kResult, static_cast<uint32_t>(mine.op), mine.root, mine.count, seq, result.size());
  for (int k = 1; k < nnodes_; ++k) {
    Peer& p = *peers_[static_cast<size_t>(k)];
    p.reader.reset();
    const std::string why = p.send_frame(h, result, deadline + timeout_);
    if (!why.empty()) runtime_error("{} {} ({}, call {})", node_name(k), why, op, seq);
  }
  for (int r = 0; r < local_size_ && !result.empty(); ++r) {
    const Post& p = posts_[static_cast<size_t>(r)];
    if (p.out != nullptr) std::memcpy(p.out, result.data(), result.size());
  }
}

void HostGroup::exchange_worker(uint64_t seq) {
  const Post& mine = posts_[0];
  const char* op = op_name(static_cast<uint32_t>(mine.op));
  Peer& master = *peers_[0];
  // This node's ranks' data back to back (a broadcast: the root's bytes, when the root is here).
  std::vector<std::byte> call(payload_bytes(mine, node_rank_, false));
  if (mine.op == Op::kBroadcast) {
    if (!call.empty()) std::memcpy(call.data(), posts_[static_cast<size_t>(mine.root - first_rank())].in, call.size());
  } else if (!call.empty()) {
    const size_t block = call.size() / static_cast<size_t>(local_size_);
    for (int r = 0; r < local_size_; ++r)
      std::memcpy(call.data() + static_cast<size_t>(r) * block, posts_[static_cast<size_t>(r)].in, block);
  }
  const FrameHeader h =
      collective_header(Frame::kCall, static_cast<uint32_t>(mine.op), mine.root, mine.count, seq, call.size());
  const auto deadline = Clock::now() + timeout_;
  std::string why = master.send_frame(h, call, deadline);
  if (!why.empty()) runtime_error("{} {} ({}, call {})", node_name(0), why, op, seq);
  // Node 0's answer: it may wait a whole timeout for a third node before it answers with its verdict; without a
  // deadline for wait_broadcast (node 0 sends when it has work).
  const bool idle = std::all_of(posts_.begin(), posts_.end(), [](const Post& p) { return p.idle; });
  const auto answer_deadline = deadline + timeout_;
  FrameReader& r = master.reader;
  r.reset();
  while (!r.done) {
    pollfd fds[2] = {{wake_[0], POLLIN, 0}, {master.fd, POLLIN, 0}};
    const int ready = ::poll(fds, 2, idle ? -1 : remaining_ms(answer_deadline));
    if (is_broken_) runtime_error("{}", broken_);
    if (ready < 0 && errno != EINTR) runtime_error("poll failed: {}", std::strerror(errno));
    if (!idle && ready == 0 && Clock::now() >= answer_deadline) {
      runtime_error("{} did not answer within {} ms ({}, call {})", node_name(0), 2 * timeout_.count(), op, seq);
    }
    if (fds[1].revents == 0) continue;
    why = r.read_some(master.fd, [&](const FrameHeader& rh) -> std::string {
      if (rh.type == static_cast<uint32_t>(Frame::kAbort)) return rh.bytes <= kMaxAbortBytes ? "" : "sent a bad abort";
      if (rh.type != static_cast<uint32_t>(Frame::kResult) || rh.op != h.op || rh.count != h.count ||
          rh.root != h.root || rh.seq != seq || rh.bytes != payload_bytes(mine, node_rank_, true)) {
        return "sent an unexpected frame";
      }
      return "";
    });
    if (!why.empty()) runtime_error("{} {} ({}, call {})", node_name(0), why, op, seq);
  }
  if (r.header.type == static_cast<uint32_t>(Frame::kAbort)) runtime_error("{}", abort_text(r));
  for (int k = 0; k < local_size_ && !r.payload.empty(); ++k) {
    const Post& p = posts_[static_cast<size_t>(k)];
    if (p.out != nullptr) std::memcpy(p.out, r.payload.data(), r.payload.size());
  }
  r.reset();
}

void HostGroup::all_reduce_sum(int rank, std::span<float> data) {
  collective(rank, {Op::kAllReduceSum, data.data(), data.data(), data.size(), 0});
}

void HostGroup::all_gather(int rank, std::span<const float> in, std::span<float> out) {
  if (out.size() != in.size() * static_cast<size_t>(size_)) {
    runtime_error("dist::HostGroup::all_gather on rank {}: out has {} elements, expected {} x {}", rank, out.size(),
                  size_, in.size());
  }
  collective(rank, {Op::kAllGather, in.data(), out.data(), in.size(), 0});
}

void HostGroup::broadcast(int rank, std::span<std::byte> data, int root) {
  if (root < 0 || root >= size_) runtime_error("dist::HostGroup::broadcast: root {} of a group of {}", root, size_);
  collective(rank, {Op::kBroadcast, data.data(), data.data(), data.size(), root});
}

void HostGroup::wait_broadcast(int rank, std::span<std::byte> data) {
  Post post{Op::kBroadcast, data.data(), data.data(), data.size(), 0};
  post.idle = node_rank_ != 0;
  collective(rank, post);
}

void HostGroup::barrier(int rank) {
  collective(rank, {Op::kBarrier, nullptr, nullptr, 0, 0});
}

std::string HostGroup::health() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!broken_.empty()) return broken_;
  }
  for (size_t k = 0; k < peers_.size(); ++k) {
    if (!peers_[k] || peers_[k]->fd < 0) continue;
    pollfd pfd{peers_[k]->fd, POLLRDHUP, 0};
    if (::poll(&pfd, 1, 0) == 1 && (pfd.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0) {
      fail(fmt::format("{} closed its connection", node_name(static_cast<int>(k))));
      break;
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  return broken_;
}

void HostGroup::abort(int rank, const std::string& why) {
  fail(fmt::format("rank {} aborted: {}", rank, why));
}

}  // namespace chimera::dist
