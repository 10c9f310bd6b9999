#!/usr/bin/env bash
# One GPU-machine call for every quantized kernel (docs/fp8_cuda.md, docs/nvfp4_cuda.md, docs/moe_cuda.md "FP8
# experts", docs/caches.md): build, the quantized ops' CUDA tests, chimera_bench's FP8 / NVFP4 benchmarks and their
# PyTorch peers in the same run. Run from the repository root on the GPU machine:
#   OUT=<dir> bash bench/run_quant_device.sh
# QUANT_TESTS overrides the gtest filter. Budget: ~580 s (one device call); every step is bounded and logs to $OUT.
OUT=${OUT:-/tmp/quant_out}
source bench/device_steps.sh  # el, left and the steps below
device_begin

READY=/tmp/fp8_peers_ready GO=/tmp/fp8_peers_go
rm -f "$READY" "$GO"
start_peers 560 bench/peers/fp8_peers.py --ready "$READY" --go "$GO"

cmake -S . -B b -G Ninja -DCHIMERA_CUDA=ON -DCMAKE_BUILD_TYPE=Release "${CMAKE_EXTRA[@]}" >"$OUT/cmake.log" 2>&1 ||
  { tail -40 "$OUT/cmake.log"; exit 1; }
timeout "$(left 300)" ninja -C b -j16 chimera_tests chimera_bench chimera_cli >"$OUT/build.log" 2>&1 ||
  { grep -E -A15 "error|FAILED" "$OUT/build.log" | head -120; exit 1; }
echo "build warnings: $(grep -c -i warning "$OUT/build.log")"
el built
run_tests "${QUANT_TESTS:-CudaFp8Linear*:QuantNorm*:*Nvfp4*:QuantLinear*:*Fp8Experts*}" 370

while [ ! -e "$READY" ] && kill -0 "$PEERS" 2>/dev/null && [ "$(left 380)" -gt 0 ]; do sleep 0.5; done
el "peers warm: $([ -e "$READY" ] && echo yes || echo no)"
timeout "$(left 500)" ./b/chimera_bench fp8_linear fp8_norm nvfp4 moe_experts_fp8 >"$OUT/bench.log" 2>&1
echo "bench rc=$?"
el benched
touch "$GO"
wait "$PEERS"
echo "fp8 peers rc=$?"
timeout "$(left 575)" python3 bench/peers/nvfp4_peers.py >"$OUT/nvfp4_peers.log" 2>&1
echo "nvfp4 peers rc=$?"
el peers
grep -h -E "CHECK|RATIO|INFO|ERROR|Error" "$OUT/bench.log" | cut -c1-220 | head -90
python3 bench/peers/fp8_compare.py "$OUT/bench.log" "$OUT/peers.log" >"$OUT/fp8_compare.txt" 2>&1
head -60 "$OUT/fp8_compare.txt"
grep -h "^BENCH" "$OUT/nvfp4_peers.log" | cut -c1-200 | head -20
if [ "$(left 590)" -gt 15 ]; then
  (cd bench/peers && timeout "$(left 590)" python3 fp8_moe_peers.py) >"$OUT/fp8_moe_peers.log" 2>&1
  echo "fp8 moe peers rc=$?"
fi
# Only a few files come back from the GPU machine: every log in one archive.
tar czf /tmp/quant_logs.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/quant_logs.tgz "$OUT/"
el done
