#!/usr/bin/env bash
# One GPU-machine call for the Mamba kernels (conv1d, selective state update): build, the op tests on CUDA,
# memcheck on the small cases, chimera_bench, and the peers (bench/peers/mamba_peers.py) on the same shapes.
# Run from the repository root on the GPU machine: OUT=<dir> bash bench/run_mamba_device.sh
# Build dependencies missing from the GPU image may be carried as Debian packages in .deps/*.deb (unpacked
# into .deps/root). The peers compile (torch.compile, Triton) in the background during the C++ build and are
# timed alone afterwards. Budget: ~190 s; every step is bounded and logs to $OUT.
OUT=${OUT:-/tmp/mamba_out}
source bench/device_steps.sh  # el, left and the steps below
device_begin

READY=/tmp/mamba_peers_ready GO=/tmp/mamba_peers_go
rm -f "$READY" "$GO"
start_peers 190 bench/peers/mamba_peers.py --ready "$READY" --go "$GO"

build_tests_and_bench
run_tests 'OpsConv1d*:OpsSelectiveStateUpdate*:DeviceApi*' 110

SMALL='OpsConv1d.PackedBatchWithSlotsMatchesNaive/Cuda:OpsConv1d.UnalignedViewsMatchNaive/Cuda'
SMALL+=':OpsConv1d.UpdateEqualsOneTokenConv/Cuda:OpsConv1d.SplitInTwoCallsEqualsOneCall/Cuda:OpsConv1d.NoBiasMatchesNaive/Cuda'
SMALL+=':OpsConv1d.UpdateBatchesMatchNaive/Cuda'
SMALL+=':OpsSelectiveStateUpdate.OddShapesMatchNaive/Cuda:OpsSelectiveStateUpdate.MisalignedStateViewMatchesNaive/Cuda'
SMALL+=':OpsSelectiveStateUpdate.EveryRowTilingGivesTheSameBits/Cuda'
sanitize memcheck "$SMALL" 120 'ERROR SUMMARY'
bench_then_peers mamba 140 165
grep -h -E "peers:|ERROR" "$OUT/peers.log" "$OUT/bench.log" | cut -c1-200 | head -12
# Compact table: kernel shape us ratio
grep -h -E "^BENCH" "$OUT/bench.log" "$OUT/peers.log" |
  sed -E 's/BENCH kernel=([^ ]*) shape=([^ ]*) us=([^ ]*) gbps=[^ ]* tflops=[^ ]* floor_ratio=([^ ]*)/\1 \2 \3 \4/' |
  sed -E -e 's/_P64_N128_G8//' -e 's/_act-bf16//' -e 's/super_C10240_K4_/C10240_/' -e 's/-torch-/-t-/'
