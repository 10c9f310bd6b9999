#!/usr/bin/env bash
# Second command of the README (and what CI runs): install, build, run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh               # every target: library, CLI, tests (and benchmarks with CUDA)
cd build
ctest --output-on-failure -j "$(nproc)" "$@"
