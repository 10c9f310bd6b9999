#!/usr/bin/env bash
# One GPU-machine call for the NVFP4 weight-only kernels (docs/nvfp4_cuda.md): build, the NVFP4 op tests on CUDA
# (tests/ops/nvfp4_linear_test.cpp, nvfp4_experts_test.cpp), memcheck on the experts test, chimera_bench nvfp4 and
# the PyTorch peer (bench/peers/nvfp4_peers.py). Run from the repository root on the GPU machine:
#   OUT=<dir> bash bench/run_nvfp4_device.sh
# Budget: under 600 s (one device call); every step is bounded and logs to $OUT.
OUT=${OUT:-/tmp/nvfp4_out}
source bench/device_steps.sh  # el, left and the steps below
device_begin

build_tests_and_bench
run_tests '*Nvfp4*:QuantLinear*' 300
sanitize memcheck 'Nvfp4Experts.*/Cuda' 400 'ERROR SUMMARY'
timeout "$(left 540)" ./b/chimera_bench nvfp4 >"$OUT/bench.log" 2>&1
echo "bench rc=$?"
el benched
timeout "$(left 590)" python3 bench/peers/nvfp4_peers.py >"$OUT/peers.log" 2>&1
echo "peers rc=$?"
el peers
grep -h -E "CHECK|RATIO|ERROR" "$OUT/bench.log" | cut -c1-200 | head -80
# Compact table: kernel shape us floor_ratio
grep -h -E "^BENCH" "$OUT/bench.log" "$OUT/peers.log" |
  sed -E 's/BENCH kernel=([^ ]*) shape=(.*) us=([^ ]*) gbps=([^ ]*) tflops=([^ ]*) floor_ratio=([^ ]*)/\1 | \2 | \3 us | \4 GB\/s | \5 TF | \6/'
