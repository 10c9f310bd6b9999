#!/usr/bin/env bash
# Downloads (here, on a machine that reaches Debian's registry) the .debs the build needs but the GPU machine's
# image lacks (fmt, CLI11, nlohmann-json, GoogleTest, PCRE2, pkg-config) into .deps/ (git-ignored), to be
# carried to the GPU machine and unpacked there by scripts/device_check.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .deps
cd .deps
for p in libcli11-dev libfmt-dev libfmt9 libgtest-dev libpcre2-8-0 libpcre2-dev libpkgconf3 nlohmann-json3-dev \
         pkgconf-bin pkgconf; do
  ls "${p}"_*.deb >/dev/null 2>&1 || apt-get download "$p"
done
ls
