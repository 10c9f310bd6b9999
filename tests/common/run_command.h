// Runs a shell command line from a test and collects what it printed: the CLI and end-to-end tests' one helper.
#pragma once

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <string>

#include <gtest/gtest.h>

namespace chimera::test {

struct RunOutput {
  int status;       // exit status; -1 when the command did not exit normally
  std::string out;  // what the command line wrote to its stdout (add 2>&1 to the command for stderr)
};

inline RunOutput run_shell(const std::string& cmd) {
  FILE* pipe = popen(cmd.c_str(), "r");
  EXPECT_NE(pipe, nullptr) << cmd;
  RunOutput r{-1, ""};
  if (!pipe) return r;
  std::array<char, 4096> buf{};
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), pipe)) > 0) r.out.append(buf.data(), n);
  const int st = pclose(pipe);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

}  // namespace chimera::test
