// Host memory for the memory plan: what the kernel says is available without swapping.
#include <unistd.h>

#include <fstream>
#include <string>

#include "backends/device_api.h"

namespace chimera::device {

MemoryInfo host_memory_info() {
  MemoryInfo info;
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  size_t kib = 0;
  std::string unit;
  while (meminfo >> key >> kib >> unit) {
    if (key == "MemAvailable:") info.free = kib * 1024;
    if (key == "MemTotal:") info.total = kib * 1024;
  }
  if (info.total == 0) {
    const long pages = sysconf(_SC_PHYS_PAGES), avail = sysconf(_SC_AVPHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    if (pages > 0 && page > 0) info.total = static_cast<size_t>(pages) * static_cast<size_t>(page);
    if (avail > 0 && page > 0) info.free = static_cast<size_t>(avail) * static_cast<size_t>(page);
  }
  if (info.free == 0) info.free = info.total;
  return info;
}

}  // namespace chimera::device
