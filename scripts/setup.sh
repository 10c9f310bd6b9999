#!/usr/bin/env bash
# Installs what Chimera needs to build and test on Debian 12 / Ubuntu 22.04+ (idempotent).
# System packages come from the distribution; Python packages (fixture and golden generation) go into .venv.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

PKGS=(build-essential cmake ninja-build pkg-config git
      nlohmann-json3-dev libcli11-dev libfmt-dev libpcre2-dev
      libgtest-dev libgmock-dev libbenchmark-dev python3 python3-venv)
# chimera serve: Boost.Beast / Asio (header-only); curl for the server tests.
PKGS+=(libboost1.81-dev curl)
# chimera bench serve: HTTP client (libcurl's multi interface drives every stream on one thread).
PKGS+=(libcurl4-openssl-dev)
# The fuzz harnesses (scripts/fuzz.sh, run briefly by scripts/test.sh): clang with libFuzzer and the sanitizer runtimes.
PKGS+=(clang libclang-rt-dev)

missing=()
for p in "${PKGS[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi

# Python venv: always with the server tests' client (tests/server: the `openai` package and pytest); with
# CHIMERA_SETUP_PYTHON=1 also the scripts that regenerate fixtures and goldens.
if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
if ! .venv/bin/python -c "import openai, pytest" >/dev/null 2>&1; then
  .venv/bin/pip install -q -r scripts/requirements-test.txt
fi
if [ "${CHIMERA_SETUP_PYTHON:-0}" = "1" ]; then
  .venv/bin/pip install -q -r scripts/requirements.txt
fi
# CUTLASS headers (PyPI's nvidia-cutlass wheel) for the MoE experts' prefill GEMM, on machines with nvcc and a GPU
# (the CUDA build then compiles it: cmake's CHIMERA_CUTLASS=AUTO; without them the mma kernels run). A failed
# download only warns. CHIMERA_SETUP_CUTLASS=0 skips, =1 fetches without the GPU check (builds for another machine).
want_cutlass=${CHIMERA_SETUP_CUTLASS:-auto}
if [ "$want_cutlass" = "auto" ]; then
  want_cutlass=0
  if { command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; } && nvidia-smi -L >/dev/null 2>&1; then
    want_cutlass=1
  fi
fi
if [ "$want_cutlass" = "1" ] && ! scripts/fetch_cutlass.sh; then
  echo "setup: warning: CUTLASS headers not fetched; the MoE prefill GEMM uses the mma kernels" >&2
fi
echo "setup: done"
