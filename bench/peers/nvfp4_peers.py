#!/usr/bin/env python3
"""PyTorch peers of bench/nvfp4_bench.cu's dense cases, printed in the chimera_bench format:

  BENCH kernel=linear_bf16-torch shape=<same shape text> us=<median> gbps=<x> tflops=<y> floor_ratio=<r>

torch.nn.functional.linear on the bf16 weight of the same shape (cuBLAS through PyTorch): the denominator of the
"ratio to bf16 cuBLAS / torch" for the NVFP4 GEMM, and the bf16 decode baseline. Bytes as in nvfp4_bench.cu (the
bf16 weight + x + out). Times: triton.testing.do_bench median (CUDA events, L2 flushed before each call).
"""
import torch
import torch.nn.functional as F
import triton.testing

COPY_GBS = 4200.0
BF16_TFLOPS = 790.0
CASES = [("super_in_proj", 18560, 4096), ("super_out_proj", 4096, 8192), ("super_shared_up", 5376, 4096),
         ("nano_in_proj", 10304, 2688)]
TOKENS = [1, 2, 4, 8, 512, 2048, 8192]


def main():
    for name, n, k in CASES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for t in TOKENS:
            x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
            us = 1000.0 * triton.testing.do_bench(lambda: F.linear(x, w), warmup=10, rep=50, return_mode="median")
            nbytes = n * k * 2 + t * (k + n) * 2
            flops = 2.0 * t * n * k
            gbps = nbytes / (us * 1e-6) / 1e9
            tflops = flops / (us * 1e-6) / 1e12
            ratio = max(gbps / COPY_GBS, tflops / BF16_TFLOPS)
            print(f"BENCH kernel=linear_bf16-torch shape={name} N={n} K={k} T={t} x=bf16 us={us:.2f} "
                  f"gbps={gbps:.1f} tflops={tflops:.2f} floor_ratio={ratio:.3f}", flush=True)


if __name__ == "__main__":
    main()
