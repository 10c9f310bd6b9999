#!/usr/bin/env bash
# One GPU-machine call for the FP8 kernels (docs/fp8_cuda.md): build, the FP8 tests on CUDA, memcheck on the small
# cases, chimera_bench fp8, and the torch._scaled_mm peers (bench/peers/fp8_peers.py) on the same shapes, joined by
# bench/peers/fp8_compare.py. Run from the repository root on the GPU machine: OUT=<dir> bash bench/run_fp8_device.sh
# Budget: ~570 s (one device call of 600 s); every step is bounded and logs to $OUT.
OUT=${OUT:-/tmp/fp8_out}
source bench/device_steps.sh  # el, left and the steps below
device_begin

READY=/tmp/fp8_peers_ready GO=/tmp/fp8_peers_go
rm -f "$READY" "$GO"
start_peers 570 bench/peers/fp8_peers.py --ready "$READY" --go "$GO"

build_tests_and_bench
run_tests 'CudaFp8Linear*:QuantNorm*' 420

SMALL='CudaFp8Linear.EveryPathMatchesTheReference/T1_K64_N32:CudaFp8Linear.EveryPathMatchesTheReference/T9_K40_N9'
SMALL+=':CudaFp8Linear.EveryPathMatchesTheReference/T33_K2688_N80:QuantNorm.QuantizeMatchesCoreBitForBit/Cuda'
SMALL+=':QuantNorm.GatedRmsNormFp8MatchesReference/Cuda:CudaFp8LinearGraph.*'
sanitize memcheck "$SMALL" 470 'ERROR SUMMARY'
# bench_then_peers with two filters (the FP8 dense layers and norms only, not other FP8 benchmarks)
while [ ! -e "$READY" ] && kill -0 "$PEERS" 2>/dev/null && [ "$(left 480)" -gt 0 ]; do sleep 0.5; done
el "peers warm: $([ -e "$READY" ] && echo yes || echo no)"
timeout "$(left 540)" ./b/chimera_bench fp8_linear fp8_norm >"$OUT/bench.log" 2>&1
echo "bench rc=$?"
el benched
touch "$GO"
wait "$PEERS"
echo "peers rc=$?"
el peers
grep -h -E "peers:|ERROR|Error" "$OUT/peers.log" "$OUT/bench.log" | cut -c1-200 | head -12
python3 bench/peers/fp8_compare.py "$OUT/bench.log" "$OUT/peers.log" | tee "$OUT/fp8_compare.txt"
