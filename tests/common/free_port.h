// A loopback TCP port nothing listens on now, for the tests that start a HostGroup of several nodes (or a multi-process
// chimera): bound to port 0 so the kernel picks a free one, then released. A test failure (not an abort) when there is
// none.
#pragma once

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace chimera::test {

inline int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof(a);
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    ADD_FAILURE() << "cannot find a free port: " << std::strerror(errno);
  }
  if (fd >= 0) ::close(fd);
  return ntohs(a.sin_port);
}

}  // namespace chimera::test
