#!/usr/bin/env bash
# Downloads (here, on a machine that reaches Debian's registry) the .debs the build needs but the GPU machine's
# image lacks (fmt, CLI11, nlohmann-json, GoogleTest, PCRE2, pkg-config) into .deps/ (git-ignored), to be
# carried to the GPU machine and unpacked there by scripts/device_check.sh; and CUTLASS's headers (PyPI's
# nvidia-cutlass wheel, scripts/fetch_cutlass.sh) into .deps/cutlass/include, with which scripts/device_env.sh turns
# on the CUTLASS MoE path (-DCHIMERA_CUTLASS=ON). CHIMERA_DEVICE_CUTLASS=0 skips the headers.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .deps
cd .deps
for p in libcli11-dev libfmt-dev libfmt9 libgtest-dev libpcre2-8-0 libpcre2-dev libpkgconf3 nlohmann-json3-dev \
         pkgconf-bin pkgconf; do
  ls "${p}"_*.deb >/dev/null 2>&1 || apt-get download "$p"
done
cd ..
if [ "${CHIMERA_DEVICE_CUTLASS:-1}" != "0" ]; then scripts/fetch_cutlass.sh; fi
ls .deps
