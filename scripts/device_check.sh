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

source scripts/device_env.sh  # carried .debs -> CMAKE_EXTRA
cmake -S . -B build-dev -G Ninja -DCMAKE_BUILD_TYPE=Release -DCHIMERA_CUDA=ON "${CMAKE_EXTRA[@]}" \
  >"$OUT/cmake.log" 2>&1 || { tail -30 "$OUT/cmake.log"; exit 1; }
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
