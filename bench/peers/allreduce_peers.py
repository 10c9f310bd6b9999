#!/usr/bin/env python3
"""PyTorch peers of bench/allreduce_bench.cu on 2 GPUs, printed in the harness's format:

    BENCH kernel=allreduce_<peer> shape=h<hidden>xt<tokens> us=<median per call> gbps=0 tflops=0 floor_ratio=0

Peers (bf16, hidden {2688, 4096, 8192} x tokens {1, 2, 4, ..., 4096}):
  torch_nccl              dist.all_reduce (NCCL), AllReduce only
  torch_nccl_add_rmsnorm  dist.all_reduce + residual add + RMSNorm in eager PyTorch (the unfused baseline)
  symm_one_shot           torch.ops.symm_mem.one_shot_all_reduce (symmetric memory, AllReduce only)
  symm_two_shot           torch.ops.symm_mem.two_shot_all_reduce_ (in place, AllReduce only)
Times: 50 calls between two CUDA events after a barrier, median of 20 repetitions, the slower rank reported
(rank 0 prints). NVLink multicast stays off (forced below, whatever the caller's environment says).

    torchrun --nproc_per_node 2 bench/peers/allreduce_peers.py
"""
import os

# Never enable NVLink multicast on the shared hosts (.library/device/KINDS.md): set before torch / NCCL start.
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NCCL_NVLS_ENABLE"] = "0"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed._symmetric_memory as symm_mem  # noqa: E402

HIDDEN = [2688, 4096, 8192]
TOKENS = [1 << i for i in range(13)]  # 1 .. 4096
CALLS = 50
REPS = 20
EPS = 1e-5


def time_us(fn, group):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPS):
        dist.barrier(group=group)
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(CALLS):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0 / CALLS)
    times.sort()
    mine = torch.tensor([times[len(times) // 2]], device="cuda")
    dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group)
    return mine.item()


def report(rank, name, hidden, tokens, us):
    if rank == 0:
        print(f"BENCH kernel=allreduce_{name} shape=h{hidden}xt{tokens} us={us:.2f} gbps=0 tflops=0 floor_ratio=0",
              flush=True)


def main():
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    group = dist.group.WORLD
    group_name = group.group_name
    torch.manual_seed(rank)
    for hidden in HIDDEN:
        weight = torch.rand(hidden, device="cuda", dtype=torch.bfloat16) + 0.5
        for tokens in TOKENS:
            x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
            residual = torch.randn_like(x)

            report(rank, "torch_nccl", hidden, tokens, time_us(lambda: dist.all_reduce(x), group))

            def nccl_add_rmsnorm():
                dist.all_reduce(x)
                r = residual + x
                rf = r.float()
                return (rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + EPS)).to(torch.bfloat16) * weight

            report(rank, "torch_nccl_add_rmsnorm", hidden, tokens, time_us(nccl_add_rmsnorm, group))

            try:
                buf = symm_mem.empty((tokens, hidden), dtype=torch.bfloat16, device="cuda")
                symm_mem.rendezvous(buf, group_name)
                buf.copy_(x)
                report(rank, "symm_one_shot", hidden, tokens,
                       time_us(lambda: torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group_name), group))
                report(rank, "symm_two_shot", hidden, tokens,
                       time_us(lambda: torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", group_name), group))
            except Exception as e:  # noqa: BLE001 - report and keep going: one unsupported size must not end the run
                if rank == 0:
                    print(f"BENCH-ERROR kernel=allreduce_symm shape=h{hidden}xt{tokens} {type(e).__name__}: {e}",
                          flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
