#!/usr/bin/env python3
"""PyTorch peer of bench/fp8_moe_bench.cu: W8A8 static FP8 routed experts with torch._scaled_mm, printed in
chimera_bench's format.

  moe_experts_fp8-torch-scaled-mm   per active expert: x rows / in_up -> e4m3, torch._scaled_mm (per-tensor scales,
                                    bf16 out), relu^2, / in_down -> e4m3, torch._scaled_mm, weighted index_add_

Timing as chimera_bench: CUDA events around each call, 5 warm-up calls, median of 50 (20 for slow cases).
Bytes / flops as fp8_moe_bench.cu (weights of the experts routed to, 1 byte each, x and out; 2 GEMMs x 2 x T*k*I*D).
"""
import math
import sys

import torch
import torch.nn.functional as F

from moe_peers import router, time_us
from peer_report import report

E4M3 = torch.float8_e4m3fn


def quant(v, scale):
    return (v.float() / scale).clamp(-448.0, 448.0).to(E4M3)


def moe_fp8(x, ids, w, up, s_up, in_up, down, s_down, in_down):
    T, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=up.shape[0]).tolist()
    out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start:start + n]
        start += n
        tok = pairs // k
        xq = quant(x[tok], in_up[e])
        h = torch._scaled_mm(xq, up[e].t(), scale_a=in_up[e], scale_b=s_up[e], out_dtype=torch.bfloat16)
        r = F.relu(h) ** 2
        y = torch._scaled_mm(quant(r, in_down[e]), down[e].t(), scale_a=in_down[e], scale_b=s_down[e],
                             out_dtype=torch.float32)
        out.index_add_(0, tok, y * w.reshape(-1)[pairs, None])
    return out.to(x.dtype)


def bench(model, E, k, D, I, scale, tokens):
    bu, bd = math.sqrt(3.0 / D), math.sqrt(3.0 / I)
    up = ((torch.rand(E, I, D, device="cuda") * 2 - 1) * 448.0).to(E4M3)
    down = ((torch.rand(E, D, I, device="cuda") * 2 - 1) * 448.0).to(E4M3)
    s_up = torch.full((E,), bu / 448.0, device="cuda")
    s_down = torch.full((E,), bd / 448.0, device="cuda")
    in_up = torch.full((E,), 4.5 / 448.0, device="cuda")
    in_down = torch.full((E,), 20.0 / 448.0, device="cuda")
    bias = torch.randn(E, device="cuda") * 0.05
    for T in tokens:
        ids, w = router(torch.randn(T, E, device="cuda") * 2.0, bias, k, scale)
        x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
        touched = int(torch.unique(ids).numel())
        nbytes = touched * 2 * I * D + 2 * T * D * 2
        flops = 2 * 2 * T * k * I * D
        shape = f"{model} E={E} k={k} D={D} I={I} T={T}"
        try:
            us = time_us(lambda: moe_fp8(x, ids, w, up, s_up, in_up, down, s_down, in_down), 20)
            report("moe_experts_fp8-torch-scaled-mm", shape, us, nbytes, flops)
        except Exception as exc:  # noqa: BLE001
            print(f"BENCH-SKIP kernel=moe_experts_fp8-torch-scaled-mm shape={shape} "
                  f"reason={type(exc).__name__}: {str(exc)[:200]}")


def main():
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}", flush=True)
    what = sys.argv[1:] or ["nano", "super"]
    if "nano" in what:
        bench("nano", 128, 6, 2688, 1856, 2.5, (1, 8, 64, 1024, 4096))
    if "super" in what:
        bench("super", 512, 22, 1024, 2688, 5.0, (1, 8, 64, 1024))


if __name__ == "__main__":
    main()
