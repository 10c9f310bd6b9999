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
         pkgconf-bin pkgconf libboost1.81-dev libcurl4-openssl-dev libcurl4; do
  ls "${p}"_*.deb >/dev/null 2>&1 || apt-get download "$p"
done
# libcurl's own dependencies, in rt/: scripts/device_env.sh unpacks only those whose library the GPU image lacks.
mkdir -p rt
cd rt
for p in libbrotli1 libcom-err2 libgssapi-krb5-2 libidn2-0 libk5crypto3 libkeyutils1 libkrb5-3 libkrb5support0 \
         libldap-2.5-0 libnghttp2-14 libpsl5 librtmp1 libsasl2-2 libssh2-1 libunistring2 libgnutls30 libhogweed6 \
         libnettle8 libgmp10 libp11-kit0 libtasn1-6 libffi8 libzstd1; do
  ls "${p}"_*.deb >/dev/null 2>&1 || apt-get download "$p"
done
cd ..
cd ..
if [ "${CHIMERA_DEVICE_CUTLASS:-1}" != "0" ]; then scripts/fetch_cutlass.sh; fi
ls .deps
