#!/usr/bin/env bash
# Configures and builds Chimera in build/ (Release, Ninja). CHIMERA_CUDA=ON|OFF|AUTO (default AUTO: CUDA
# sources compile wherever nvcc is found; GPU tests skip at run time without a GPU).
# Arguments are ninja targets (e.g. `scripts/build.sh chimera_cli` builds the CLI only); none builds everything.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCHIMERA_CUDA="${CHIMERA_CUDA:-AUTO}" >/dev/null
ninja -C "$BUILD_DIR" ${NINJA_JOBS:+-j "$NINJA_JOBS"} "$@"
