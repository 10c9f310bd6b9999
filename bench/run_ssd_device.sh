#!/usr/bin/env bash
# One GPU-machine call for the SSD prefill kernels: build, the SSD op tests on CUDA, memcheck on two small
# cases, chimera_bench ssd (whole op and stage by stage) and the peers (bench/peers/ssd_peers.py) on the same
# shapes. The peers warm up (Triton autotuning, torch.compile) during the C++ build and are timed alone at the
# end. Run from the repository root on the GPU machine: OUT=<dir> bash bench/run_ssd_device.sh [budget_s]
# Build dependencies missing from the GPU image may be carried as Debian packages in .deps/*.deb (unpacked
# into .deps/root): libfmt-dev libfmt9 libgtest-dev libcli11-dev nlohmann-json3-dev libpcre2-dev libpcre2-8-0
# pkgconf pkgconf-bin libpkgconf3 (`apt-get download ...` on a Debian 12 machine).
OUT=${OUT:-/tmp/ssd_out}
BUDGET=${1:-190}
source bench/device_steps.sh  # el, left and the steps below
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
device_begin

READY=/tmp/ssd_peers_ready GO=/tmp/ssd_peers_go STOP=/tmp/ssd_peers_stop
rm -f "$READY" "$GO" "$STOP"
start_peers $((BUDGET - 2)) bench/peers/ssd_peers.py --ready "$READY" --go "$GO" --stop "$STOP" --budget $((BUDGET - 8))

build_tests_and_bench
run_tests 'OpsSsd*' $((BUDGET - 60)) 'OpsSsd\.'

SMALL='OpsSsd.CudaSixteenBitStatesActivationsAndParams/Cuda:OpsSsd.CudaPackedBatchSuperchunks/Cuda'
SMALL+=':OpsSsd.CudaRecurrenceSixteenBit/Cuda:OpsSsd.ChunkScanMatchesRecurrence/Cuda:OpsSsd.CudaGroupCbSmall/Cuda'
SMALL+=':OpsSsd.CudaSplitScanSmall/Cuda'
sanitize memcheck "$SMALL" $((BUDGET - 85)) 'ERROR SUMMARY' "Invalid|out of bounds|Address| at "
RACE='OpsSsd.CudaSixteenBitStatesActivationsAndParams/Cuda:OpsSsd.DtLimitsClampBothPaths/Cuda:OpsSsd.CudaGroupCbSmall/Cuda'
RACE+=':OpsSsd.CudaSplitScanSmall/Cuda'
sanitize racecheck "$RACE" $((BUDGET - 68)) 'ERROR SUMMARY|RACECHECK SUMMARY' "hazard|Race| at "

touch "$STOP"
bench_then_peers ssd $((BUDGET - 60)) $((BUDGET - 18))
grep -h -E "^peers:|^CHECK|ERROR|Error" "$OUT/peers.log" "$OUT/bench.log" | cut -c1-260 | head -24
# Compact table: kernel shape us tflops ratio
grep -h -E "^BENCH" "$OUT/bench.log" "$OUT/peers.log" |
  sed -E 's/BENCH kernel=([^ ]*) shape=(.*) us=([^ ]*) gbps=([^ ]*) tflops=([^ ]*) floor_ratio=([^ ]*)/\1 | \2 | \3 us | \4 GB\/s | \5 TF | \6/' |
  sed -E -e 's/ P=64 N=128 G=8 Q=128 bf16//' -e 's/ssd_chunk_scan-//' -e 's/ssd_stage-//'
