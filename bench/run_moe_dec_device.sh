#!/usr/bin/env bash
# One GPU-machine call for branch moe-dec (issue 4: the MoE decode GEMV path, grouped_gemv.cu): build, the MoE op
# tests on CUDA, memcheck + racecheck on the small GEMV cases, then the expert benchmarks at decode sizes
# (T = 1, 2, 4, 8 at the Nano and Super shapes: op call, and device time in CUDA graphs on the GEMV and mma paths).
# Run from the repository root on the GPU machine: OUT=<dir> bash bench/run_moe_dec_device.sh
# Carried build dependencies: .deps/*.deb as for scripts/device_check.sh. Budget ~480 s on nvidia-h200.
set -uo pipefail
OUT=${OUT:-/tmp/moe_dec_out}
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

FILTER='OpsMoe*'
timeout "$(left 260)" ./b/chimera_tests --gtest_filter="$FILTER" >"$OUT/tests.log" 2>&1
echo "tests rc=$?"
grep -E "^\[  (FAILED|PASSED) +\]|^\[==========\]|^\[  FAILED  \]|^\[       OK \] OpsMoe.*Cuda" "$OUT/tests.log" | head -40
grep -E -B2 -A10 "Failure|exception|what\(\)" "$OUT/tests.log" | cut -c1-300 | head -80
el tested

# The GEMV kernel is new (shared-memory staging, a barrier with early-exiting warps): memcheck and racecheck on
# the small shapes (the GEMV forced at T = 1..40, and T = 1, 3 of the tensor-core test through the automatic path).
SMALL='OpsMoe.GemvPathMatchesTheCpuReference/Cuda:OpsMoe.GemvPathSharedAndRepeatedExperts/Cuda'
for tool in memcheck racecheck; do
  if [ "$(left 340)" -gt 15 ]; then
    timeout "$(left 340)" compute-sanitizer --tool $tool ./b/chimera_tests --gtest_filter="$SMALL" \
      >"$OUT/$tool.log" 2>&1
    echo "$tool rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/$tool.log" | tail -1) $(grep -c 'OK \]' "$OUT/$tool.log") ok"
  fi
done
el sanitized

# Experts at decode sizes (op call + graph per path + gemv-vs-mma check), then T = 1 / 64 / 1024 as before.
timeout "$(left 470)" ./b/chimera_bench moe_experts_decode moe_experts_nano moe_experts_super >"$OUT/bench.log" 2>&1
echo "bench rc=$?"
el benched
grep -h -E "^CHECK|^INFO|ERROR" "$OUT/bench.log" | head -40
grep -h -E "^BENCH" "$OUT/bench.log" |
  sed -E 's/BENCH kernel=([^ ]*) shape=(.*) us=([^ ]*) gbps=([^ ]*) tflops=[^ ]* floor_ratio=([^ ]*)/\1 | \2 | \3 | \4 | \5/'
