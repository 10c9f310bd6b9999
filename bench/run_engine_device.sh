#!/usr/bin/env bash
# One GPU-machine call for the engine's side measurements (profiler, transformers engine peer, bf16 fixtures).
# Run from the repository root on the GPU machine:
#   OUT=<dir> bash bench/run_engine_device.sh [steps...]     steps: build tests fixtures profile peer (default all)
#   build     cmake + ninja chimera_cli chimera_tests (build dir ${BUILD:-build-dev}, as scripts/device_check.sh)
#   tests     the profiler test on CUDA and every GpuParity test
#   fixtures  scripts/make_fixtures.py --bf16-logits-only $OUT/bf16 (transformers bf16 on the GPU), copies the
#             files into tests/fixtures/models/<name>/ of this tree, re-runs the bf16-vs-transformers test;
#             bring $OUT/bf16/* back and install them the same way (the script prints the cp commands)
#   profile   chimera bench --profile on the Nano shape: 1K prefill, decode at batch 1, 8, 64
#   peer      bench/peers/engine_peers.py (transformers generate, same config) for Nano, then the 8B shape
# Logs go to $OUT (tests.log, fixtures.log, profile.log + profile_nano.json, peer_*.log + peer_*.json); every
# step prints a line starting with "== " and its elapsed time.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/engine_out}
BUILD=${BUILD:-build-dev}
mkdir -p "$OUT"
T0=$(date +%s)
el() { echo "== [$(($(date +%s) - T0))s] $*"; }
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(all)
want() { for s in "${steps[@]}"; do [ "$s" = "$1" ] || [ "$s" = all ] && return 0; done; return 1; }
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
rc=0

if want build; then
  source scripts/device_env.sh  # carried .debs -> CMAKE_EXTRA
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCHIMERA_CUDA=ON "${CMAKE_EXTRA[@]}" \
    >"$OUT/cmake.log" 2>&1 || { tail -40 "$OUT/cmake.log"; exit 1; }
  ninja -C "$BUILD" -j "$(nproc)" chimera_cli chimera_tests >"$OUT/build.log" 2>&1 ||
    { grep -E -A15 "error|FAILED" "$OUT/build.log" | head -120; exit 1; }
  el built
fi

if want tests; then
  ./"$BUILD"/chimera_tests --gtest_filter='*Profiler*:*GpuParity*' >"$OUT/tests.log" 2>&1 || rc=1
  grep -E "^\[  (FAILED|PASSED|SKIPPED) +\]|^\[==========\]|\[ (CUDA|gpu)" "$OUT/tests.log" | head -40
  grep -E -B2 -A12 "Failure|exception|what\(\)" "$OUT/tests.log" | cut -c1-300 | head -60
  sed -n '/\[ CUDA \]/,/TinyModelPrefillAndDecodeStepsByOpKind\/Cuda/p' "$OUT/tests.log" | head -60
  el "tests rc=$rc"
fi

if want fixtures; then
  python3 scripts/make_fixtures.py --bf16-logits-only "$OUT/bf16" --device cuda 2>&1 | grep -v "Loading weights" \
    | tee "$OUT/fixtures.log" | tail -12
  for d in tests/fixtures/models/*/; do
    n=$(basename "$d")
    for f in "$OUT/bf16/$n".logits_bf16_*.npy "$OUT/bf16/$n".expected_bf16.json; do
      [ -f "$f" ] && cp "$f" "$d/${f##*/$n.}"
    done
  done
  ./"$BUILD"/chimera_tests --gtest_filter='*Bf16TeacherForcedMatchesTransformersBf16*' >"$OUT/tests_bf16.log" 2>&1 || rc=1
  grep -E "^\[  (FAILED|PASSED|SKIPPED) +\]|\[ gpu bf16 \]|Failure|bound" "$OUT/tests_bf16.log" | cut -c1-300 | head -60
  el "fixtures (bf16 files in $OUT/bf16, rc=$rc)"
fi

if want profile; then
  timeout 420 ./"$BUILD"/chimera bench --synthetic nemotron-3-nano-30b-a3b --device cuda --input-lens 1024 \
    --batch-sizes 1,8,64 --decode-steps 16 --profile --json-out "$OUT/profile_nano.json" >"$OUT/profile.log" 2>&1 || rc=1
  cat "$OUT/profile.log"
  el "profile"
fi

if want peer; then
  for preset in nemotron-3-nano-30b-a3b nemotron-h-8b; do
    PEER_TIME_LIMIT_S=${PEER_TIME_LIMIT_S:-240} timeout 300 python3 bench/peers/engine_peers.py --preset "$preset" \
      --chimera "./$BUILD/chimera" --json-out "$OUT/peer_$preset.json" 2>&1 | grep -v "^\[transformers\]" \
      | tee "$OUT/peer_$preset.log"
    el "peer $preset"
  done
fi
exit $rc
