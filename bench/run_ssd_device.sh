#!/usr/bin/env bash
# One GPU-machine call for the SSD prefill kernels: build, the SSD op tests on CUDA, memcheck on two small
# cases, chimera_bench ssd (whole op and stage by stage) and the peers (bench/peers/ssd_peers.py) on the same
# shapes. The peers warm up (Triton autotuning, torch.compile) during the C++ build and are timed alone at the
# end. Run from the repository root on the GPU machine: OUT=<dir> bash bench/run_ssd_device.sh [budget_s]
# Build dependencies missing from the GPU image may be carried as Debian packages in .deps/*.deb (unpacked
# into .deps/root): libfmt-dev libfmt9 libgtest-dev libcli11-dev nlohmann-json3-dev libpcre2-dev libpcre2-8-0
# pkgconf pkgconf-bin libpkgconf3 (`apt-get download ...` on a Debian 12 machine).
set -uo pipefail
OUT=${OUT:-/tmp/ssd_out}
mkdir -p "$OUT"
BUDGET=${1:-190}
T0=$(date +%s)
el() { echo "[$(($(date +%s) - T0))s] $*"; }
left() { echo $(($1 - ($(date +%s) - T0))); }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1

source scripts/device_env.sh  # carried .debs -> CMAKE_EXTRA
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used,temperature.gpu --format=csv,noheader

READY=/tmp/ssd_peers_ready GO=/tmp/ssd_peers_go STOP=/tmp/ssd_peers_stop
rm -f "$READY" "$GO" "$STOP"
PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=4 timeout "$(left $((BUDGET - 2)))" \
  python3 bench/peers/ssd_peers.py --ready "$READY" --go "$GO" --stop "$STOP" --budget $((BUDGET - 8)) >"$OUT/peers.log" 2>&1 &
PEERS=$!

cmake -S . -B b -G Ninja -DCHIMERA_CUDA=ON -DCMAKE_BUILD_TYPE=Release "${CMAKE_EXTRA[@]}" >"$OUT/cmake.log" 2>&1 ||
  { tail -40 "$OUT/cmake.log"; exit 1; }
ninja -C b -j16 chimera_tests chimera_bench >"$OUT/build.log" 2>&1 ||
  { grep -E -A15 "error|FAILED" "$OUT/build.log" | head -120; exit 1; }
el built

timeout "$(left $((BUDGET - 60)))" ./b/chimera_tests --gtest_filter='OpsSsd*' >"$OUT/tests.log" 2>&1
echo "tests rc=$?"
grep -E "^\[  (FAILED|PASSED) +\]|^\[==========\]" "$OUT/tests.log" | head -20
grep -E -B2 -A12 "Failure|exception|what\(\)" "$OUT/tests.log" | cut -c1-300 | head -90
echo "CUDA OK: $(grep -E 'OK \] .*/Cuda' "$OUT/tests.log" | sed -E 's/.*\] OpsSsd\.([^ ]*)\/Cuda \(([0-9]+) ms\)/\1(\2ms)/' | tr '\n' ' ')"
el tested

SMALL='OpsSsd.CudaSixteenBitStatesActivationsAndParams/Cuda:OpsSsd.CudaPackedBatchSuperchunks/Cuda'
SMALL+=':OpsSsd.CudaRecurrenceSixteenBit/Cuda:OpsSsd.ChunkScanMatchesRecurrence/Cuda:OpsSsd.CudaGroupCbSmall/Cuda'
SMALL+=':OpsSsd.CudaSplitScanSmall/Cuda'
if [ "$(left $((BUDGET - 85)))" -gt 10 ]; then
  timeout "$(left $((BUDGET - 85)))" compute-sanitizer --tool memcheck ./b/chimera_tests --gtest_filter="$SMALL" \
    >"$OUT/memcheck.log" 2>&1
  echo "memcheck rc=$? $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log" | tail -1) $(grep -c 'OK \]' "$OUT/memcheck.log") ok"
  grep -E -m5 "Invalid|out of bounds|Address| at " "$OUT/memcheck.log" | cut -c1-200
fi
el memchecked
RACE='OpsSsd.CudaSixteenBitStatesActivationsAndParams/Cuda:OpsSsd.DtLimitsClampBothPaths/Cuda:OpsSsd.CudaGroupCbSmall/Cuda'
RACE+=':OpsSsd.CudaSplitScanSmall/Cuda'
if [ "$(left $((BUDGET - 68)))" -gt 10 ]; then
  timeout "$(left $((BUDGET - 68)))" compute-sanitizer --tool racecheck ./b/chimera_tests --gtest_filter="$RACE" \
    >"$OUT/racecheck.log" 2>&1
  echo "racecheck rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/racecheck.log" | tail -2 | tr '\n' ' ') $(grep -c 'OK \]' "$OUT/racecheck.log") ok"
  grep -E -m5 "hazard|Race| at " "$OUT/racecheck.log" | cut -c1-200
fi
el racechecked

touch "$STOP"
while [ ! -e "$READY" ] && kill -0 "$PEERS" 2>/dev/null && [ "$(left $((BUDGET - 60)))" -gt 0 ]; do sleep 0.5; done
el "peers warm: $([ -e "$READY" ] && echo yes || echo no)"
timeout "$(left $((BUDGET - 18)))" ./b/chimera_bench ssd >"$OUT/bench.log" 2>&1
echo "bench rc=$?"
el benched
touch "$GO"
wait "$PEERS"
echo "peers rc=$?"
el peers
grep -h -E "^peers:|^CHECK|ERROR|Error" "$OUT/peers.log" "$OUT/bench.log" | cut -c1-260 | head -24
# Compact table: kernel shape us tflops ratio
grep -h -E "^BENCH" "$OUT/bench.log" "$OUT/peers.log" |
  sed -E 's/BENCH kernel=([^ ]*) shape=(.*) us=([^ ]*) gbps=([^ ]*) tflops=([^ ]*) floor_ratio=([^ ]*)/\1 | \2 | \3 us | \4 GB\/s | \5 TF | \6/' |
  sed -E -e 's/ P=64 N=128 G=8 Q=128 bf16//' -e 's/ssd_chunk_scan-//' -e 's/ssd_stage-//'
