# Sourced on the GPU machine (from the repository root) by scripts/device_check.sh and bench/run_*_device.sh.
# The GPU image has no fmt / CLI11 / nlohmann / gtest / pcre2 dev packages: unpack the carried Debian .debs
# (.deps/*.deb, from scripts/device_deps.sh) into .deps/root, point pkg-config there, and leave the extra CMake
# arguments in CMAKE_EXTRA (empty when no .debs were carried). Carried CUTLASS headers (.deps/cutlass/include, from
# scripts/fetch_cutlass.sh) add -DCHIMERA_CUTLASS=ON (the MoE experts' CUTLASS path, ExpertsPath::kCutlass).
CMAKE_EXTRA=()
if compgen -G ".deps/*.deb" >/dev/null; then
  D=$PWD/.deps/root
  mkdir -p "$D"
  for f in .deps/*.deb; do dpkg -x "$f" "$D"; done
  for pc in "$D"/usr/lib/x86_64-linux-gnu/pkgconfig/*.pc "$D"/usr/share/pkgconfig/*.pc; do
    sed -i "s|^prefix=/usr\$|prefix=$D/usr|" "$pc"
  done
  if command -v pkg-config >/dev/null; then PKGC=$(command -v pkg-config); else
    mkdir -p .deps/bin
    printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' "$D/usr/lib/x86_64-linux-gnu" "$D/usr/bin/pkgconf" >.deps/bin/pkg-config
    chmod +x .deps/bin/pkg-config
    PKGC=$PWD/.deps/bin/pkg-config
  fi
  # The image's own libcurl, where it has one, so its curl keeps working: the carried one only gives the headers.
  sys_curl=$(ldconfig -p | awk '$1 == "libcurl.so.4" {print $NF; exit}')
  if [ -n "$sys_curl" ]; then
    rm -f "$D"/usr/lib/x86_64-linux-gnu/libcurl.so.4*
    ln -sf "$sys_curl" "$D"/usr/lib/x86_64-linux-gnu/libcurl.so
  fi
  # libcurl's dependencies (.deps/rt/*.deb): only the shared libraries the image has no copy of, so the image's
  # own libraries are never shadowed.
  if compgen -G ".deps/rt/*.deb" >/dev/null; then
    R=$PWD/.deps/rtroot
    mkdir -p "$R"
    for f in .deps/rt/*.deb; do dpkg -x "$f" "$R"; done
    for so in $(find "$R" -name 'lib*.so.*' \( -type f -o -type l \)); do
      ldconfig -p | grep -qE "^[[:space:]]+$(basename "$so") " && rm -f "$so"
    done
    export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$R/usr/lib/x86_64-linux-gnu:$R/lib/x86_64-linux-gnu
  fi
  export PKG_CONFIG_PATH=$D/usr/lib/x86_64-linux-gnu/pkgconfig:$D/usr/share/pkgconfig
  export LD_LIBRARY_PATH=$D/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  CMAKE_EXTRA=(-DCMAKE_PREFIX_PATH="$D/usr" -DPKG_CONFIG_EXECUTABLE="$PKGC")
fi
# CUTLASS travels compressed (.deps/cutlass.tar.gz, ~2 MB against 27 MB of headers; scripts/device_deps.sh makes it):
# unpacked here once.
if [ -f .deps/cutlass.tar.gz ] && [ ! -f .deps/cutlass/include/cutlass/cutlass.h ]; then
  tar xzf .deps/cutlass.tar.gz -C .deps
fi
if [ -f .deps/cutlass/include/cutlass/cutlass.h ] && [ "${CHIMERA_DEVICE_CUTLASS:-1}" != "0" ]; then
  CMAKE_EXTRA+=(-DCHIMERA_CUTLASS=ON)
fi
