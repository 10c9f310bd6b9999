#!/usr/bin/env bash
# The GPU machine's image has no libpcre2-dev (CMake stops at pkg_check_modules(libpcre2-8); seen 2026-11-30).
# This copies the build dependencies installed here (scripts/setup.sh) into DEST/usr so they can travel with a
# device run; on the device machine, from the tree root:
#   D=$PWD/<DEST>/usr; sed -i "s|^prefix=.*|prefix=$D|" $D/lib/x86_64-linux-gnu/pkgconfig/libpcre2-8.pc
#   export PKG_CONFIG_PATH=$D/lib/x86_64-linux-gnu/pkgconfig LD_LIBRARY_PATH=$D/lib/x86_64-linux-gnu
#   cmake -S . -B b -G Ninja -DCHIMERA_CUDA=ON -DCHIMERA_WERROR=OFF -DCMAKE_PREFIX_PATH=$D
# (pcre2 links statically: only its .a is copied; fmt is the shared libfmt.so.9 found through LD_LIBRARY_PATH.)
# Usage: scripts/pack_device_deps.sh DEST
set -euo pipefail
DEST=${1:?usage: pack_device_deps.sh DEST}
mkdir -p "$DEST"
for pkg in libpcre2-dev libgtest-dev libgmock-dev libfmt-dev libfmt9 nlohmann-json3-dev libcli11-dev; do
  dpkg -L "$pkg" | while read -r f; do
    { [ -f "$f" ] || [ -L "$f" ]; } || continue
    case "$f" in
      */share/doc/* | */src/* | */bin/* | */man/* | *pcre2-16* | *pcre2-32* | *pcre2-posix* | *libpcre2-8.so*) ;;
      *) mkdir -p "$DEST$(dirname "$f")" && cp -a "$f" "$DEST$f" ;;
    esac
  done
done
du -sh "$DEST"
