#!/usr/bin/env bash
# Second command of the README (and what CI runs): install, build, run every fuzz harness for
# CHIMERA_FUZZ_SECONDS each (default 30; 0 skips: a fuzz finding fails the run like a failed test), then every
# test. ctest runs last so that its summary is the run's closing line.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh               # every target: library, CLI, tests (and benchmarks with CUDA)
fuzz_seconds=${CHIMERA_FUZZ_SECONDS:-30}
if [ "$fuzz_seconds" != "0" ]; then
  bash scripts/fuzz.sh "$fuzz_seconds"
fi
cd build
ctest --output-on-failure -j "$(nproc)" "$@"
