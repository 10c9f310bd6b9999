#!/usr/bin/env bash
# One script for the GPU machine's release checks, in steps that each fit one device call:
#   OUT=<dir> bash bench/run_release_device.sh STEP...
#   build     this tree (NINJA_TARGETS: only those targets) (build-dev: CLI, tests, kernel benchmarks) and, when .baseline/ holds an older tree
#             (git archive of the commit to compare with, tests/fixtures left out), that tree's CLI in
#             .baseline/build, both with the carried .debs (scripts/device_env.sh)
#   tune      chimera_bench linear_tune -> src/backends/cuda/gemm/sm90_linear_table.inc (copied to $OUT), rebuild
#   tests     the chimera_tests suite ($OUT/tests.log): all of it, or the gtest filter TESTS_FILTER, within
#             TESTS_TIMEOUT seconds (default 590)
#   engine    chimera bench on the Nano shape, this tree and the baseline alternated (ENGINE_ROUNDS, default 1):
#             prefill 1K / 8K, decode b1 / b64 / b256 after a 1K prompt; JSON per run in $OUT. ENGINE_QUANT (a
#             comma list of none, fp8, nvfp4; default none) runs this tree once per weight format (--quantization),
#             one after the other in each round (engine_new_<format>_<round>.json); ENGINE_BATCHES: the decode
#             batch sizes (default 1,64,256); ENGINE_MODEL: the --synthetic preset (default the Nano one; another one
#             runs this tree only), ENGINE_INPUT_LENS: the prefill lengths (default 1024,8192)
#   fuzz-start  scripts/fuzz.sh in the background at nice 19 over the carried harness binaries (.fuzzbin/fuzz/,
#             built on the CPU machine: this one has no clang) for FUZZ_SECONDS (default 400), FUZZ_JOBS processes
#             per harness (default 6) of FUZZ_HARNESSES (default chat_template,tokenizer_codec); the corpus grows in
#             .fuzzbin/corpus. Start it after `build`: ten ASan processes beside the build stretched it from ~175 s to
#             473 s even at nice 19 (2026-12-02)
#   fuzz-wait   waits for it (at most FUZZ_WAIT seconds, default 60, then stops it) and leaves its summary, logs,
#             findings and grown corpus in $OUT/fuzz.tgz
#   serve     chimera serve on the Nano shape (CUDA; weights bf16 or SERVE_QUANT as --quantization; SERVE_MAX_NUM_SEQS,
#             SERVE_MAX_NUM_BATCHED_TOKENS: default chimera serve's own) and chimera bench serve against it,
#             random 1K in / 1K out (max(c, 4) prompts per concurrency c)
#             at SERVE_CONCURRENCY (default 1,64,256,1024); logs and JSON in $OUT
#   prefix    prefix caching: chimera serve on the Nano shape (bf16, --max-num-seqs 256, --max-model-len 8448) once per
#             PREFIX_MODES entry (default on,off,on512: --enable-prefix-caching, --no-enable-prefix-caching, and the
#             cache with checkpoints every 512 tokens), each running chimera bench serve: a shared 4096-token prefix + 256 unique tokens, 256
#             out, at concurrency 1 (16 prompts) and 64 (128 prompts); the multi-turn replay (32 conversations x 4
#             turns, 1024-token system prompt, 512-token user turns, 128-token replies, concurrency 32); 8K in / 1 out at
#             concurrency 1 (no shared prefix: what the cache costs a prompt it cannot help); random 1K in / 256 out at
#             concurrency 256 (512 prompts). Every run has its own seed, so no run hits another's prompts
#   tp        tensor parallelism on two GPUs (nvidia-h200-x2): the tensor-parallel and AllReduce tests
#             ($OUT/tp_tests.log), then chimera bench on the Nano shape at TP = 1, TP = 2 (AllReduce AUTO) and TP = 2
#             with --allreduce-strategy nccl (ncclAllReduce + the norm kernel) and with --moe-split expert (the
#             routed experts split by expert: the EP / TP measurement), prefill 1K / 8K and decode b1 / b64 /
#             b256 (ENGINE_BATCHES), and TP = 2 as two processes (--nnodes 2, one GPU each); with TP_SUPER=1 also Super at full depth in bf16 over the two GPUs (b1, b64,
#             prefill 1K / 8K). JSON per run in $OUT
#   spec      speculative decoding under load: chimera serve with the bundled trained model (models/nemotron-h-kjv,
#             CUDA, bf16) once per SPEC_MODES entry (default off,mtp1,mtp3: no drafts, the MTP head with 1 and 3
#             drafts), each running chimera bench serve over random 128-token prompts, 256 tokens out, at
#             SPEC_CONCURRENCY (default 1,16,64; 4c prompts, at least 8); logs, JSON and the servers' /metrics in $OUT
#   spec-verify the verify step against the 1-token step: chimera bench on SPEC_MODEL (default the Super shape) at
#             SPEC_LAYERS (default 40) layers with its random MTP head, eagerly so the verify is timed apart from the
#             drafting, one process per K in SPEC_KS (default 0,1,2,3), decode at SPEC_BATCHES (default 1,64) after
#             1K-token prompts; JSON and logs per K in $OUT
# Every step prints a line starting with "== " and the elapsed seconds.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/release_out}
mkdir -p "$OUT"
T0=$(date +%s)
el() { echo "== [$(($(date +%s) - T0))s] $*"; }
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
NANO=nemotron-3-nano-30b-a3b
# start_server PORT LOG FLAGS...: chimera serve on CUDA in the background (its pid in spid), waiting up to 600 s for
# /health; a server that exits first ends the script with its log's tail.
start_server() {
  local port=$1 log=$2; shift 2
  ./build-dev/chimera serve --device cuda --port "$port" "$@" >"$log" 2>&1 &
  spid=$!
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && return
    kill -0 "$spid" 2>/dev/null || { echo "chimera serve exited:"; tail -20 "$log"; exit 1; }
    sleep 1
  done
}
rc=0
source scripts/device_env.sh  # carried .debs -> CMAKE_EXTRA
for step in "$@"; do
  case "$step" in
  build)
    nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
    cmake -S . -B build-dev -G Ninja -DCMAKE_BUILD_TYPE=Release -DCHIMERA_CUDA=ON "${CMAKE_EXTRA[@]}" \
      >"$OUT/cmake.log" 2>&1 || { tail -40 "$OUT/cmake.log"; exit 1; }
    ( ninja -C build-dev -j 12 ${NINJA_TARGETS:-} >"$OUT/build.log" 2>&1 || echo FAILED >"$OUT/build.failed" ) &
    if [ -f .baseline/CMakeLists.txt ]; then
      cmake -S .baseline -B .baseline/build -G Ninja -DCMAKE_BUILD_TYPE=Release -DCHIMERA_CUDA=ON \
        -DCHIMERA_BUILD_TESTS=OFF -DCHIMERA_CUTLASS_INCLUDE="$PWD/.deps/cutlass/include" "${CMAKE_EXTRA[@]}" >"$OUT/cmake-baseline.log" 2>&1 &&
        ninja -C .baseline/build -j 6 chimera_cli >"$OUT/build-baseline.log" 2>&1 ||
        { echo "baseline build failed"; tail -30 "$OUT/build-baseline.log"; }
    fi
    wait
    if [ -f "$OUT/build.failed" ]; then grep -E -A15 "error|FAILED" "$OUT/build.log" | head -80; exit 1; fi
    grep -c -i "warning" "$OUT/build.log" | sed 's/^/build warnings: /'
    el built ;;
  tune)
    python3 scripts/make_linear_table.py --bench ./build-dev/chimera_bench \
      --out src/backends/cuda/gemm/sm90_linear_table.inc --log "$OUT/linear_tune.log" || rc=1
    cp src/backends/cuda/gemm/sm90_linear_table.inc "$OUT/"
    ninja -C build-dev -j 16 >"$OUT/rebuild.log" 2>&1 || { tail -30 "$OUT/rebuild.log"; exit 1; }
    el tuned ;;
  tests)
    timeout "${TESTS_TIMEOUT:-590}" ./build-dev/chimera_tests --gtest_brief=1 ${TESTS_FILTER:+--gtest_filter="$TESTS_FILTER"} \
      >"$OUT/tests.log" 2>&1 || rc=1
    grep -E "^\[  FAILED  \]|^\[==========\]|^\[  PASSED  \]|tests? (ran|skipped)" "$OUT/tests.log" | head -40
    el tests ;;
  engine)
    args=(--synthetic "${ENGINE_MODEL:-$NANO}" --device cuda --input-lens "${ENGINE_INPUT_LENS:-1024,8192}" --batch-sizes "${ENGINE_BATCHES:-1,64,256}" --decode-context 1024)
    for r in $(seq "${ENGINE_ROUNDS:-1}"); do
      if [ -x .baseline/build/chimera ] && [ "${ENGINE_MODEL:-$NANO}" = "$NANO" ]; then
        .baseline/build/chimera bench "${args[@]}" --json-out "$OUT/engine_base_$r.json" 2>&1 | tail -14
        el "baseline round $r"
      fi
      for q in $(echo "${ENGINE_QUANT:-none}" | tr , ' '); do
        qargs=()
        [ "$q" = none ] || qargs=(--quantization "$q")
        timeout "${ENGINE_TIMEOUT:-300}" ./build-dev/chimera bench "${args[@]}" "${qargs[@]}" --json-out "$OUT/engine_new_${q}_$r.json" 2>&1 | tail -16
        el "this tree, weights $q, round $r"
      done
    done ;;
  fuzz-start)
    # One scripts/fuzz.sh per harness, all at once (the script runs its harnesses one after the other).
    FUZZ_PIDS=()
    for h in $(echo "${FUZZ_HARNESSES:-chat_template,tokenizer_codec}" | tr , ' '); do
      ( FUZZ_NO_BUILD=1 FUZZ_BUILD_DIR=.fuzzbin FUZZ_JOBS=${FUZZ_JOBS:-6} FUZZ_TIMEOUT=60 \
          nice -n 19 bash scripts/fuzz.sh "${FUZZ_SECONDS:-400}" "$h" >"$OUT/fuzz_summary_$h.txt" 2>&1 ) &
      FUZZ_PIDS+=($!)
    done
    el "fuzzing in the background (pids ${FUZZ_PIDS[*]})" ;;
  fuzz-wait)
    # Up to FUZZ_WAIT s for the harnesses' own time limit, then SIGINT (libFuzzer still prints its statistics).
    for pid in ${FUZZ_PIDS[@]+"${FUZZ_PIDS[@]}"}; do
      for _ in $(seq "${FUZZ_WAIT:-60}"); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    done
    pkill -INT -f '.fuzzbin/fuzz/' 2>/dev/null
    for pid in ${FUZZ_PIDS[@]+"${FUZZ_PIDS[@]}"}; do wait "$pid"; done
    cat "$OUT"/fuzz_summary_*.txt >"$OUT/fuzz_summary.txt" 2>/dev/null
    cat "$OUT/fuzz_summary.txt"
    cp "$OUT/fuzz_summary.txt" .fuzzbin/
    (cd .fuzzbin && tar czf "$OUT/fuzz.tgz" fuzz_summary.txt corpus findings fuzz_*.log)
    el "fuzz done" ;;
  tp)
    nvidia-smi --query-gpu=index,name,memory.used --format=csv,noheader
    timeout "${TP_TESTS_TIMEOUT:-240}" ./build-dev/chimera_tests --gtest_brief=1 \
      --gtest_filter='*TensorParallel*:*AllReduce*:*DeviceGroup*:CliMultiNode*:RemoteRanks*' >"$OUT/tp_tests.log" 2>&1 || rc=1
    grep -E "^\[  FAILED  \]|^\[==========\]|^\[  PASSED  \]" "$OUT/tp_tests.log" | head -20
    el "tensor-parallel tests"
    args=(--synthetic "$NANO" --device cuda --input-lens 1024,8192 --batch-sizes "${ENGINE_BATCHES:-1,64,256}" --decode-context 1024)
    ./build-dev/chimera bench "${args[@]}" --json-out "$OUT/tp1.json" 2>&1 | tail -12
    el "Nano TP 1"
    ./build-dev/chimera bench "${args[@]}" --tensor-parallel-size 2 --moe-split intermediate --json-out "$OUT/tp2.json" 2>&1 | tail -12
    el "Nano TP 2, AllReduce auto"
    ./build-dev/chimera --allreduce-strategy nccl bench "${args[@]}" --tensor-parallel-size 2 \
      --json-out "$OUT/tp2_nccl.json" 2>&1 | tail -12
    el "Nano TP 2, AllReduce nccl + norm kernel"
    ./build-dev/chimera bench "${args[@]}" --tensor-parallel-size 2 --moe-split expert --json-out "$OUT/tp2_ep.json" 2>&1 | tail -12
    el "Nano TP 2, experts split by expert"
    # The same ranks in two processes (one GPU each: NCCL, its unique id sent over the HostGroup).
    mp=(--tensor-parallel-size 2 --moe-split intermediate --nnodes 2 --master-port 29611)
    CUDA_VISIBLE_DEVICES=1 ./build-dev/chimera bench "${args[@]}" "${mp[@]}" --node-rank 1 >"$OUT/tp2_node1.log" 2>&1 &
    CUDA_VISIBLE_DEVICES=0 ./build-dev/chimera bench "${args[@]}" "${mp[@]}" --node-rank 0 --json-out "$OUT/tp2_nodes.json" 2>&1 | tail -12
    wait
    el "Nano TP 2 over two processes"
    if [ "${TP_SUPER:-0}" = 1 ]; then
      ./build-dev/chimera bench --synthetic nemotron-3-super-120b-a12b --device cuda --tensor-parallel-size 2 \
        --input-lens 1024,8192 --batch-sizes 1,64 --decode-context 1024 --json-out "$OUT/tp2_super.json" 2>&1 | tail -12
      el "Super TP 2"
    fi ;;
  serve)
    port=8731
    start_server "$port" "$OUT/serve.log" --synthetic "$NANO" ${SERVE_QUANT:+--quantization "$SERVE_QUANT"} \
      --max-num-seqs "${SERVE_MAX_NUM_SEQS:-1024}" --max-model-len 2304 \
      ${SERVE_MAX_NUM_BATCHED_TOKENS:+--max-num-batched-tokens "$SERVE_MAX_NUM_BATCHED_TOKENS"}
    el "server up"; head -20 "$OUT/serve.log"
    for c in $(echo "${SERVE_CONCURRENCY:-1,64,256,1024}" | tr , ' '); do
      n=$((c < 4 ? 4 : c))
      ./build-dev/chimera bench serve --base-url "http://127.0.0.1:$port" --tokenizer models/nemotron-h-tiny --dataset-name random \
        --random-input-len 1024 --random-output-len 1024 --num-prompts "$n" --max-concurrency "$c" \
        --ignore-eos --seed 0 --save-result --result-filename "$OUT/serve_c$c.json" 2>&1 | tee "$OUT/serve_c$c.log" |
        grep -E "Successful|duration|Output token|Mean TTFT|Median TTFT|Mean TPOT|Mean ITL|P99 ITL"
      el "concurrency $c"
    done
    echo "stats lines of the server (every 10 s with steps):"; grep "Avg prompt" "$OUT/serve.log" | sed 's/^chimera serve: //'
    curl -s "http://127.0.0.1:$port/metrics" >"$OUT/metrics.txt"
    kill -INT "$spid"; wait "$spid"; echo "serve exit $?" ;;
  prefix)
    port=8732
    for mode in $(echo "${PREFIX_MODES:-on,off,on512}" | tr , ' '); do
      case "$mode" in
        on) flags=(--enable-prefix-caching) ;;
        off) flags=(--no-enable-prefix-caching) ;;
        on512) flags=(--enable-prefix-caching --mamba-checkpoint-interval 512) ;;
        *) echo "unknown prefix mode $mode"; exit 2 ;;
      esac
      start_server "$port" "$OUT/prefix_serve_$mode.log" --synthetic "$NANO" --max-num-seqs 256 --max-model-len 8448 \
        "${flags[@]}"
      el "server up ($mode)"; grep -E "prefix caching|KV cache|CUDA graphs" "$OUT/prefix_serve_$mode.log"
      bs() {  # name, then bench serve flags; PREFIX_LOADS (a comma list of the names) picks some
        local name=$1; shift
        case ",${PREFIX_LOADS:-shared_c1,shared_c64,multiturn,unique8k,random1k}," in *",$name,"*) ;; *) return ;; esac
        ./build-dev/chimera bench serve --base-url "http://127.0.0.1:$port" --tokenizer models/nemotron-h-tiny "$@" \
          --save-result --result-filename "$OUT/prefix_${mode}_$name.json" 2>&1 | tee "$OUT/prefix_${mode}_$name.log" |
          grep -E "Successful|duration|Output token|Total token|Mean TTFT|Median TTFT|P99 TTFT|Mean TPOT|Hit rate|Queried|Hit tokens"
        el "$mode $name"
      }
      bs shared_c1 --random-prefix-len 4096 --random-input-len 256 --random-output-len 256 --num-prompts 16 --max-concurrency 1 --seed 11
      bs shared_c64 --random-prefix-len 4096 --random-input-len 256 --random-output-len 256 --num-prompts 128 --max-concurrency 64 --seed 12
      bs multiturn --dataset-name multi-turn --multi-turn-conversations 32 --multi-turn-turns 4 --random-prefix-len 1024 \
        --random-input-len 512 --random-output-len 128 --max-concurrency 32 --seed 13
      bs unique8k --random-input-len 8192 --random-output-len 1 --num-prompts 8 --max-concurrency 1 --seed 14
      bs random1k --random-input-len 1024 --random-output-len 256 --num-prompts 512 --max-concurrency 256 --seed 15
      curl -s "http://127.0.0.1:$port/metrics" >"$OUT/prefix_metrics_$mode.txt"
      kill -INT "$spid"; wait "$spid"; echo "serve exit $?"
    done ;;
  spec)
    port=8733
    for mode in $(echo "${SPEC_MODES:-off,mtp1,mtp3}" | tr , ' '); do
      case "$mode" in
        off) flags=() ;;
        mtp*) flags=(--speculative-config "{\"method\": \"mtp\", \"num_speculative_tokens\": ${mode#mtp}}") ;;
        *) echo "unknown spec mode $mode"; exit 2 ;;
      esac
      start_server "$port" "$OUT/spec_serve_$mode.log" -m models/nemotron-h-kjv --max-num-seqs 64 "${flags[@]}"
      el "server up ($mode)"
      for c in $(echo "${SPEC_CONCURRENCY:-1,16,64}" | tr , ' '); do
        n=$((4 * c < 8 ? 8 : 4 * c))
        ./build-dev/chimera bench serve --base-url "http://127.0.0.1:$port" --tokenizer models/nemotron-h-kjv \
          --dataset-name random --random-input-len 128 --random-output-len 256 --num-prompts "$n" --max-concurrency "$c" \
          --ignore-eos --seed 21 --save-result --result-filename "$OUT/spec_${mode}_c$c.json" 2>&1 |
          tee "$OUT/spec_${mode}_c$c.log" | grep -E "Successful|Output token|Mean TTFT|Mean TPOT|Acceptance"
        el "$mode concurrency $c"
      done
      curl -s "http://127.0.0.1:$port/metrics" >"$OUT/spec_metrics_$mode.txt"
      kill -INT "$spid"; wait "$spid"; echo "serve exit $?"
    done ;;
  spec-verify)
    # One process per K: eager (--no-cuda-graphs), so chimera bench splits each step into the verify (K + 1 tokens
    # a sequence) and the head's drafting; with a random head nothing is accepted.
    for k in $(echo "${SPEC_KS:-0,1,2,3}" | tr , ' '); do
      flags=()
      [ "$k" -gt 0 ] && flags=(--speculative-config "{\"method\": \"mtp\", \"num_speculative_tokens\": $k}")
      timeout "${SPEC_VERIFY_TIMEOUT:-200}" ./build-dev/chimera bench --synthetic "${SPEC_MODEL:-nemotron-3-super-120b-a12b}" \
        --num-layers "${SPEC_LAYERS:-40}" --device cuda --input-lens 128 --batch-sizes "${SPEC_BATCHES:-1,64}" \
        --decode-context 1024 --decode-steps 8 --no-cuda-graphs "${flags[@]}" --json-out "$OUT/spec_verify_k$k.json" \
        2>&1 | tee "$OUT/spec_verify_k$k.log" | grep -E "^ +[0-9]+ +[0-9.]+ |speculative K|fit|rror"
      el "verify K = $k"
    done ;;
  *) echo "unknown step $step"; exit 2 ;;
  esac
done
exit $rc
