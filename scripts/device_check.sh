#!/usr/bin/env bash
# On the GPU machine: build everything, run every test (the /Cuda op instances run for real there), run
# compute-sanitizer (memcheck, racecheck) over the CUDA kernel tests, then the kernel benchmarks and the peer
# scripts, writing logs to ${OUT:-/tmp/out}. Usage: scripts/device_check.sh [tests|sanitize|bench|all]...
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(all)
want() { for s in "${steps[@]}"; do [ "$s" = "$1" ] || [ "$s" = all ] && return 0; done; return 1; }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
git rev-parse --short HEAD 2>/dev/null | tee -a "$OUT/device.txt"

# The GPU image has no fmt / CLI11 / nlohmann / gtest / pcre2 dev packages: unpack the carried .debs
# (scripts/device_deps.sh) into a private prefix and point CMake and pkg-config at it.
D=$PWD/.deps/root
mkdir -p "$D"
for f in .deps/*.deb; do dpkg -x "$f" "$D"; done
for pc in "$D"/usr/lib/x86_64-linux-gnu/pkgconfig/*.pc "$D"/usr/share/pkgconfig/*.pc; do
  sed -i "s|^prefix=/usr\$|prefix=$D/usr|" "$pc"
done
if command -v pkg-config >/dev/null; then PKGC=$(command -v pkg-config); else
  mkdir -p .deps/bin
  printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' "$D/usr/lib/x86_64-linux-gnu" "$D/usr/bin/pkgconf" >.deps/bin/pkg-config
  chmod +x .deps/bin/pkg-config
  PKGC=$PWD/.deps/bin/pkg-config
fi
export PKG_CONFIG_PATH=$D/usr/lib/x86_64-linux-gnu/pkgconfig:$D/usr/share/pkgconfig
export LD_LIBRARY_PATH=$D/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
cmake -S . -B build-dev -G Ninja -DCMAKE_BUILD_TYPE=Release -DCHIMERA_CUDA=ON -DCMAKE_PREFIX_PATH="$D/usr" \
  -DPKG_CONFIG_EXECUTABLE="$PKGC" >"$OUT/cmake.log" 2>&1 || { tail -30 "$OUT/cmake.log"; exit 1; }
ninja -C build-dev -j "$(nproc)" ${NINJA_TARGETS:-} 2>&1 | tail -3 || exit 1
rc=0
if want tests; then
  ./build-dev/chimera_tests --gtest_brief=1 2>&1 | tee "$OUT/tests.log" | tail -30
  rc=${PIPESTATUS[0]}
fi
if want sanitize; then
  for tool in memcheck racecheck; do
    compute-sanitizer --tool "$tool" --error-exitcode 9 ./build-dev/chimera_tests --gtest_brief=1 \
      --gtest_filter="${SANITIZE_FILTER:-*/Cuda}" >"$OUT/sanitize-$tool.log" 2>&1
    echo "compute-sanitizer $tool: exit $? ($(grep -c 'ERROR SUMMARY: 0 errors' "$OUT/sanitize-$tool.log") clean summaries)"
    tail -3 "$OUT/sanitize-$tool.log"
  done
fi
if want bench; then
  ./build-dev/chimera_bench ${BENCH_FILTER:-} 2>&1 | tee "$OUT/bench.log"
  for p in bench/peers/*_peers.py; do
    PYTHONPATH=.peers:${PYTHONPATH:-} timeout 300 python3 "$p" 2>&1 | tee -a "$OUT/peers.log"
  done
fi
exit $rc
