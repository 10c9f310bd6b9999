#!/usr/bin/env bash
# First command of the README: install, build, and generate text with the bundled default model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh chimera_cli   # the CLI only: the test binary is built by test.sh
./build/chimera generate -m models/nemotron-h-kjv -p "${1:-In the beginning God created}" -n "${2:-48}" "${@:3}"
