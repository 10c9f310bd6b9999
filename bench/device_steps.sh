# shellcheck shell=bash
# Sourced (from the repository root on the GPU machine) by the bench/run_*_device.sh scripts that build there
# (run_mamba_device.sh, run_ssd_device.sh): the step timer and the steps they share. Every step logs to $OUT and
# is bounded by `timeout`; a DEADLINE argument is seconds after the start (T0), as for `left`.
set -uo pipefail
OUT=${OUT:?set OUT before sourcing bench/device_steps.sh}
mkdir -p "$OUT"
T0=$(date +%s)
el() { echo "[$(($(date +%s) - T0))s] $*"; }
left() { echo $(($1 - ($(date +%s) - T0))); }

# The carried .debs (CMAKE_EXTRA) and the GPU's clocks, memory and temperature.
device_begin() {
  source scripts/device_env.sh  # carried .debs -> CMAKE_EXTRA
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used,temperature.gpu --format=csv,noheader
}

# start_peers DEADLINE SCRIPT ARGS...: the peers in the background (PEERS), compiling while the C++ side builds;
# they write READY when warm and time their kernels once GO exists.
start_peers() {
  local deadline=$1
  shift
  PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=4 timeout "$(left "$deadline")" python3 "$@" >"$OUT/peers.log" 2>&1 &
  PEERS=$!
}

# chimera_tests and chimera_bench in b/; exits (with the log's errors) when the configure or the build fails.
build_tests_and_bench() {
  cmake -S . -B b -G Ninja -DCHIMERA_CUDA=ON -DCMAKE_BUILD_TYPE=Release "${CMAKE_EXTRA[@]}" >"$OUT/cmake.log" 2>&1 ||
    { tail -40 "$OUT/cmake.log"; exit 1; }
  ninja -C b -j16 chimera_tests chimera_bench >"$OUT/build.log" 2>&1 ||
    { grep -E -A15 "error|FAILED" "$OUT/build.log" | head -120; exit 1; }
  el built
}

# run_tests FILTER DEADLINE [PREFIX]: the tests, their summary and failures, and the CUDA cases that passed with
# their times (PREFIX, a sed regex, cut from those names).
run_tests() {
  timeout "$(left "$2")" ./b/chimera_tests --gtest_filter="$1" >"$OUT/tests.log" 2>&1
  echo "tests rc=$?"
  grep -E "^\[  (FAILED|PASSED) +\]|^\[==========\]" "$OUT/tests.log" | head -20
  grep -E -B2 -A12 "Failure|exception|what\(\)" "$OUT/tests.log" | cut -c1-300 | head -100
  echo "CUDA OK: $(grep -E 'OK \] .*/Cuda' "$OUT/tests.log" |
    sed -E "s/.*\] ${3:-}([^ ]*)\/Cuda \(([0-9]+) ms\)/\1(\2ms)/" | tr '\n' ' ')"
  el tested
}

# sanitize TOOL FILTER DEADLINE SUMMARY [DETAILS]: compute-sanitizer --tool TOOL over the tests FILTER, if more than
# 10 s are left; prints the last two lines matching SUMMARY and the first five matching DETAILS.
sanitize() {
  if [ "$(left "$3")" -gt 10 ]; then
    timeout "$(left "$3")" compute-sanitizer --tool "$1" ./b/chimera_tests --gtest_filter="$2" >"$OUT/$1.log" 2>&1
    echo "$1 rc=$? $(grep -E "$4" "$OUT/$1.log" | tail -2 | paste -sd' ' -) $(grep -c 'OK \]' "$OUT/$1.log") ok"
    [ -z "${5:-}" ] || grep -E -m5 "$5" "$OUT/$1.log" | cut -c1-200
  fi
  el "$1ed"
}

# bench_then_peers FILTER WARM_DEADLINE BENCH_DEADLINE: waits (up to WARM_DEADLINE) for the peers to be warm, runs
# chimera_bench FILTER alone, then lets the peers time theirs and waits for them.
bench_then_peers() {
  while [ ! -e "$READY" ] && kill -0 "$PEERS" 2>/dev/null && [ "$(left "$2")" -gt 0 ]; do sleep 0.5; done
  el "peers warm: $([ -e "$READY" ] && echo yes || echo no)"
  timeout "$(left "$3")" ./b/chimera_bench "$1" >"$OUT/bench.log" 2>&1
  echo "bench rc=$?"
  el benched
  touch "$GO"
  wait "$PEERS"
  echo "peers rc=$?"
  el peers
}
