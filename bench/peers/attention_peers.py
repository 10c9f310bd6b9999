#!/usr/bin/env python3
"""Peers of bench/attention_bench.cu: torch scaled_dot_product_attention (flash backend), eager and
torch.compile, on the same shapes with a dense (unpaged) KV cache. Prints lines in the harness format:

  BENCH kernel=<name>-torch-eager shape=<same shape text> us=<median> gbps=<x> tflops=<y> floor_ratio=<r>

Shapes (Nemotron 3 Nano / Super attention: 32 q heads, 2 kv heads, head_dim 128, bf16):
  attention_prefill: one causal sequence of 1K / 8K / 32K tokens -> TFLOP/s (4 * hd * Qh * T(T+1)/2)
  attention_decode:  batch 1 / 8 / 64 / 256, one query over ctx + 1 keys, ctx 1K / 8K -> GB/s of KV read
The flash backend is asked for GQA directly (enable_gqa=True); if this torch refuses that, k / v are
expanded to 32 heads outside the timed region and the kernel name says '-expandkv'.
"""
import torch
import torch.nn.functional as F
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

from peer_report import report

QH, KVH, HD = 32, 2, 128
HEADS = "Qh=32 KVh=2 hd=128 bf16 block=64"


def sdpa_fn(causal, gqa):
    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    return fn


def time_us(fn, q, k, v):
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        fn(q, k, v)
        torch.cuda.synchronize()
        ms = triton.testing.do_bench(lambda: fn(q, k, v), warmup=25, rep=100, return_mode="median")
    return ms * 1000.0


def run_case(name, shape, q, k, v, causal, nbytes, flops):
    gqa, suffix = True, ""
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            sdpa_fn(causal, True)(q, k, v)
    except RuntimeError:
        gqa, suffix = False, "-expandkv"
        k = k.repeat_interleave(QH // KVH, dim=1)
        v = v.repeat_interleave(QH // KVH, dim=1)
    eager = sdpa_fn(causal, gqa)
    report(f"{name}-torch-eager{suffix}", shape, time_us(eager, q, k, v), nbytes, flops)
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            compiled = torch.compile(eager)
            report(f"{name}-torch-compile{suffix}", shape, time_us(compiled, q, k, v), nbytes, flops)
    except Exception as e:  # report, keep going with the other shapes
        print(f"BENCH-ERROR kernel={name}-torch-compile shape={shape} {type(e).__name__}: {e}", flush=True)


def main():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch._dynamo.config.cache_size_limit = 64  # one static-shape compile per case, never an eager fallback
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    for T in (1024, 8192, 32768):
        q = torch.randn(1, QH, T, HD, device=dev, dtype=dt)
        k = torch.randn(1, KVH, T, HD, device=dev, dtype=dt)
        v = torch.randn(1, KVH, T, HD, device=dev, dtype=dt)
        flops = 4.0 * HD * QH * (T * (T + 1) / 2)
        nbytes = T * HD * 2 * (2 * QH + 4 * KVH)
        run_case("attention_prefill", f"T={T} {HEADS}", q, k, v, True, nbytes, flops)
        del q, k, v
    for ctx in (1024, 8192):
        for B in (1, 8, 64, 256):
            q = torch.randn(B, QH, 1, HD, device=dev, dtype=dt)
            k = torch.randn(B, KVH, ctx + 1, HD, device=dev, dtype=dt)
            v = torch.randn(B, KVH, ctx + 1, HD, device=dev, dtype=dt)
            nbytes = B * (ctx + 1) * KVH * HD * 2 * 2 + B * HD * 2 * (2 * QH + 2 * KVH)
            run_case("attention_decode", f"B={B} ctx={ctx} {HEADS}", q, k, v, False, nbytes, 0.0)
            del q, k, v
    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
