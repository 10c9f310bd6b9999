#!/usr/bin/env bash
# One GPU-machine call for the fused AllReduce on 2 GPUs: the AllReduce tests, the sweep that writes the
# SM90 lookup table, the C++ latency bench and the PyTorch peers, logs (and the table) in $OUT. Builds nothing:
# build first, in the same call, e.g.
#   NINJA_TARGETS="chimera_tests chimera_bench" scripts/device_check.sh none && OUT=$OUT bash bench/run_allreduce_device.sh
# Budget < 10 minutes: tests <= 200 s, ONESHOT with / without PDL <= 60 s, sweep <= 240 s (about 1,000 entries since the
# table is keyed by the measured sizes), bench <= 60 s, peers <= 75 s (each bounded by `timeout`; a step that
# runs out of time is logged and the next one still runs).
# Results: $OUT/allreduce_tests.log, allreduce_sweep.log, sm90_allreduce_table.inc (copy it over
# src/dist/sm90_allreduce_table.inc to commit the measured table), allreduce_bench.log, allreduce_peers.log,
# allreduce_summary.txt (the lines worth reading, also printed at the end).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/allreduce_out}
BUILD=${BUILD:-build-dev}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
T0=$(date +%s)
el() { echo "[$(($(date +%s) - T0))s] $*"; }
source scripts/device_env.sh  # the carried .debs' libraries on LD_LIBRARY_PATH (as the build saw them)

for bin in chimera_tests chimera_bench; do
  [ -x "$BUILD/$bin" ] || { echo "run_allreduce_device: $BUILD/$bin missing: build it first (see the header)"; exit 1; }
done
nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,memory.used --format=csv,noheader | tee "$OUT/device.txt"
nvidia-smi topo -m 2>/dev/null | head -4 | tee -a "$OUT/device.txt"
git rev-parse --short=12 HEAD 2>/dev/null | tee -a "$OUT/device.txt"

# 1. Tests: the 2-GPU AllReduce suite and the CPU tests of the index arithmetic and the table.
el "tests"
FILTER='AllReduceTwoGpu.*:RanksTest*:LamportRotation.*:Barrier.*:Grid.*:LookupKeys.*:Sm90Table.*:Strategy.*'
timeout 200 "./$BUILD/chimera_tests" --gtest_filter="$FILTER" >"$OUT/allreduce_tests.log" 2>&1
echo "tests rc=$? (124: timed out)"
el "tests done"

# 2. The ONESHOT kernel with and without PDL.
el "oneshot pdl"
timeout 60 "./$BUILD/chimera_bench" allreduce_oneshot >"$OUT/allreduce_oneshot.log" 2>&1
echo "oneshot pdl rc=$?"

# 3. Sweep -> table (the tool runs chimera_bench allreduce_sweep and writes the .inc).
el "sweep"
timeout 240 python3 scripts/make_allreduce_table.py --bench "./$BUILD/chimera_bench" --timeout 235 \
  --log "$OUT/allreduce_sweep.log" --out "$OUT/sm90_allreduce_table.inc"
echo "sweep rc=$?"
el "sweep done"

# 4. The latency table (ONESHOT, TWOSHOT, NCCL + norm, AUTO, NCCL alone).
el "bench"
timeout 60 "./$BUILD/chimera_bench" allreduce_latency >"$OUT/allreduce_bench.log" 2>&1
echo "bench rc=$?"
el "bench done"

# 5. The peers (torch NCCL, NCCL + eager norm, symmetric-memory one-shot / two-shot).
el "peers"
timeout 75 python3 bench/peers/allreduce_peers.py >"$OUT/allreduce_peers.log" 2>&1
echo "peers rc=$?"
el "peers done"

{
  echo "== tests"
  grep -E "^\[  (FAILED|PASSED|SKIPPED) +\]|^\[==========\]|allreduce grid:|10000 calls:|OK \] AllReduceTwoGpu" \
    "$OUT/allreduce_tests.log" | head -40
  grep -E -A8 "Failure" "$OUT/allreduce_tests.log" | cut -c1-300 | head -60
  echo "== oneshot pdl"
  grep -E "^TABLE|ERROR|SKIP|PDL" "$OUT/allreduce_oneshot.log"
  echo "== sweep"
  grep -c '^SWEEP' "$OUT/allreduce_sweep.log" 2>/dev/null | sed 's/^/sweep lines: /'
  grep -E "ERROR|error" "$OUT/allreduce_sweep.log" 2>/dev/null | head -5
  grep -E '^// (status|device|date)' "$OUT/sm90_allreduce_table.inc" 2>/dev/null
  echo "== bench"
  grep -E "^TABLE|ERROR|SKIP|lookup table" "$OUT/allreduce_bench.log"
  echo "== peers (us)"
  grep -E "^allreduce_peers|ERROR|SKIP" "$OUT/allreduce_peers.log" | cut -c1-200 | head -8
  grep -E "^BENCH" "$OUT/allreduce_peers.log" |
    sed -E 's/BENCH kernel=allreduce_([^ ]*) shape=([^ ]*) us=([^ ]*) .*took=([^ ]*)/\2 \1 \3 \4/' | sort -V
} | tee "$OUT/allreduce_summary.txt"
el "all done"
