#!/usr/bin/env bash
# Downloads (here, on a machine that reaches Debian's registry) the .debs the build needs but the GPU machine's
# image lacks (fmt, CLI11, nlohmann-json, GoogleTest, PCRE2, pkg-config) into .deps/ (git-ignored), to be
# carried to the GPU machine and unpacked there by scripts/device_check.sh; and CUTLASS's headers (PyPI's
# nvidia-cutlass wheel, scripts/fetch_cutlass.sh) into .deps/cutlass/include, with which scripts/device_env.sh turns
# on the CUTLASS MoE path (-DCHIMERA_CUTLASS=ON). CHIMERA_DEVICE_CUTLASS=0 skips the headers.
#
# ModelOpt for scripts/make_modelopt_fixtures.py: the wheels of nvidia-modelopt and of those of its requirements the
# GPU image lacks (its torch 2.11 / transformers 5.17 image has numpy, torch, tqdm, PyYAML, regex, rich, safetensors,
# scipy, requests, ninja, nvidia-ml-py, packaging, setuptools) go to .deps/wheels, for the image's Python 3.12
# (CHIMERA_DEVICE_MODELOPT=0 skips them). On the GPU machine, `scripts/device_deps.sh --install-modelopt [DIR]`
# installs them offline into DIR (default /tmp/modelopt-site) without touching the image's packages; then run the
# script with PYTHONPATH=DIR.
set -euo pipefail
cd "$(dirname "$0")/.."

# Pinned: the versions scripts/make_modelopt_fixtures.py was run with. omegaconf 2.4 no longer needs
# antlr4-python3-runtime; pydantic 2.14 needs typing-extensions >= 4.16, newer than some images carry.
MODELOPT_WHEELS=(nvidia-modelopt==0.47.0 omegaconf==2.4.0 pulp==3.3.2 pydantic==2.14.4 pydantic-core==2.50.5
                 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0)

fetch_modelopt_wheels() {
  mkdir -p .deps/wheels
  local req name
  for req in "${MODELOPT_WHEELS[@]}"; do
    name="${req%%==*}"
    if ls .deps/wheels/"${name//-/_}"-"${req##*==}"-*.whl >/dev/null 2>&1; then continue; fi
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d .deps/wheels "$req"
  done
  ls -l .deps/wheels
}

if [ "${1:-}" = "--install-modelopt" ]; then
  target="${2:-/tmp/modelopt-site}"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" \
    .deps/wheels/*.whl
  PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}" python3 -c 'import modelopt.torch.quantization as q; import modelopt; print("modelopt", modelopt.__version__)'
  echo "installed into $target: run with PYTHONPATH=$target"
  exit 0
fi
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
if [ "${CHIMERA_DEVICE_CUTLASS:-1}" != "0" ]; then
  scripts/fetch_cutlass.sh
  # The compressed copy is what travels to the GPU machine (scripts/device_env.sh unpacks it there).
  tar czf .deps/cutlass.tar.gz -C .deps cutlass
fi
if [ "${CHIMERA_DEVICE_MODELOPT:-1}" != "0" ]; then fetch_modelopt_wheels; fi
ls .deps
