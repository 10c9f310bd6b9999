#!/usr/bin/env python3
"""Joins chimera_bench's FP8 lines (bench/fp8_bench.cu) with the torch peers' (bench/peers/fp8_peers.py) by shape:

    python3 bench/peers/fp8_compare.py BENCH_LOG PEERS_LOG

One row per Chimera case: its time, its floor ratio (bandwidth for the GEMV and the norms, FP8 peak for the GEMM),
the peer's time and the ratio peer / Chimera (> 1: Chimera is faster), and the bf16 layer of the same shape.
"""
import re
import sys

LINE = re.compile(r"^(BENCH|FP8) kernel=(\S+) shape=(.+?) us=([\d.]+) .*?(floor_ratio|fp8_peak_ratio)=([\d.]+)")
PEER = {
    "fp8_gemv_prequant-graph": "fp8_scaled_mm",
    "fp8_gemv_w8a8-graph": "fp8_quant_scaled_mm",
    "fp8_gemv_mma_prequant-graph": "fp8_scaled_mm",
    "fp8_gemv_mma_w8a8-graph": "fp8_quant_scaled_mm",
    "fp8_linear_plan-graph": "fp8_quant_scaled_mm",
    "fp8_gemm_prequant": "fp8_scaled_mm",
    "fp8_gemm_prequant-fastacc": "fp8_scaled_mm-fastacc",
    "fp8_linear": "fp8_quant_scaled_mm",
    "add_rms_norm_fp8-graph": "add_rms_norm_fp8",
    "gated_rms_norm_fp8-graph": "gated_rms_norm_fp8",
}
BF16 = {"fp8_gemv_prequant-graph": "linear_bf16_plan-graph", "fp8_gemv_w8a8-graph": "linear_bf16_plan-graph",
        "fp8_gemv_mma_prequant-graph": "linear_bf16_plan-graph", "fp8_gemv_mma_w8a8-graph": "linear_bf16_plan-graph",
        "fp8_linear_plan-graph": "linear_bf16_plan-graph",
        "fp8_gemm_prequant": "linear_bf16", "fp8_linear": "linear_bf16",
        "add_rms_norm_fp8-graph": "add_rms_norm+quantize_fp8-graph",
        "gated_rms_norm_fp8-graph": "gated_rms_norm+quantize_fp8-graph"}


def parse(path):
    rows = []
    with open(path) as f:
        for line in f:
            m = LINE.match(line.strip())
            if m:
                rows.append((m.group(1), m.group(2), m.group(3), float(m.group(4)), float(m.group(6))))
    return rows


def main():
    ours, peers = parse(sys.argv[1]), parse(sys.argv[2])
    us = {(k, s): t for kind, k, s, t, _ in ours if kind == "BENCH"}
    fp8_ratio = {(k, s): r for kind, k, s, _, r in ours if kind == "FP8"}
    peer_us = {}
    for _, k, s, t, _ in peers:
        base = k.replace("-pad16", "").replace("-torch-eager", "").replace("-torch", "")
        peer_us[(base, s)] = (t, k)
    print(f"{'kernel':28} {'shape':44} {'us':>9} {'ratio':>6} {'peer':>9} {'peer/us':>7} {'unfused/bf16 us':>15}")
    for kind, k, s, t, r in ours:
        if kind != "BENCH" or not (k.startswith("fp8_") or k.endswith("_fp8-graph") or k.startswith("quantize")):
            continue
        ratio = fp8_ratio.get((k, s), r)
        p = peer_us.get((PEER.get(k, ""), s))
        b = us.get((BF16.get(k, ""), s))
        print(f"{k:28} {s:44} {t:9.2f} {ratio:6.3f} {p[0] if p else float('nan'):9.2f} "
              f"{p[0] / t if p else float('nan'):7.2f} {b if b else float('nan'):15.2f}")


if __name__ == "__main__":
    main()
