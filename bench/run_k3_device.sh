#!/usr/bin/env bash
# One GPU-machine call for the issue-3 speed bars of branch k3: router (block-per-token kernel), add + RMSNorm
# (all loads before the first store), conv1d and the selective state update (device time in CUDA graphs).
# Build, the op tests on CUDA, memcheck + racecheck on the router's new kernel, then chimera_bench.
# Run from the repository root on the GPU machine: OUT=<dir> bash bench/run_k3_device.sh
# Carried build dependencies: .deps/*.deb as for scripts/device_check.sh. Budget ~420 s on nvidia-h200.
set -uo pipefail
OUT=${OUT:-/tmp/k3_out}
mkdir -p "$OUT"
T0=$(date +%s)
el() { echo "[$(($(date +%s) - T0))s] $*"; }
left() { echo $(($1 - ($(date +%s) - T0))); }

source scripts/device_env.sh  # carried .debs -> CMAKE_EXTRA
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used,temperature.gpu --format=csv,noheader

cmake -S . -B b -G Ninja -DCHIMERA_CUDA=ON -DCMAKE_BUILD_TYPE=Release "${CMAKE_EXTRA[@]}" >"$OUT/cmake.log" 2>&1 ||
  { tail -40 "$OUT/cmake.log"; exit 1; }
ninja -C b -j16 chimera_tests chimera_bench >"$OUT/build.log" 2>&1 ||
  { grep -E -A15 "error|FAILED" "$OUT/build.log" | head -120; exit 1; }
el built

FILTER='OpsRouter*:OpsNorm*:OpsConv1d*:OpsSelectiveStateUpdate*'
timeout "$(left 240)" ./b/chimera_tests --gtest_filter="$FILTER" >"$OUT/tests.log" 2>&1
echo "tests rc=$?"
grep -E "^\[  (FAILED|PASSED) +\]|^\[==========\]|^\[  FAILED  \]" "$OUT/tests.log" | head -30
grep -E -B2 -A10 "Failure|exception|what\(\)" "$OUT/tests.log" | cut -c1-300 | head -80
el tested

# The router's block kernel is new (barrier counts, shared-memory atomics): memcheck and racecheck on it.
RSMALL='OpsRouter.ExactTiesGoToLowerIndex/Cuda:OpsRouter.RandomLogitsMatchNaive/Cuda:OpsRouter.BiasOnlyAffectsSelection/Cuda'
NSMALL='OpsNorm.AddRmsNormUpdatesResidual/Cuda:OpsNorm.RmsNormInPlace/Cuda'
for tool in memcheck racecheck; do
  if [ "$(left 300)" -gt 15 ]; then
    timeout "$(left 300)" compute-sanitizer --tool $tool ./b/chimera_tests --gtest_filter="$RSMALL:$NSMALL" \
      >"$OUT/$tool.log" 2>&1
    echo "$tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/$tool.log" | tail -1) $(grep -c 'OK \]' "$OUT/$tool.log") ok"
  fi
done
el sanitized

# Router (ops call + graph, both kernels, identical-output check), add + RMSNorm, conv1d, SSU.
timeout "$(left 415)" ./b/chimera_bench moe_router add_rms_norm mamba_conv1d mamba_ssu >"$OUT/bench.log" 2>&1
echo "bench rc=$?"
el benched
grep -h -E "^CHECK|ERROR" "$OUT/bench.log" | head -20
grep -h -E "^BENCH" "$OUT/bench.log" |
  sed -E 's/BENCH kernel=([^ ]*) shape=(.*) us=([^ ]*) gbps=[^ ]* tflops=[^ ]* floor_ratio=([^ ]*)/\1 | \2 | \3 | \4/' |
  sed -E -e 's/_P64_N128_G8//' -e 's/_act-bf16//' -e 's/super_C10240_K4_/C10240_/'
