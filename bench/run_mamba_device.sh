#!/usr/bin/env bash
# One GPU-machine call for the Mamba kernels (conv1d, selective state update): build, the op tests on CUDA,
# memcheck on the small cases, chimera_bench, and the peers (bench/peers/mamba_peers.py) on the same shapes.
# Run from the repository root on the GPU machine: OUT=<dir> bash bench/run_mamba_device.sh
# Build dependencies missing from the GPU image may be carried as Debian packages in .deps/*.deb (unpacked
# into .deps/root). The peers compile (torch.compile, Triton) in the background during the C++ build and are
# timed alone afterwards. Budget: ~190 s; every step is bounded and logs to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/mamba_out}
mkdir -p "$OUT"
T0=$(date +%s)
el() { echo "[$(($(date +%s) - T0))s] $*"; }
left() { echo $(($1 - ($(date +%s) - T0))); }

source scripts/device_env.sh  # carried .debs -> CMAKE_EXTRA
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used,temperature.gpu --format=csv,noheader

READY=/tmp/mamba_peers_ready GO=/tmp/mamba_peers_go
rm -f "$READY" "$GO"
PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=4 timeout "$(left 190)" \
  python3 bench/peers/mamba_peers.py --ready "$READY" --go "$GO" >"$OUT/peers.log" 2>&1 &
PEERS=$!

cmake -S . -B b -G Ninja -DCHIMERA_CUDA=ON -DCMAKE_BUILD_TYPE=Release "${CMAKE_EXTRA[@]}" >"$OUT/cmake.log" 2>&1 ||
  { tail -40 "$OUT/cmake.log"; exit 1; }
ninja -C b -j16 chimera_tests chimera_bench >"$OUT/build.log" 2>&1 ||
  { grep -E -A15 "error|FAILED" "$OUT/build.log" | head -120; exit 1; }
el built

timeout "$(left 110)" ./b/chimera_tests --gtest_filter='OpsConv1d*:OpsSelectiveStateUpdate*:DeviceApi*' \
  >"$OUT/tests.log" 2>&1
echo "tests rc=$?"
grep -E "^\[  (FAILED|PASSED) +\]|^\[==========\]" "$OUT/tests.log" | head -20
grep -E -B2 -A10 "Failure|exception|what\(\)" "$OUT/tests.log" | cut -c1-300 | head -100
echo "CUDA OK: $(grep -E 'OK \] .*/Cuda' "$OUT/tests.log" | sed -E 's/.*\] ([^ ]*)\/Cuda \(([0-9]+) ms\)/\1(\2ms)/' | tr '\n' ' ')"
el tested

SMALL='OpsConv1d.PackedBatchWithSlotsMatchesNaive/Cuda:OpsConv1d.UnalignedViewsMatchNaive/Cuda'
SMALL+=':OpsConv1d.UpdateEqualsOneTokenConv/Cuda:OpsConv1d.SplitInTwoCallsEqualsOneCall/Cuda:OpsConv1d.NoBiasMatchesNaive/Cuda'
SMALL+=':OpsConv1d.UpdateBatchesMatchNaive/Cuda'
SMALL+=':OpsSelectiveStateUpdate.OddShapesMatchNaive/Cuda:OpsSelectiveStateUpdate.MisalignedStateViewMatchesNaive/Cuda'
SMALL+=':OpsSelectiveStateUpdate.EveryRowTilingGivesTheSameBits/Cuda'
if [ "$(left 120)" -gt 10 ]; then
  timeout "$(left 120)" compute-sanitizer --tool memcheck ./b/chimera_tests --gtest_filter="$SMALL" \
    >"$OUT/memcheck.log" 2>&1
  echo "memcheck rc=$? $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log") $(grep -c 'OK \]' "$OUT/memcheck.log") ok"
fi
el memchecked

while [ ! -e "$READY" ] && kill -0 "$PEERS" 2>/dev/null && [ "$(left 140)" -gt 0 ]; do sleep 0.5; done
el "peers warm: $([ -e "$READY" ] && echo yes || echo no)"
timeout "$(left 165)" ./b/chimera_bench mamba >"$OUT/bench.log" 2>&1
echo "bench rc=$?"
el benched
touch "$GO"
wait "$PEERS"
echo "peers rc=$?"
el peers
grep -h -E "peers:|ERROR" "$OUT/peers.log" "$OUT/bench.log" | cut -c1-200 | head -12
# Compact table: kernel shape us ratio
grep -h -E "^BENCH" "$OUT/bench.log" "$OUT/peers.log" |
  sed -E 's/BENCH kernel=([^ ]*) shape=([^ ]*) us=([^ ]*) gbps=[^ ]* tflops=[^ ]* floor_ratio=([^ ]*)/\1 \2 \3 \4/' |
  sed -E -e 's/_P64_N128_G8//' -e 's/_act-bf16//' -e 's/super_C10240_K4_/C10240_/' -e 's/-torch-/-t-/'
