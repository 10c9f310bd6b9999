#!/usr/bin/env bash
# One GPU-machine call for every quantized kernel (docs/fp8_cuda.md, docs/nvfp4_cuda.md, docs/moe_cuda.md "FP8
# experts", docs/caches.md): build; the quantized ops', models' and caches' tests on CUDA; chimera_bench's FP8 / NVFP4
# benchmarks with the torch._scaled_mm peers (bench/peers/fp8_peers.py) timed after them in the same run; then the
# rest of the suite in the time left. Every log comes back in $OUT/quant_logs.tgz. From the repository root:
#   OUT=<dir> bash bench/run_quant_device.sh          (QUANT_TESTS overrides the first filter; ~600 s)
OUT=${OUT:-/tmp/quant_out}
source bench/device_steps.sh  # el, left and the steps below
device_begin

READY=/tmp/fp8_peers_ready GO=/tmp/fp8_peers_go
rm -f "$READY" "$GO"
start_peers 590 bench/peers/fp8_peers.py --ready "$READY" --go "$GO"

cmake -S . -B b -G Ninja -DCHIMERA_CUDA=ON -DCMAKE_BUILD_TYPE=Release "${CMAKE_EXTRA[@]}" >"$OUT/cmake.log" 2>&1 ||
  { tail -40 "$OUT/cmake.log"; exit 1; }
timeout "$(left 330)" ninja -C b -j16 chimera_tests chimera_bench chimera_cli >"$OUT/build.log" 2>&1 ||
  { grep -E -A15 "error|FAILED" "$OUT/build.log" | head -120; exit 1; }
echo "build warnings: $(grep -c -i warning "$OUT/build.log")"
el built
# The quantized ops and caches first, then their benchmarks and peers, then the rest of the suite.
QUANT=${QUANT_TESTS:-CudaFp8Linear*:QuantNorm*:*Nvfp4*:QuantLinear*:*Fp8Experts*:*ModelOptFixtures*:QuantOps*:WeightsModule*:CliQuantization*:BadQuantCheckpoint*:*OpsSsmStateDtype*:*OpsAttentionFp8Cache*:*EngineSsmCacheDtype*:StochasticRounding*}
run_tests "$QUANT" 400
mv "$OUT/tests.log" "$OUT/tests_quant.log"

while [ ! -e "$READY" ] && kill -0 "$PEERS" 2>/dev/null && [ "$(left 405)" -gt 0 ]; do sleep 0.5; done
el "peers warm: $([ -e "$READY" ] && echo yes || echo no)"
timeout "$(left 470)" ./b/chimera_bench fp8_linear fp8_norm nvfp4 moe_experts_fp8 >"$OUT/bench.log" 2>&1
echo "bench rc=$?"
el benched
touch "$GO"
timeout "$(left 500)" tail --pid="$PEERS" -f /dev/null
echo "fp8 peers done: $(kill -0 "$PEERS" 2>/dev/null && echo no || echo yes)"
kill "$PEERS" 2>/dev/null
el peers
grep -h -E "CHECK|RATIO|INFO|ERROR|Error" "$OUT/bench.log" | cut -c1-200 | head -70
python3 bench/peers/fp8_compare.py "$OUT/bench.log" "$OUT/peers.log" >"$OUT/fp8_compare.txt" 2>&1
head -40 "$OUT/fp8_compare.txt"
# The rest of the suite in what is left.
run_tests "-$QUANT" 585
# Only a few files come back from the GPU machine: every log in one archive.
tar czf /tmp/quant_logs.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/quant_logs.tgz "$OUT/"
el done
