#!/usr/bin/env bash
# One GPU-machine call for the decode-step fusions (branch decode-fuse: ops::router_gate_topk, ops::add2_rms_norm).
# Run from the repository root:  OUT=<dir> bash bench/run_fuse_device.sh [build] [tests] [sanitize] [bench] [engine]
#   build     cmake + ninja chimera_cli chimera_tests chimera_bench (${BUILD:-build-dev}, as scripts/device_check.sh)
#   tests     the new and touched op tests on CUDA and CPU, the model / engine / graph tests (bf16 graph vs eager,
#             fp32 vs the fixtures, bf16 vs transformers) and the profiler census
#   sanitize  compute-sanitizer memcheck + racecheck over the two new ops' CUDA tests
#   bench     chimera_bench moe_router_gate add2_rms_norm (fused vs replaced launches, CUDA-graph device time;
#             CHECK lines: warp- vs block-selection identical, fused vs three-op routing)
#   engine    chimera bench on Nano: 1K prefill, decode at batch 1, 8, 64 (issue 4: batch 1 >= 60 % of roofline;
#             docs/perf.md before this branch: 3.445 ms, 44.7 %)
# Every step prints a line starting with "== " with its elapsed time; logs in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fuse_out}
BUILD=${BUILD:-build-dev}
mkdir -p "$OUT"
T0=$(date +%s)
el() { echo "== [$(($(date +%s) - T0))s] $*"; }
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(build tests sanitize bench engine)
want() { for s in "${steps[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }
export NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
git rev-parse --short HEAD 2>/dev/null
rc=0
TESTS='*OpsRouterGate*:*OpsRouter.*:*OpsMoe*:*OpsNorm*:*ProfilerTest*:*GpuParity*:*GpuStateCache*:*TransformersParity*:*Synthetic*'

if want build; then
  [ -f scripts/device_env.sh ] && source scripts/device_env.sh  # carried .debs -> CMAKE_EXTRA
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCHIMERA_CUDA=ON "${CMAKE_EXTRA[@]}" \
    >"$OUT/cmake.log" 2>&1 || { tail -40 "$OUT/cmake.log"; exit 1; }
  ninja -C "$BUILD" -j "$(nproc)" chimera_cli chimera_tests chimera_bench >"$OUT/build.log" 2>&1 ||
    { grep -E -A15 "error|FAILED" "$OUT/build.log" | head -120; exit 1; }
  el built
fi

if want tests; then
  ./"$BUILD"/chimera_tests --gtest_filter="$TESTS" >"$OUT/tests.log" 2>&1 || rc=1
  grep -E "^\[  (FAILED|PASSED) +\]|^\[==========\]|near-ties|\[ gpu" "$OUT/tests.log" | head -60
  grep -E -B2 -A12 "Failure|exception|what\(\)" "$OUT/tests.log" | cut -c1-300 | head -80
  el "tests rc=$rc"
fi

if want sanitize; then
  for tool in memcheck racecheck; do
    compute-sanitizer --tool "$tool" --error-exitcode 9 ./"$BUILD"/chimera_tests --gtest_brief=1 \
      --gtest_filter='*OpsRouterGate*/Cuda:*OpsNorm.Add2*/Cuda' >"$OUT/sanitize-$tool.log" 2>&1 || rc=1
    grep -E "ERROR SUMMARY|PASSED|FAILED" "$OUT/sanitize-$tool.log" | head -6
    el "compute-sanitizer $tool"
  done
fi

if want bench; then
  ./"$BUILD"/chimera_bench moe_router_gate add2_rms_norm moe_router_nano >"$OUT/bench.log" 2>&1 || rc=1
  grep -E "^(BENCH|CHECK|INFO)" "$OUT/bench.log" | grep -E -- "-graph|CHECK|INFO" | cut -c1-220
  el "bench"
fi

if want engine; then
  timeout 480 ./"$BUILD"/chimera bench --synthetic nemotron-3-nano-30b-a3b --device cuda --input-lens 1024 \
    --batch-sizes 1,8,64 --json-out "$OUT/engine_nano.json" >"$OUT/engine.log" 2>&1 || rc=1
  cat "$OUT/engine.log"
  el "engine"
fi
exit $rc
