#!/usr/bin/env python3
"""Peers of bench/mamba_bench.cu on the same shapes, printed in the chimera_bench format:

  BENCH kernel=<name>-<peer> shape=<same shape text> us=<median> gbps=<x> tflops=0.00 floor_ratio=<r>

Peers: PyTorch eager and torch.compile of the selective state update (SSU) and of the causal conv1d (prefill
and one-token update), and mamba_ssm's Triton `selective_state_update` (state-spaces/mamba, the Python
package unpacked into .peers/ by hand: it needs no compiled extension). Times: triton.testing.do_bench
median (CUDA events, L2 flushed before each call). Bytes and floor ratio as in mamba_bench.cu.

--ready FILE / --go FILE: compile and warm every case first, touch FILE, then wait for --go FILE before timing
(so torch.compile can run while the C++ build does; the timed phase runs alone on the GPU).
"""
import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton.testing

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", ".peers"))
try:
    from mamba_ssm.ops.triton.selective_state_update import selective_state_update as mamba_ssu
except Exception as e:  # noqa: BLE001 - report and carry on with the torch peers
    print(f"peers: mamba_ssm Triton SSU unavailable: {e!r}", flush=True)
    mamba_ssu = None

COPY_GBS = 4200.0
DEV = "cuda"
NAME = {torch.float32: "f32", torch.bfloat16: "bf16"}

MODELS = [("super", 128, 64, 128, 8), ("nano", 64, 64, 128, 8)]
BATCHES = [1, 8, 64, 256]
CONV_C, CONV_K = 10240, 4


def report(kernel, shape, us, nbytes):
    gbps = nbytes / (us * 1e-6) / 1e9
    print(f"BENCH kernel={kernel} shape={shape} us={us:.2f} gbps={gbps:.1f} tflops=0.00 "
          f"floor_ratio={gbps / COPY_GBS:.3f}", flush=True)


def time_us(fn):
    return 1000.0 * triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


