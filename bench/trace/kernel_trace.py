#!/usr/bin/env python3
"""Where a CUDA-graph replay spends its time, from the CSV of bench/trace/kernel_trace.cpp.

For each captured graph it splits the kernel records into replays (one replay = every node of the graph once, in
start order), takes the median replay by span, and charges each kernel its critical-path time: end(i) - end(i-1)
in completion order (what the step would lose without it, given PDL overlap), next to its own duration (first
block start to last block end, which includes any time spent waiting in griddepcontrol.wait).

Usage: python3 bench/trace/kernel_trace.py trace.csv [--graph ID] [--rows N]
"""
import argparse
import csv
import re
import statistics
from collections import defaultdict


def short_name(name):
    # "void chimera::cuda::moe::(anonymous namespace)::moe_gemv_kernel<__nv_bfloat16; 1; true>(...)" ->
    # "moe_gemv_kernel<__nv_bfloat16; 1; true>"
    s = re.sub(r"^void ", "", name).replace("(anonymous namespace)::", "")
    depth, cut = 0, len(s)
    for i, c in enumerate(s):  # drop the argument list
        if c == "<":
            depth += 1
        elif c == ">":
            depth -= 1
        elif c == "(" and depth == 0:
            cut = i
            break
    s = s[:cut]
    base, _, targs = s.partition("<")
    base = base.split("::")[-1]
    return base + ("<" + targs[:70] if targs else "")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--graph", type=int, default=None, help="only this graph id")
    ap.add_argument("--rows", type=int, default=0, help="also list the first N kernels of the median replay")
    args = ap.parse_args()
    by_graph = defaultdict(list)
    with open(args.csv) as f:
        for r in csv.DictReader(f):
            g = int(r["graph_id"])
            if g == 0:
                continue
            by_graph[g].append((int(r["start_ns"]), int(r["end_ns"]), int(r["graph_node_id"]), short_name(r["name"]),
                                int(r["grid_x"]) * int(r["grid_y"]) * int(r["grid_z"])))
    for g, recs in sorted(by_graph.items()):
        if args.graph is not None and g != args.graph:
            continue
        recs.sort()
        n = len({r[2] for r in recs})
        replays = [recs[i:i + n] for i in range(0, len(recs) - n + 1, n)]
        if not replays:
            continue
        spans = [max(r[1] for r in rp) - min(r[0] for r in rp) for rp in replays]
        med = sorted(range(len(replays)), key=lambda i: spans[i])[len(replays) // 2]
        rp = sorted(replays[med], key=lambda r: r[1])  # completion order
        t0 = min(r[0] for r in rp)
        print(f"graph {g}: {n} kernels, {len(replays)} replays, span median {statistics.median(spans) / 1e3:.1f} us "
              f"(min {min(spans) / 1e3:.1f}, max {max(spans) / 1e3:.1f})")
        crit, dur, count = defaultdict(float), defaultdict(float), defaultdict(int)
        prev_end = t0
        rows = []
        for s, e, node, name, blocks in rp:
            d = max(0, e - prev_end)
            crit[name] += d
            dur[name] += e - s
            count[name] += 1
            rows.append((s - t0, e - t0, d, e - s, blocks, name))
            prev_end = max(prev_end, e)
        total = sum(crit.values())
        print(f"  {'critical us':>11} {'share':>6} {'calls':>5} {'us/call':>8} {'own us/call':>11}  kernel")
        for name in sorted(crit, key=lambda k: -crit[k]):
            print(f"  {crit[name] / 1e3:11.1f} {100 * crit[name] / total:5.1f}% {count[name]:5d} "
                  f"{crit[name] / 1e3 / count[name]:8.2f} {dur[name] / 1e3 / count[name]:11.2f}  {name}")
        for s, e, d, own, blocks, name in rows[:args.rows]:
            print(f"    start {s / 1e3:8.2f} end {e / 1e3:8.2f} crit {d / 1e3:6.2f} own {own / 1e3:6.2f} "
                  f"blocks {blocks:6d}  {name}")


if __name__ == "__main__":
    main()
