#!/usr/bin/env python3
"""PyTorch peers of bench/norm_bench.cu: the same ops on the same shapes, printed in the harness's format.

    BENCH kernel=<name>-torch-eager shape=<same text> us=<median> gbps=<x> tflops=<y> floor_ratio=<r>

add + RMSNorm and RMSNorm (eager and torch.compile), gated RMSNorm (eager and torch.compile) and linear
(torch.matmul, bf16, TF32 off). Times are triton.testing.do_bench medians (L2 flushed before each call).
torch.compile runs with dynamic=True (one compile per op instead of one per shape) and is skipped once
PEERS_COMPILE_BUDGET_S seconds (default 90) have gone by, so the script fits a short device call.
"""
import os
import time

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from peer_report import report

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

EPS = 1e-5
T0 = time.time()
COMPILE_BUDGET_S = float(os.environ.get("PEERS_COMPILE_BUDGET_S", "90"))
NORM_TOKENS = [1, 16, 64, 256, 1024, 4096, 16384]
NORM_HIDDEN = [2688, 4096, 8192]


def bench(fn):
    return 1000.0 * do_bench(fn, warmup=5, rep=25, return_mode="median")


def rms_norm(x, w):
    # HF LlamaRMSNorm / NemotronHRMSNorm.
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    return w * y.to(x.dtype)


def add_rms_norm(x, residual, w):
    h = residual + x
    return rms_norm(h, w), h


def gated_rms_norm(y, z, w, groups):
    # HF Zamba2RMSNormGated with norm_before_gate=False: gate first, then per-group RMSNorm.
    u = y.float() * F.silu(z.float())
    T, D = u.shape
    u = u.view(T, groups, D // groups)
    u = u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + EPS)
    return w * u.view(T, D).to(y.dtype)


def norm_cases(mode, wrap):
    """add + RMSNorm and RMSNorm over NORM_HIDDEN x NORM_TOKENS; gated RMSNorm at the Mamba shapes."""
    dev, bf16 = "cuda", torch.bfloat16
    for name, fn, n_in in (("add_rms_norm", add_rms_norm, 4), ("rms_norm", rms_norm, 2)):
        f = wrap(fn)
        for D in NORM_HIDDEN:
            w = torch.rand(D, device=dev, dtype=bf16) + 0.5
            for T in NORM_TOKENS:
                if mode == "torch-compile" and time.time() - T0 > COMPILE_BUDGET_S:
                    print(f"SKIP kernel={name}-{mode} shape=T={T} D={D} bf16 (compile budget spent)", flush=True)
                    continue
                x = torch.randn(T, D, device=dev, dtype=bf16)
                if name == "add_rms_norm":
                    r = torch.randn(T, D, device=dev, dtype=bf16)
                    us = bench(lambda: f(x, r, w))
                else:
                    us = bench(lambda: f(x, w))
                report(f"{name}-{mode}", f"T={T} D={D} bf16", us, n_in * T * D * 2 + D * 2)
    f = wrap(gated_rms_norm)
    for model, Di in (("nano", 4096), ("super", 8192)):
        w = torch.rand(Di, device=dev, dtype=bf16) + 0.5
        for T in (1, 64, 1024, 8192):
            if mode == "torch-compile" and time.time() - T0 > COMPILE_BUDGET_S:
                continue
            y = torch.randn(T, Di, device=dev, dtype=bf16)
            z = torch.randn(T, Di, device=dev, dtype=bf16)
            us = bench(lambda: f(y, z, w, 8))
            report(f"gated_rms_norm-{mode}", f"T={T} Di={Di} G=8 bf16 ({model})", us, 3 * T * Di * 2 + Di * 2)


def linear_cases():
    dev, bf16 = "cuda", torch.bfloat16
    projs = (("nano_in_proj", 2688, 10304), ("nano_out_proj", 4096, 2688), ("nano_lm_head", 2688, 131072),
             ("super_in_proj", 4096, 18560), ("super_out_proj", 8192, 4096), ("super_lm_head", 4096, 131072))
    for pname, fin, fout in projs:
        w = torch.randn(fout, fin, device=dev, dtype=bf16) / fin ** 0.5
        for T in (1, 64, 4096):
            x = torch.randn(T, fin, device=dev, dtype=bf16)
            us = bench(lambda: torch.matmul(x, w.t()))
            report("linear-torch-matmul", f"T={T} in={fin} out={fout} bf16 ({pname})", us,
                   2.0 * (fout * fin + T * fin + T * fout), 2.0 * T * fin * fout)


def main():
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    torch.manual_seed(0)
    # Cheap peers first, torch.compile last (its compiles dominate the script's time).
    norm_cases("torch-eager", lambda fn: fn)
    linear_cases()
    norm_cases("torch-compile", lambda fn: torch.compile(fn, dynamic=True))
    print(f"peers done in {time.time() - T0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
