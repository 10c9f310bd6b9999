#!/usr/bin/env bash
# Builds the libFuzzer harnesses (fuzz/<name>_fuzz.cpp) with clang, ASan and UBSan in build-fuzz/ (CPU-only
# library) and runs each for SECONDS (default 60) from its seed corpus fuzz/corpus/<name>/, one after another.
#   scripts/fuzz.sh [SECONDS] [HARNESS...]      HARNESS: e.g. tokenizer_codec (default: every fuzz/*_fuzz.cpp)
# New inputs go to build-fuzz/corpus/<name>/ (the tree's seeds are only read); a finding (crash, leak, timeout,
# out-of-memory, a failed property) is saved as build-fuzz/findings/<name>/<kind>-<sha1> and makes the script
# exit 1 after the remaining harnesses ran. Each harness prints one summary line:
#   fuzz: NAME executions N in S s (R/s, P processes), findings F
# Per-harness libFuzzer flags (e.g. -max_len) are read from fuzz/<name>.options when it exists: one flag a line,
# '#' starts a comment. FUZZ_RUNS=N also stops each harness after N executions (whichever of SECONDS and N
# comes first).
# FUZZ_TIMEOUT=S makes S seconds of one input a hang (default 10; a long campaign at nice 19 on a busy machine
# needs more, as the limit is wall-clock time and a starved process can sit for seconds between two steps).
# FUZZ_NO_BUILD=1 skips configuring and building (binaries already in build-fuzz/); FUZZ_BUILD_DIR moves it.
# FUZZ_JOBS=N runs N processes of each harness at once (seeds 1..N, each with its own log fuzz_NAME.J.log), sharing
# its corpus directory (libFuzzer rereads it, so one process's new inputs reach the others); FUZZ_RUNS then applies
# to each process, and the summary line sums their executions. Default 1: one process, logged as fuzz_NAME.log.
# FUZZ_SEED_BASE=B gives process j the seed B + j (default 0), so campaigns on two machines do not start alike.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-60}
if [ "$#" -gt 0 ]; then shift; fi
build=${FUZZ_BUILD_DIR:-build-fuzz}

names=("$@")
if [ "${#names[@]}" -eq 0 ]; then
  for f in fuzz/*_fuzz.cpp; do n=$(basename "$f" .cpp); names+=("${n%_fuzz}"); done
fi
if [ "${FUZZ_NO_BUILD:-0}" != "1" ]; then
  if ! command -v clang++ >/dev/null 2>&1; then
    echo "fuzz: clang++ not found (scripts/setup.sh installs clang and libclang-rt-dev)" >&2
    exit 1
  fi
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCHIMERA_CUDA=OFF -DCHIMERA_FUZZ=ON \
        -DCHIMERA_BUILD_TESTS=OFF -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_C_COMPILER=clang >/dev/null
  targets=()
  for n in "${names[@]}"; do targets+=("${n}_fuzz"); done
  ninja -C "$build" ${NINJA_JOBS:+-j "$NINJA_JOBS"} "${targets[@]}"
fi

status=0
for n in "${names[@]}"; do
  bin="$build/fuzz/${n}_fuzz"
  seeds="fuzz/corpus/$n"
  work="$build/corpus/$n"
  findings="$build/findings/$n"
  mkdir -p "$work" "$findings"
  [ -d "$seeds" ] || seeds=""
  log="$build/fuzz_$n.log"
  opts=()
  if [ -f "fuzz/$n.options" ]; then
    while read -r flag _; do
      case "$flag" in ''|'#'*) ;; *) opts+=("$flag") ;; esac
    done < <(sed 's/#.*//' "fuzz/$n.options")
  fi
  if [ -n "${FUZZ_RUNS:-}" ]; then opts+=("-runs=$FUZZ_RUNS"); fi
  jobs=${FUZZ_JOBS:-1}
  start=$(date +%s)
  # -timeout: one input running FUZZ_TIMEOUT s is a finding (a hang); -rss_limit_mb: so is a 2 GiB allocation.
  # -fork is not used: whole processes, so each one's final statistics count every execution it made.
  run_one() {  # run_one LOG [FLAG...]
    local out=$1
    shift
    "$bin" -max_total_time="$secs" -timeout="${FUZZ_TIMEOUT:-10}" -rss_limit_mb=2048 -print_final_stats=1 \
           -artifact_prefix="$findings/" ${opts[@]+"${opts[@]}"} "$@" "$work" ${seeds:+"$seeds"} >"$out" 2>&1
  }
  set +e
  rc=0
  if [ "$jobs" -le 1 ]; then
    logs=("$log")
    run_one "$log"
    rc=$?
  else
    logs=()
    pids=()
    for j in $(seq "$jobs"); do
      logs+=("$build/fuzz_$n.$j.log")
      run_one "$build/fuzz_$n.$j.log" -seed="$(( ${FUZZ_SEED_BASE:-0} + j ))" &
      pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
  fi
  set -e
  elapsed=$(( $(date +%s) - start ))
  execs=0
  for l in "${logs[@]}"; do
    e=$(sed -n 's/^stat::number_of_executed_units: *//p' "$l" | tail -1)
    execs=$(( execs + ${e:-0} ))
  done
  found=$(find "$findings" -type f | wc -l)
  rate=$(( execs / (elapsed > 0 ? elapsed : 1) ))
  echo "fuzz: $n executions $execs in $elapsed s ($rate/s, $jobs process$([ "$jobs" -gt 1 ] && echo es)), findings $found"
  if [ "$rc" -ne 0 ] || [ "$found" -ne 0 ]; then
    echo "fuzz: $n FAILED (exit $rc); log ${logs[*]}, inputs in $findings" >&2
    grep -h -E "ERROR|SUMMARY|fuzz: |terminate|what\(\)" "${logs[@]}" | head -20 >&2 || true
    status=1
  fi
done
exit $status
