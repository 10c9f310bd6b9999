#!/usr/bin/env python3
"""PyTorch peers of bench/fp8_bench.cu: torch._scaled_mm (cuBLASLt's FP8 GEMM as PyTorch calls it) on the same
shapes, printed in the harness's format with the same shape text:

    BENCH kernel=<name> shape=<same text> us=<median> gbps=<x> tflops=<y> floor_ratio=<r>

  fp8_scaled_mm-torch            torch._scaled_mm(xq, w.t(), scale_a, scale_b, out_dtype=bf16), fast accumulation
                                 off (its default); the peer of fp8_gemv_prequant (decode) and fp8_gemm_prequant
  fp8_scaled_mm-fastacc-torch    the same with use_fast_accum=True; peer of fp8_gemm_prequant-fastacc
  fp8_quant_scaled_mm-torch      (x / s).clamp(-448, 448).to(float8_e4m3fn) then _scaled_mm: peer of fp8_gemv_w8a8 and
                                 fp8_linear (quantization included)
  add_rms_norm_fp8-torch-eager   residual + x, RMSNorm, weight, / s, clamp, cast (eager; torch.compile where budget)
  gated_rms_norm_fp8-torch-eager y * silu(z), grouped RMSNorm, weight, / s, clamp, cast
_scaled_mm needs the row count of x to be a multiple of 16 on some builds: a refused decode shape is padded to 16
rows and its line says so in the kernel name (-pad16). Times are triton.testing.do_bench medians (L2 flushed before
each call). --ready / --go as in mamba_peers.py: warm every case, touch READY, wait for GO, then time alone.
"""
import argparse
import os
import time

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from peer_report import report

E4M3 = torch.float8_e4m3fn
BF16 = torch.bfloat16
DEV = "cuda"
EPS = 1e-5

DECODE = [("nano_in_proj", 2688, 10304), ("nano_out_proj", 4096, 2688), ("nano_shared_up", 2688, 3712),
          ("nano_shared_down", 3712, 2688), ("nano_q_proj", 2688, 4096), ("nano_kv_proj", 2688, 256),
          ("nano_o_proj", 4096, 2688), ("super_in_proj", 4096, 18560), ("super_out_proj", 8192, 4096),
          ("super_latent_in", 4096, 1024)]
PREFILL = [("nano_in_proj", 2688, 10304), ("nano_out_proj", 4096, 2688), ("nano_shared_up", 2688, 3712),
           ("nano_q_proj", 2688, 4096), ("super_in_proj", 4096, 18560), ("super_out_proj", 8192, 4096)]


def bench(fn):
    return 1000.0 * do_bench(fn, warmup=5, rep=25, return_mode="median")


def shape_text(name, fin, fout, T):
    return f"T={T} in={fin} out={fout} bf16 ({name})"


def quant(x, s):
    return (x.float() / s).clamp(-448.0, 448.0).to(E4M3)


def make_cases():
    """(kernel, shape, fn, bytes, flops) for every peer case; tensors allocated here, timed later."""
    cases = []
    sa = torch.tensor(1.0 / 224.0, device=DEV)
    for group, Ts in (("decode", (1, 2, 4, 8)), ("prefill", (512, 1024, 4096, 8192))):
        for name, fin, fout in (DECODE if group == "decode" else PREFILL):
            w = (torch.rand(fout, fin, device=DEV) * 448.0 - 224.0).to(E4M3)
            sb = torch.tensor(1.0 / (224.0 * fin ** 0.5), device=DEV)
            for T in Ts:
                x = torch.randn(T, fin, device=DEV, dtype=BF16)
                xq = quant(x, sa)
                pad = ""
                try:
                    torch._scaled_mm(xq, w.t(), scale_a=sa, scale_b=sb, out_dtype=BF16)
                except RuntimeError:
                    pad = "-pad16"
                    rows = (T + 15) // 16 * 16
                    x = torch.cat([x, torch.zeros(rows - T, fin, device=DEV, dtype=BF16)])
                    xq = quant(x, sa)
                shape = shape_text(name, fin, fout, T)
                flops = 2.0 * T * fin * fout
                nbytes = fout * fin + T * fin + 2.0 * T * fout

                def mm(xq=xq, w=w, sb=sb, fast=False):
                    return torch._scaled_mm(xq, w.t(), scale_a=sa, scale_b=sb, out_dtype=BF16, use_fast_accum=fast)

                def qmm(x=x, w=w, sb=sb):
                    return torch._scaled_mm(quant(x, sa), w.t(), scale_a=sa, scale_b=sb, out_dtype=BF16)

                cases.append((f"fp8_scaled_mm{pad}-torch", shape, mm, nbytes, flops))
                if group == "prefill":
                    cases.append((f"fp8_scaled_mm-fastacc{pad}-torch", shape, lambda mm=mm: mm(fast=True), nbytes,
                                  flops))
                cases.append((f"fp8_quant_scaled_mm{pad}-torch", shape, qmm, nbytes + T * fin * 2, flops))
    for D in (2688, 4096):
        wn = torch.rand(D, device=DEV, dtype=BF16) + 0.5
        for T in (1, 8, 64, 1024, 8192):
            x = torch.randn(T, D, device=DEV, dtype=BF16)
            r = torch.randn(T, D, device=DEV, dtype=BF16)

            def add_norm_q(x=x, r=r, wn=wn):
                h = r + x
                hf = h.float()
                y = (wn * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS)).to(BF16))
                return quant(y, 1.0 / 64.0), h

            cases.append(("add_rms_norm_fp8-torch-eager", f"T={T} D={D} bf16", add_norm_q, 2 * T * D * 3 + T * D,
                          0.0))
    for model, Di in (("nano", 4096), ("super", 8192)):
        wn = torch.rand(Di, device=DEV, dtype=BF16) + 0.5
        for T in (1, 8, 64, 1024, 8192):
            y = torch.randn(T, Di, device=DEV, dtype=BF16)
            z = torch.randn(T, Di, device=DEV, dtype=BF16)

            def gated_q(y=y, z=z, wn=wn, Di=Di, T=T):
                u = (y.float() * F.silu(z.float())).view(T, 8, Di // 8)
                u = u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + EPS)
                return quant((wn * u.view(T, Di).to(BF16)), 1.0 / 64.0)

            cases.append(("gated_rms_norm_fp8-torch-eager", f"T={T} Di={Di} G=8 bf16 ({model})", gated_q,
                          2 * T * Di * 2 + T * Di, 0.0))
    return cases


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ready", help="touch this file once every case is warm")
    ap.add_argument("--go", help="wait for this file before timing")
    args = ap.parse_args()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    torch.manual_seed(0)
    t0 = time.time()
    cases = make_cases()
    for _, _, fn, _, _ in cases:
        fn()
    torch.cuda.synchronize()
    print(f"peers: {len(cases)} cases warm in {time.time() - t0:.1f} s", flush=True)
    if args.ready:
        open(args.ready, "w").close()
    if args.go:
        while not os.path.exists(args.go):
            time.sleep(0.2)
    for kernel, shape, fn, nbytes, flops in cases:
        report(kernel, shape, bench(fn), nbytes, flops)
    print(f"peers done in {time.time() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
