#!/usr/bin/env bash
# Fetches CUTLASS's C++ headers (for the optional sm90 grouped expert GEMM, cmake -DCHIMERA_CUTLASS=ON) into
# .deps/cutlass/include (git-ignored), for building here and for carrying to the GPU machine, which reaches no
# registry. PyPI's nvidia-cutlass wheel ships the headers under cutlass_library/source/include (cute/ and cutlass/,
# ~27 MB); only that folder is unpacked (tools/util/include is not needed: the kernel uses no host utilities).
# Idempotent: does nothing when the pinned version is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VERSION=4.2.0.0  # CUTLASS 4.2.0; compiled with nvcc 13.0 for sm_90a (docs/moe_cuda.md)
DEST=.deps/cutlass
if [ "$(cat "$DEST/VERSION" 2>/dev/null)" = "$VERSION" ] && [ -f "$DEST/include/cutlass/cutlass.h" ]; then
  echo "fetch_cutlass: nvidia-cutlass $VERSION already in $DEST/include"
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# pip from a throw-away venv where the system Python has none (Debian's python3 without python3-pip).
if ! "$PY" -m pip --version >/dev/null 2>&1; then
  "$PY" -m venv "$tmp/venv"
  PY="$tmp/venv/bin/python"
fi
"$PY" -m pip download -q --no-deps --only-binary=:all: "nvidia-cutlass==$VERSION" -d "$tmp"
rm -rf "$DEST"
mkdir -p "$DEST"
"$PY" - "$tmp" "$DEST/include" <<'PYEOF'
import glob, os, sys, zipfile
prefix = "cutlass_library/source/include/"
(wheel,) = glob.glob(os.path.join(sys.argv[1], "nvidia_cutlass-*.whl"))
n = 0
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if name.startswith(prefix) and not name.endswith("/"):
            dst = os.path.join(sys.argv[2], name[len(prefix):])
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            with z.open(name) as src, open(dst, "wb") as out:
                out.write(src.read())
            n += 1
print(f"fetch_cutlass: {n} headers from {os.path.basename(wheel)}")
PYEOF
echo "$VERSION" >"$DEST/VERSION"
echo "fetch_cutlass: nvidia-cutlass $VERSION in $DEST/include ($(du -sh "$DEST/include" | cut -f1))"