# ---- selective state update ------------------------------------------------------------------------
def ssu_torch(state, x, dt, A, B, C, D, dt_bias, slots):
    """state [S, H, P, N]; x [b, H, P]; dt [b, H]; A, D, dt_bias [H] f32; B, C [b, G, N]; slots [b] int64."""
    H, G = x.shape[1], B.shape[1]
    s = state.index_select(0, slots).float()
    dtv = F.softplus(dt.float() + dt_bias)
    dA = torch.exp(dtv * A)
    Bh = B.float().repeat_interleave(H // G, dim=1)
    Ch = C.float().repeat_interleave(H // G, dim=1)
    xf = x.float()
    s = s * dA[:, :, None, None] + (dtv[:, :, None] * xf)[..., None] * Bh[:, :, None, :]
    state.index_copy_(0, slots, s.to(state.dtype))
    y = torch.einsum("bhpn,bhn->bhp", s, Ch) + D[None, :, None] * xf
    return y.to(x.dtype)


ssu_compiled = torch.compile(ssu_torch, dynamic=True)


def ssu_case(model, batch, state_dtype):
    name, H, P, N, G = model
    act = torch.bfloat16
    shape = f"{name}_H{H}_P{P}_N{N}_G{G}_b{batch}_state-{NAME[state_dtype]}_act-bf16"
    esz = torch.tensor([], dtype=state_dtype).element_size()
    nbytes = 2.0 * batch * H * P * N * esz + (2.0 * batch * H * P + batch * H + 2.0 * batch * G * N) * 2
    g = torch.Generator(device=DEV).manual_seed(batch)
    state = (torch.rand(batch, H, P, N, device=DEV, generator=g) * 2 - 1).to(state_dtype)
    x = (torch.rand(batch, H, P, device=DEV, generator=g) * 2 - 1).to(act)
    dt = (torch.rand(batch, H, device=DEV, generator=g) * -3).to(act)
    B = (torch.rand(batch, G, N, device=DEV, generator=g) * 2 - 1).to(act)
    C = (torch.rand(batch, G, N, device=DEV, generator=g) * 2 - 1).to(act)
    A = -torch.exp(torch.rand(H, device=DEV, generator=g) * 2)
    D = torch.rand(H, device=DEV, generator=g) * 2 - 1
    dt_bias = torch.rand(H, device=DEV, generator=g) * -2
    slots = torch.randperm(batch, device=DEV, generator=g)
    fns = {
        "ssu-torch-eager": lambda: ssu_torch(state, x, dt, A, B, C, D, dt_bias, slots),
        "ssu-torch-compile": lambda: ssu_compiled(state, x, dt, A, B, C, D, dt_bias, slots),
    }
    if mamba_ssu is not None:
        A3 = A[:, None, None].expand(H, P, N)
        D2 = D[:, None].expand(H, P)
        bias2 = dt_bias[:, None].expand(H, P)
        dt3 = dt[:, :, None].expand(batch, H, P)
        slots32 = slots.to(torch.int32)
        fns["ssu-mamba-ssm-triton"] = lambda: mamba_ssu(state, x, dt3, A3, B, C, D=D2, z=None, dt_bias=bias2,
                                                        dt_softplus=True, state_batch_indices=slots32)
    return shape, nbytes, fns


# ---- causal conv1d ---------------------------------------------------------------------------------
def conv_prefill_torch(x, w, b, conv_state, slots):
    """x [n * L, C] (n equal-length sequences); w [C, 1, K]; b [C]; conv_state [S, C, K-1]; slots [n]."""
    n, C, K = slots.shape[0], x.shape[1], w.shape[-1]
    xt = x.view(n, -1, C).transpose(1, 2)                               # [n, C, L]
    hist = torch.cat([conv_state.index_select(0, slots).to(x.dtype), xt], dim=-1)
    y = F.conv1d(hist, w, b, groups=C)                                  # [n, C, L]
    conv_state.index_copy_(0, slots, hist[:, :, -(K - 1):].to(conv_state.dtype))
    return F.silu(y).transpose(1, 2).reshape(-1, C)


def conv_update_torch(x, w, b, conv_state, slots):
    """x [batch, C]: one token per slot."""
    st = conv_state.index_select(0, slots)
    hist = torch.cat([st, x.unsqueeze(-1).to(st.dtype)], dim=-1)        # [batch, C, K]
    y = (hist.float() * w[:, 0, :].float()).sum(-1) + b.float()
    conv_state.index_copy_(0, slots, hist[:, :, 1:])
    return F.silu(y).to(x.dtype)


conv_prefill_compiled = torch.compile(conv_prefill_torch, dynamic=True)
conv_update_compiled = torch.compile(conv_update_torch, dynamic=True)


def conv_prefill_case(n_seqs, seq_len):
    C, K, act = CONV_C, CONV_K, torch.bfloat16
    T = n_seqs * seq_len
    shape = f"super_C{C}_K4_T{T}_seqs{n_seqs}_act-bf16"
    nbytes = 2.0 * T * C * 2 + 2.0 * n_seqs * C * (K - 1) * 2 + C * (K + 1) * 2.0
    x = torch.rand(T, C, device=DEV).to(act) * 2 - 1
    w = (torch.rand(C, 1, K, device=DEV) - 0.5).to(act)
    b = (torch.rand(C, device=DEV) - 0.5).to(act)
    state = (torch.rand(n_seqs, C, K - 1, device=DEV) * 2 - 1).to(act)
    slots = torch.arange(n_seqs, device=DEV)
    return shape, nbytes, {
        "conv1d-prefill-torch-eager": lambda: conv_prefill_torch(x, w, b, state, slots),
        "conv1d-prefill-torch-compile": lambda: conv_prefill_compiled(x, w, b, state, slots),
    }


def conv_update_case(batch):
    C, K, act = CONV_C, CONV_K, torch.bfloat16
    shape = f"super_C{C}_K4_b{batch}_act-bf16"
    nbytes = 2.0 * batch * C * 2 + 2.0 * batch * C * (K - 1) * 2 + C * (K + 1) * 2.0
    x = (torch.rand(batch, C, device=DEV) * 2 - 1).to(act)
    w = (torch.rand(C, 1, K, device=DEV) - 0.5).to(act)
    b = (torch.rand(C, device=DEV) - 0.5).to(act)
    state = (torch.rand(batch, C, K - 1, device=DEV) * 2 - 1).to(act)
    slots = torch.randperm(batch, device=DEV)
    return shape, nbytes, {
        "conv1d-update-torch-eager": lambda: conv_update_torch(x, w, b, state, slots),
        "conv1d-update-torch-compile": lambda: conv_update_compiled(x, w, b, state, slots),
    }


def cases():
    for model in MODELS:
        for sd in (torch.float32, torch.bfloat16):
            for batch in BATCHES:
                yield lambda m=model, b=batch, s=sd: ssu_case(m, b, s)
    for tokens in (1024, 8192, 32768):
        yield lambda t=tokens: conv_prefill_case(1, t)
    yield lambda: conv_prefill_case(8, 1024)
    for batch in (1, 64, 256):
        yield lambda b=batch: conv_update_case(b)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ready", help="touch this file once every case is compiled and warm")
    ap.add_argument("--go", help="wait for this file before timing")
    ap.add_argument("--go-timeout", type=float, default=400.0)
    args = ap.parse_args()
    print(f"peers: torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}",
          flush=True)

    t0 = time.time()
    for make in cases():  # compile + warm: every function once per shape
        shape, _, fns = make()
        for name, fn in fns.items():
            try:
                fn()
            except Exception as e:  # noqa: BLE001
                print(f"peers: warm-up of {name} {shape} failed: {e!r}", flush=True)
        del fns
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    print(f"peers: warm-up done in {time.time() - t0:.1f} s", flush=True)
    if args.ready:
        open(args.ready, "w").close()
    if args.go:
        deadline = time.time() + args.go_timeout
        while not os.path.exists(args.go) and time.time() < deadline:
            time.sleep(0.2)

    for make in cases():
        shape, nbytes, fns = make()
        for name, fn in fns.items():
            try:
                report(name, shape, time_us(fn), nbytes)
            except Exception as e:  # noqa: BLE001
                print(f"peers: {name} {shape} failed: {e!r}", flush=True)
        del fns
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
