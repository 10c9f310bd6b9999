"""The BENCH line the peer scripts print, in the format and against the ceilings of bench/bench_common.h.

    BENCH kernel=<name> shape=<text> us=<median> gbps=<x> tflops=<y> floor_ratio=<r>

floor_ratio is the larger of GB/s over the measured device copy and TFLOP/s over the measured dense bf16 peak.
"""
COPY_GBS = 4200.0  # bench_common.h kCopyBandwidthGBs: measured device copy, read + write
BF16_TFLOPS = 790.0  # bench_common.h kBf16PeakTflops: measured dense bf16


def report(kernel, shape, us, nbytes=0.0, flops=0.0):
    gbps = nbytes / (us * 1e-6) / 1e9
    tflops = flops / (us * 1e-6) / 1e12
    ratio = max(gbps / COPY_GBS, tflops / BF16_TFLOPS)
    print(f"BENCH kernel={kernel} shape={shape} us={us:.2f} gbps={gbps:.1f} tflops={tflops:.2f} "
          f"floor_ratio={ratio:.3f}", flush=True)
