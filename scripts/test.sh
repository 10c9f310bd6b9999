#!/usr/bin/env bash
# Second command of the README (and what CI runs): install, build, run every test, then every fuzz harness for
# CHIMERA_FUZZ_SECONDS each (default 30; 0 skips): a fuzz finding fails the run like a failed test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh               # every target: library, CLI, tests (and benchmarks with CUDA)
(cd build && ctest --output-on-failure -j "$(nproc)" "$@")
fuzz_seconds=${CHIMERA_FUZZ_SECONDS:-30}
if [ "$fuzz_seconds" != "0" ]; then
  bash scripts/fuzz.sh "$fuzz_seconds"
fi
