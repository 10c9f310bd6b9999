#!/usr/bin/env bash
# Fetches the peer kernels the benchmarks compare against into .peers/ (git-ignored), for carrying to the
# GPU machine (which reaches no registry):
#   .peers/mamba_ssm   mamba_ssm's Triton kernels from its PyPI source distribution. Only the Python package
#                      is kept and its __init__.py emptied: the Triton kernels need none of its CUDA extensions.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
mkdir -p .peers
if [ ! -d .peers/mamba_ssm ]; then
  tmp=$(mktemp -d)
  # `pip download` would build the sdist's metadata, which imports torch: take the sdist file from PyPI's JSON
  # API instead (the same registry pip uses).
  "$PY" - "$tmp" <<'PYEOF'
import json, sys, urllib.request
meta = json.load(urllib.request.urlopen("https://pypi.org/pypi/mamba-ssm/json", timeout=60))
sdist = next(f for f in meta["urls"] if f["packagetype"] == "sdist")
urllib.request.urlretrieve(sdist["url"], f"{sys.argv[1]}/{sdist['filename']}")
PYEOF
  tar -xzf "$tmp"/mamba_ssm-*.tar.gz -C "$tmp"
  src=$(find "$tmp" -maxdepth 2 -type d -name mamba_ssm | head -n 1)
  cp -r "$src" .peers/mamba_ssm
  : > .peers/mamba_ssm/__init__.py
  ls "$tmp"/mamba_ssm-*.tar.gz | sed 's|.*/||' > .peers/mamba_ssm/SOURCE
  rm -rf "$tmp"
fi
echo "fetch_peers: $(cat .peers/mamba_ssm/SOURCE) in .peers/"
