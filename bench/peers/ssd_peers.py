#!/usr/bin/env python3
"""Peers of bench/ssd_bench.cu: the same SSD prefill shapes in
  * mamba_ssm's Triton `mamba_chunk_scan_combined` (the bar; source unpacked into .peers/, see below),
  * a PyTorch eager chunked SSD in the style of HF's torch_forward (fp32 math, segsum inter-chunk pass),
  * the same function under torch.compile,
printing lines in chimera_bench's format:
  BENCH kernel=<name> shape=<same shape text> us=<median> gbps=<x> tflops=<y> floor_ratio=<r>

mamba_ssm: `pip download mamba-ssm --no-deps --no-binary :all:`, unpack only the `mamba_ssm` package into
<repo>/.peers/, replace mamba_ssm/__init__.py by an empty file (the Triton kernels need no compiled
extension). Timing: triton.testing.do_bench (CUDA events), median. --budget caps the seconds spent
(torch.compile of each shape is the slow part; cases past the budget are skipped and say so).
"""
import argparse
import pathlib
import sys
import time

import torch
import torch.nn.functional as F
import triton

from peer_report import report

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / ".peers"))

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

P, N, G, Q = 64, 128, 8, 128


def flops_bytes(T, H, S=1):
    chunks = S * ((T // S + Q - 1) // Q)
    flops = chunks * (H * (4.0 * Q * P * N + 2.0 * Q * Q * P) + G * 2.0 * Q * Q * N)
    nbytes = 2.0 * (2.0 * T * H * P + T * H + 2.0 * T * G * N) + 2.0 * 4.0 * S * H * P * N
    return flops, nbytes


def inputs(T, H, S=1):
    g = torch.Generator(device="cuda").manual_seed(T * 1000 + H)
    dev = "cuda"
    L = T // S

    def u(shape, lo, hi, dtype):
        return (torch.rand(shape, generator=g, device=dev) * (hi - lo) + lo).to(dtype)
    x = u((S, L, H, P), -1, 1, torch.bfloat16)
    dt = u((S, L, H), -1, 1, torch.bfloat16)
    B = u((S, L, G, N), -0.5, 0.5, torch.bfloat16)
    C = u((S, L, G, N), -0.5, 0.5, torch.bfloat16)
    A = -torch.exp(u((H,), 0, 2.5, torch.float32))
    D = u((H,), -1, 1, torch.float32)
    dt_bias = u((H,), -4, -1, torch.float32)
    init = u((S, H, P, N), -0.5, 0.5, torch.float32)
    return x, dt, A, B, C, D, dt_bias, init


def ssd_torch(x, dt, A, B, C, D, dt_bias, init):
    """Chunked SSD (docs/model.md 3.4) in fp32 torch ops, HF torch_forward style: exp(segsum) intra-chunk,
    chunk states by einsum, the inter-chunk pass as one exp(segsum) matrix over chunks. x [b, T, H, P] with
    T a multiple of Q; returns y (bf16) and the final state [b, H, P, N] (fp32)."""
    b, T, H, _ = x.shape
    hpg = H // G
    nc = T // Q
    dt = F.softplus(dt.float() + dt_bias)                                    # [b, T, H]
    xc = x.float().view(b, nc, Q, G, hpg, P)
    dtc = dt.view(b, nc, Q, G, hpg)
    Bc = B.float().view(b, nc, Q, G, N)
    Cc = C.float().view(b, nc, Q, G, N)
    acs = torch.cumsum(dtc * A.view(G, hpg), dim=2).permute(0, 1, 3, 4, 2)  # [b, c, g, j, l]
    tril = torch.ones(Q, Q, dtype=torch.bool, device=x.device).tril()
    Lm = torch.exp(acs[..., :, None] - acs[..., None, :]).masked_fill(~tril, 0.0)  # [b, c, g, j, l, s]
    CB = torch.einsum("bclgn,bcsgn->bcgls", Cc, Bc)                           # [b, c, g, l, s]
    M = CB[:, :, :, None] * Lm * dtc.permute(0, 1, 3, 4, 2)[..., None, :]
    y_diag = torch.einsum("bcgjls,bcsgjp->bclgjp", M, xc)
    decay_states = torch.exp(acs[..., -1:] - acs) * dtc.permute(0, 1, 3, 4, 2)  # [b, c, g, j, l]
    states = torch.einsum("bclgn,bcgjl,bclgjp->bcgjpn", Bc, decay_states, xc)
    states = torch.cat([init.view(b, 1, G, hpg, P, N), states], dim=1)      # [b, c + 1, g, j, p, n]
    a_last = F.pad(acs[..., -1].permute(0, 2, 3, 1), (1, 0))                 # [b, g, j, c + 1], 0 first
    seg = torch.cumsum(a_last, dim=-1)                                       # decay from chunk c to z
    tril_c = torch.ones(nc + 1, nc + 1, dtype=torch.bool, device=x.device).tril()
    decay_chunk = torch.exp(seg[..., :, None] - seg[..., None, :]).masked_fill(~tril_c, 0.0)  # [b, g, j, z, c]
    new_states = torch.einsum("bgjzc,bcgjpn->bzgjpn", decay_chunk, states)
    s_in, final = new_states[:, :-1], new_states[:, -1]
    y_off = torch.einsum("bclgn,bcgjpn,bcgjl->bclgjp", Cc, s_in, torch.exp(acs))
    y = (y_diag + y_off).reshape(b, T, H, P) + D.view(1, 1, H, 1) * x.float()
    return y.to(torch.bfloat16), final.reshape(b, H, P, N)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=170.0, help="seconds for the whole script")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--ready", help="file to create once every peer is compiled / autotuned (warm)")
    ap.add_argument("--go", help="file to wait for before timing (so nothing else runs on the GPU meanwhile)")
    ap.add_argument("--stop", help="file whose presence stops further warm-ups (the GPU is about to be timed)")
    args = ap.parse_args()
    t_start = time.time()
    left = lambda: args.budget - (time.time() - t_start)  # noqa: E731
    print(f"peers: torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}",
          flush=True)
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except Exception as e:  # noqa: BLE001
        mamba_chunk_scan_combined = None
        print(f"peers: mamba_ssm not importable ({e}); put its python package into {REPO / '.peers'}")

    cases = [(T, H, model) for model, H in (("nano", 64), ("super", 128)) for T in (1024, 8192, 32768)]
    shape_of = lambda T, H: f"T={T} H={H} P=64 N=128 G=8 Q=128 bf16"  # noqa: E731

    def mamba(x, dt, A, B, C, D, dt_bias, init):
        return mamba_chunk_scan_combined(x, dt, A, B, C, Q, D=D, dt_bias=dt_bias, initial_states=init,
                                         dt_softplus=True, return_final_states=True)
    compiled = None if args.no_compile else torch.compile(ssd_torch, dynamic=False)
    go = lambda: args.go is None or pathlib.Path(args.go).exists()  # noqa: E731
    stop = lambda: go() or (args.stop is not None and pathlib.Path(args.stop).exists())  # noqa: E731

    # Warm-up: Triton autotuning and first calls, the torch check, then torch.compile (largest shapes first)
    # while the budget lasts and the timing phase has not been called.
    warm_compiled = set()
    with torch.no_grad():
        for i, (T, H, model) in enumerate(cases):
            args_ = inputs(T, H)
            if mamba_chunk_scan_combined is not None and not stop():
                t0 = time.time()
                y_ref, s_ref = mamba(*args_)
                torch.cuda.synchronize()
                print(f"peers: mamba_ssm warm-up {shape_of(T, H)}: {time.time() - t0:.1f} s", flush=True)
                if i == 0:  # the torch peer computes the same function
                    y_t, s_t = ssd_torch(*args_)
                    err = ((y_t.float() - y_ref.float()).norm() / y_ref.float().norm()).item()
                    serr = ((s_t - s_ref).norm() / s_ref.norm()).item()
                    print(f"peers: torch vs mamba_ssm at {shape_of(T, H)}: rel err y {err:.2e}, final state {serr:.2e}",
                          flush=True)
            del args_
        torch.cuda.empty_cache()
        for T, H, model in sorted(cases, key=lambda c: (-c[0], -c[1])):
            if compiled is None or stop() or left() < 60:
                break
            t0 = time.time()
            compiled(*inputs(T, H))
            torch.cuda.synchronize()
            warm_compiled.add((T, H))
            print(f"peers: torch.compile warm-up {shape_of(T, H)}: {time.time() - t0:.1f} s", flush=True)
            torch.cuda.empty_cache()
    if args.ready:
        pathlib.Path(args.ready).touch()
    while not go() and left() > 0:
        time.sleep(0.2)

    # Timing, alone on the GPU.
    with torch.no_grad():
        for T, H, model in cases:
            if left() < 5:
                print(f"peers: out of budget before {shape_of(T, H)}", flush=True)
                break
            shape = shape_of(T, H)
            flops, nbytes = flops_bytes(T, H)
            a = inputs(T, H)
            if mamba_chunk_scan_combined is not None:
                ms = triton.testing.do_bench(lambda: mamba(*a), warmup=25, rep=100, return_mode="median")
                report(f"ssd_chunk_scan-{model}-mamba-triton", shape, ms * 1e3, nbytes, flops)
            ms = triton.testing.do_bench(lambda: ssd_torch(*a), warmup=3, rep=20, return_mode="median")
            report(f"ssd_chunk_scan-{model}-torch-eager", shape, ms * 1e3, nbytes, flops)
            if (T, H) in warm_compiled:
                ms = triton.testing.do_bench(lambda: compiled(*a), warmup=3, rep=20, return_mode="median")
                report(f"ssd_chunk_scan-{model}-torch-compile", shape, ms * 1e3, nbytes, flops)
            elif compiled is not None:
                print(f"peers: torch.compile not timed at {shape} (not compiled within the budget)", flush=True)
            del a
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
