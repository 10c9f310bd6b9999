#!/usr/bin/env python3
"""PyTorch peers of bench/moe_bench.cu: the same MoE ops at the same shapes, printed in chimera_bench's format.

  router_topk-torch-eager / -torch-compile   sigmoid, + bias, topk (sorted), gather, normalise, scale
  moe_experts-torch-loop                     HF eager NemotronHExperts: loop over the routed experts, index_add_
  moe_experts-torch-grouped-mm               HF "grouped_mm" experts (torch._grouped_mm), when torch has it

Timing as chimera_bench: CUDA events around each call, 5 warm-up calls, median of 50 (20 for slow peers).
Bytes / flops as chimera_bench (weights of the experts actually routed to, x and out; 2 GEMMs x 2 x T*k*I*D).
"""
import math
import sys

import torch
import torch.nn.functional as F

from peer_report import report

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


def time_us(fn, iters=50, warmup=5):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0)
    times.sort()
    return times[len(times) // 2]


# ---- router -------------------------------------------------------------------------------------------------
def router(logits, bias, k: int, scale: float):
    scores = logits.sigmoid()
    choice = scores + bias
    idx = torch.topk(choice, k, dim=-1, sorted=True).indices
    w = scores.gather(1, idx)
    w = w / (w.sum(dim=-1, keepdim=True) + 1e-20) * scale
    return idx, w


def bench_router():
    compiled = torch.compile(router, dynamic=True)
    for E, k, scale in ((512, 22, 5.0), (128, 6, 2.5)):
        bias = torch.randn(E, device="cuda") * 0.05
        for T in (1, 16, 64, 256, 1024, 4096):
            logits = torch.randn(T, E, device="cuda") * 2.0
            shape = f"E={E} k={k} T={T}"
            nbytes = T * E * 4 + E * 4 + T * k * 8
            report("router_topk-torch-eager", shape, time_us(lambda: router(logits, bias, k, scale)), nbytes, 0)
            try:
                report("router_topk-torch-compile", shape, time_us(lambda: compiled(logits, bias, k, scale)),
                       nbytes, 0)
            except Exception as exc:  # noqa: BLE001 - a peer that fails is reported, not fatal
                print(f"BENCH-SKIP kernel=router_topk-torch-compile shape={shape} reason={type(exc).__name__}: {exc}")


# ---- experts ------------------------------------------------------------------------------------------------
def moe_loop(x, ids, w, up, down):
    """HF eager NemotronHExperts: per routed expert, gather its tokens, up, relu2, down, scale, index_add_."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for e in torch.unique(ids).tolist():
        tok, slot = torch.where(ids == e)
        h = F.relu(x[tok] @ up[e].t()) ** 2
        y = (h @ down[e].t()).float() * w[tok, slot, None]
        out.index_add_(0, tok, y)
    return out.to(x.dtype)


def moe_grouped_mm(x, ids, w, up, down):
    """HF grouped_mm experts: sort the pairs by expert, two torch._grouped_mm calls, weighted index_add_."""
    T, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tok = order // k
    counts = torch.bincount(flat, minlength=up.shape[0])
    offs = torch.cumsum(counts, 0).to(torch.int32)
    h = torch._grouped_mm(x[tok], up.transpose(1, 2), offs=offs)
    h = F.relu(h) ** 2
    y = torch._grouped_mm(h, down.transpose(1, 2), offs=offs)
    y = y.float() * w.reshape(-1)[order, None]
    out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device).index_add_(0, tok, y)
    return out.to(x.dtype)


def bench_experts(model, E, k, D, I, scale, tokens):
    up = (torch.rand(E, I, D, device="cuda", dtype=torch.bfloat16) * 2 - 1) * (math.sqrt(3.0 / D))
    down = (torch.rand(E, D, I, device="cuda", dtype=torch.bfloat16) * 2 - 1) * (math.sqrt(3.0 / I))
    bias = torch.randn(E, device="cuda") * 0.05
    for T in tokens:
        ids, w = router(torch.randn(T, E, device="cuda") * 2.0, bias, k, scale)
        x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
        touched = int(torch.unique(ids).numel())
        nbytes = touched * 2 * I * D * 2 + 2 * T * D * 2
        flops = 2 * 2 * T * k * I * D
        shape = f"{model} E={E} k={k} D={D} I={I} T={T} x=BF16"
        slow = E * 1 > 200 or T >= 1024
        report("moe_experts-torch-loop", shape, time_us(lambda: moe_loop(x, ids, w, up, down), 20 if slow else 50),
               nbytes, flops)
        if hasattr(torch, "_grouped_mm"):
            try:
                report("moe_experts-torch-grouped-mm", shape,
                       time_us(lambda: moe_grouped_mm(x, ids, w, up, down)), nbytes, flops)
            except Exception as exc:  # noqa: BLE001
                print(f"BENCH-SKIP kernel=moe_experts-torch-grouped-mm shape={shape} "
                      f"reason={type(exc).__name__}: {str(exc)[:200]}")
    del up, down
    torch.cuda.empty_cache()


def main():
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}", flush=True)
    what = sys.argv[1:] or ["router", "experts"]
    if "experts" in what:
        bench_experts("nano", 128, 6, 2688, 1856, 2.5, (1, 64, 1024))
        bench_experts("super", 512, 22, 1024, 2688, 5.0, (1, 64, 1024))
    if "router" in what:
        bench_router()


if __name__ == "__main__":
    main()
