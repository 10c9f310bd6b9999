#!/usr/bin/env python3
"""PyTorch peers of bench/allreduce_bench.cu (chimera_bench allreduce_latency) on 2 GPUs, same line format:

    BENCH kernel=allreduce_<peer> shape=h<hidden>xt<tokens> us=<median per call> gbps=0 tflops=0 floor_ratio=0 took=<timing>

Peers (bf16, hidden {2688, 4096, 8192} x tokens {1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096}):
  torch_nccl              dist.all_reduce (NCCL), AllReduce only: compare with allreduce_nccl_ar
  torch_nccl_add_rmsnorm  dist.all_reduce + residual add + RMSNorm in eager PyTorch (the unfused baseline)
  symm_one_shot           torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group) (symmetric memory, no norm)
  symm_two_shot           torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", group) (in place, no norm)
Timing: each rank captures `calls` back-to-back calls in a CUDA graph (took=graph; eager launches between two
events if capture fails: took=eager), replays it 20 times after a barrier, median / calls; the slower rank's median
is printed (rank 0 prints). NVLink multicast stays off: TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NCCL_NVLS_ENABLE=0
are forced below, whatever the caller's environment says.

    python3 bench/peers/allreduce_peers.py        # spawns 2 processes (torch.multiprocessing), needs 2 GPUs
"""
import os

# Never enable NVLink multicast on the shared hosts (docs/build.md 9): set before torch / NCCL start,
# inherited by the spawned processes.
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NCCL_NVLS_ENABLE"] = "0"

import socket  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

HIDDEN = [2688, 4096, 8192]
TOKENS = [1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096]
REPS = 20
EPS = 1e-5
WORLD = 2


def calls_for(nbytes):
    """As the C++ bench: ~50 calls a graph for small messages, fewer for large ones."""
    return max(4, min(50, (128 << 20) // max(nbytes, 1)))


def time_us(fn, calls):
    """Median microseconds per call on this rank, the max over ranks; and how it was timed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph, how = None, "graph"
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    except Exception:  # noqa: BLE001 - an op that cannot be captured is timed eagerly
        graph, how = None, "eager"
        torch.cuda.synchronize()
    # Both ranks must time the same way (an eager collective against a graphed one would still pair up, but the
    # comparison would not be like for like): eager if either rank could not capture.
    flag = torch.tensor([1 if graph is not None else 0], device="cuda")
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if flag.item() == 0:
        graph, how = None, "eager"
    times = []
    for _ in range(REPS):
        dist.barrier()
        torch.cuda.synchronize()
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        if graph is not None:
            graph.replay()
        else:
            for _ in range(calls):
                fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0 / calls)
    times.sort()
    mine = torch.tensor([times[len(times) // 2]], device="cuda")
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    del graph
    return mine.item(), how


def report(rank, name, hidden, tokens, result):
    if rank == 0:
        us, how = result
        print(f"BENCH kernel=allreduce_{name} shape=h{hidden}xt{tokens} us={us:.2f} gbps=0 tflops=0 floor_ratio=0 "
              f"took={how}", flush=True)


def worker(rank, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=WORLD, device_id=torch.device("cuda", rank))
    group_name = dist.group.WORLD.group_name
    symm_mem = None
    try:
        import torch.distributed._symmetric_memory as symm_mem  # noqa: PLC0415
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed before torch 2.8, a no-op / deprecated after
            symm_mem.enable_symm_mem_for_group(group_name)
    except Exception as e:  # noqa: BLE001
        if rank == 0:
            print(f"BENCH-ERROR kernel=allreduce_symm symmetric memory unavailable: {type(e).__name__}: {e}", flush=True)
        symm_mem = None
    if rank == 0:
        print(f"allreduce_peers: torch {torch.__version__}, NCCL {torch.cuda.nccl.version()}, "
              f"{torch.cuda.get_device_name(0)} x {WORLD}", flush=True)
    torch.manual_seed(rank)
    for hidden in HIDDEN:
        weight = torch.rand(hidden, device="cuda", dtype=torch.bfloat16) + 0.5
        for tokens in TOKENS:
            calls = calls_for(tokens * hidden * 2)
            x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
            residual = torch.randn_like(x)

            report(rank, "torch_nccl", hidden, tokens, time_us(lambda: dist.all_reduce(x), calls))

            def nccl_add_rmsnorm():
                dist.all_reduce(x)
                r = residual + x
                rf = r.float()
                return (rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + EPS)).to(torch.bfloat16) * weight

            report(rank, "torch_nccl_add_rmsnorm", hidden, tokens, time_us(nccl_add_rmsnorm, calls))

            if symm_mem is None:
                continue
            try:
                buf = symm_mem.empty((tokens, hidden), dtype=torch.bfloat16, device="cuda")
                symm_mem.rendezvous(buf, group_name)
                buf.copy_(x)
                report(rank, "symm_one_shot", hidden, tokens,
                       time_us(lambda: torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group_name), calls))
                # In place: the values double every call; bf16 saturates to inf after ~128 calls, which costs the
                # kernel nothing (the timing is of data movement, not of the values).
                report(rank, "symm_two_shot", hidden, tokens,
                       time_us(lambda: torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", group_name), calls))
            except Exception as e:  # noqa: BLE001 - report and keep going: one unsupported size must not end the run
                if rank == 0:
                    print(f"BENCH-ERROR kernel=allreduce_symm shape=h{hidden}xt{tokens} {type(e).__name__}: {e}",
                          flush=True)
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    if not torch.cuda.is_available() or torch.cuda.device_count() < WORLD:
        print(f"BENCH-SKIP allreduce peers: needs {WORLD} GPUs", flush=True)
        return 0
    mp.spawn(worker, args=(free_port(),), nprocs=WORLD, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
