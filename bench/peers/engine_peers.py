#!/usr/bin/env python3
"""transformers peer of `chimera bench`: the same synthetic config, random weights, bf16, on the GPU, timed
through transformers' own generate().

The config is the one Chimera builds: `chimera info --synthetic PRESET [--num-layers N] --dump-config FILE`
writes it as a transformers config.json (the script runs that itself unless --config is given), so the shapes
are identical by construction. The model is created directly on the GPU (torch.device context; no 30B-parameter
init on the CPU) with transformers' own random init.

Measured (greedy, num_beams=1, every token forced by min_new_tokens = max_new_tokens, EOS never stops early):
  prefill  time to first token = generate(max_new_tokens=1) on one random prompt of each --input-lens length;
           tokens/s = input length / TTFT
  decode   at each --batch-sizes B, after a --decode-context-token random prompt per sequence:
           TPOT = (t(generate N new tokens) - t(generate 1 new token)) / (N - 1), tokens/s = B / TPOT
Every time is perf_counter around the call after torch.cuda.synchronize() on both sides; the best of
--repeats runs (the first run also warms the shape up). A warm-up generate at a small shape runs first.

Time budget: env PEER_TIME_LIMIT_S (default 240 s, model build included). Before each measurement the script
estimates its cost from what it has measured (prefill: the last TTFT scaled by the length ratio x 1.5 for
attention; decode: t(1) plus N x the last step time scaled by batch) and skips a size that would exceed the
budget, printing why.

Output, one line per measurement (parsed like chimera_bench's BENCH lines):
  PEER engine=transformers preset=P mode=prefill input_len=1024 ttft_ms=... tok_s=...
  PEER engine=transformers preset=P mode=decode batch=1 context=1024 new_tokens=32 tpot_ms=... tok_s=...
  PEER engine=transformers preset=P mode=... status=skipped reason="..."
and with --json-out FILE the same as JSON (with versions, attention / experts / Mamba implementations).

Usage (GPU machine, repository root, after building chimera):
  python3 bench/peers/engine_peers.py [--preset nemotron-3-nano-30b-a3b] [--num-layers N]
      [--input-lens 1024,8192,32768] [--batch-sizes 1,8] [--json-out FILE]
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def log(*a):
    print(*a, flush=True)


def ints(s):
    return [int(x) for x in s.split(",") if x.strip()]


def find_chimera():
    for d in ("build-dev", "build", "build-cpu"):
        p = os.path.join(REPO, d, "chimera")
        if os.access(p, os.X_OK):
            return p
    return None


def decode_hf_floats(o):
    """transformers writes non-finite config floats as {"__float__": "Infinity"}; turn them back into floats."""
    if isinstance(o, dict):
        if len(o) == 1 and "__float__" in o:
            return float(o["__float__"].replace("Infinity", "inf"))
        return {k: decode_hf_floats(v) for k, v in o.items()}
    if isinstance(o, list):
        return [decode_hf_floats(v) for v in o]
    return o


def dump_config(chimera, preset, num_layers, path):
    cmd = [chimera, "info", "--synthetic", preset, "--dump-config", path]
    if num_layers:
        cmd += ["--num-layers", str(num_layers)]
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")


class Peer:
    def __init__(self, args):
        self.args = args
        self.t_start = time.perf_counter()
        self.limit = float(os.environ.get("PEER_TIME_LIMIT_S", "240"))
        self.results = []

    def elapsed(self):
        return time.perf_counter() - self.t_start

    def left(self):
        return self.limit - self.elapsed()

    def emit(self, mode, fields, status="ok", reason=None):
        rec = dict(engine="transformers", preset=self.args.preset, mode=mode, **fields, status=status)
        if reason:
            rec["reason"] = reason
        self.results.append(rec)
        parts = [f"engine=transformers", f"preset={self.args.preset}", f"mode={mode}"]
        for k, v in fields.items():
            parts.append(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}")
        if status != "ok":
            parts.append(f"status={status}")
            parts.append(f'reason="{reason}"')
        log("PEER " + " ".join(parts))

    # ---- model ---------------------------------------------------------------------------------------------
    def build(self, cfg_dict):
        import torch
        from transformers import NemotronHConfig, NemotronHForCausalLM

        self.torch = torch
        a = self.args
        self.device = torch.device(a.device)
        cfg = NemotronHConfig.from_dict(cfg_dict)
        cfg.use_mamba_kernels = a.mamba_kernels == "on"
        kw = {}
        if a.attn:
            kw["attn_implementation"] = a.attn
        if a.experts:
            kw["experts_implementation"] = a.experts
        t0 = time.perf_counter()
        torch.manual_seed(0)
        # Directly on the GPU: parameters are allocated and randomly initialised there.
        with torch.device(self.device):
            model = NemotronHForCausalLM._from_config(cfg, dtype=torch.bfloat16, **kw)
        model.eval()
        p = next(model.parameters())
        assert p.device.type == self.device.type, f"model built on {p.device}, wanted {self.device}"
        self.sync()
        self.model = model
        self.vocab = cfg.vocab_size
        n_params = sum(x.numel() for x in model.parameters())
        self.info = dict(
            parameters=n_params,
            layers=len(cfg.layers_block_type),
            attn_implementation=getattr(model.config, "_attn_implementation", None),
            experts_implementation=getattr(model.config, "_experts_implementation", None),
            mamba_path=self.mamba_path(),
            build_s=time.perf_counter() - t0,
        )
        log(f"model: {n_params / 1e9:.3f} B parameters, {self.info['layers']} layers, bf16 on {self.device}; "
            f"attention {self.info['attn_implementation']}, experts {self.info['experts_implementation']}, "
            f"Mamba {self.info['mamba_path']}; built in {self.info['build_s']:.1f} s")

    def mamba_path(self):
        # transformers 5.x calls mamba_ssm / causal_conv1d kernels when installed (or fetched from the hub, which
        # this machine cannot reach) and otherwise falls back to its PyTorch reference code.
        if self.args.mamba_kernels != "on":
            return "torch reference (use_mamba_kernels=False)"
        import importlib.util
        have = [m for m in ("mamba_ssm", "causal_conv1d") if importlib.util.find_spec(m) is not None]
        if len(have) == 2:
            return "mamba_ssm + causal_conv1d kernels"
        return f"torch reference ({' and '.join(m for m in ('mamba_ssm', 'causal_conv1d') if m not in have)} not installed)"

    def sync(self):
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    def prompt(self, batch, length, seed):
        g = self.torch.Generator().manual_seed(seed)
        return self.torch.randint(3, self.vocab, (batch, length), generator=g).to(self.device)

    def generate_s(self, ids, new_tokens):
        torch = self.torch
        with torch.inference_mode():
            self.sync()
            t0 = time.perf_counter()
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                num_beams=1,
                use_cache=True,
                pad_token_id=self.model.config.pad_token_id,
            )
            self.sync()
            secs = time.perf_counter() - t0
        assert out.shape == (ids.shape[0], ids.shape[1] + new_tokens), out.shape
        return secs

    def best_of(self, ids, new_tokens, est_one):
        """Best of --repeats runs; repeats only while the budget allows. None if even one run does not fit."""
        times = []
        for r in range(self.args.repeats):
            est = times[-1] if times else est_one
            if est is not None and est > self.left():
                break
            times.append(self.generate_s(ids, new_tokens))
        return min(times) if times else None

    # ---- measurements --------------------------------------------------------------------------------------
    def warmup(self):
        ids = self.prompt(1, min(128, self.args.decode_context), 1)
        self.generate_s(ids, 2)
        self.generate_s(ids, 2)

    def prefill(self, lens):
        last = None  # (length, ttft_s)
        for L in lens:
            est = last[1] * (L / last[0]) * 1.5 if last else None
            if est is not None and est > self.left():
                self.emit("prefill", dict(input_len=L), "skipped",
                          f"estimated {est:.1f} s exceeds the {self.left():.0f} s left of PEER_TIME_LIMIT_S={self.limit:.0f}")
                continue
            try:
                s = self.best_of(self.prompt(1, L, L), 1, est)
            except self.torch.cuda.OutOfMemoryError as e:
                self.torch.cuda.empty_cache()
                self.emit("prefill", dict(input_len=L), "failed", f"out of memory: {str(e).splitlines()[0]}")
                continue
            if s is None:
                self.emit("prefill", dict(input_len=L), "skipped", "time budget")
                continue
            last = (L, s)
            self.emit("prefill", dict(input_len=L, ttft_ms=s * 1e3, tok_s=L / s))

    def decode(self, batches):
        a = self.args
        N = a.new_tokens
        last = None  # (batch, t1_s, step_s)
        for B in batches:
            fields = dict(batch=B, context=a.decode_context, new_tokens=N)
            if last:
                t1_est = last[1] * B / last[0]
                step_est = last[2] * max(1.0, B / last[0] / 4)  # decode steps grow slowly with batch
                est = a.repeats * (2 * t1_est + N * step_est)
                if est > self.left():
                    self.emit("decode", fields, "skipped",
                              f"estimated {est:.1f} s exceeds the {self.left():.0f} s left of PEER_TIME_LIMIT_S={self.limit:.0f}")
                    continue
            try:
                ids = self.prompt(B, a.decode_context, 1000 + B)
                t1 = self.best_of(ids, 1, None)
                if t1 is None:
                    self.emit("decode", fields, "skipped", "time budget")
                    continue
                # Before the N-token run: a guess of its cost from the 1-token run (prefill-dominated) and, when
                # known, the last step time.
                guess = t1 + N * (last[2] if last else t1 / 4)
                tN = self.best_of(ids, N, guess)
            except self.torch.cuda.OutOfMemoryError as e:
                self.torch.cuda.empty_cache()
                self.emit("decode", fields, "failed", f"out of memory: {str(e).splitlines()[0]}")
                continue
            if tN is None:
                self.emit("decode", fields, "skipped", "time budget")
                continue
            step = max(tN - t1, 1e-9) / (N - 1)
            last = (B, t1, step)
            self.emit("decode", dict(fields, tpot_ms=step * 1e3, tok_s=B / step, ttft_ms=t1 * 1e3))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="nemotron-3-nano-30b-a3b", help="chimera --synthetic preset")
    ap.add_argument("--num-layers", type=int, default=0, help="keep the first N layers (0 = all)")
    ap.add_argument("--config", help="a config.json from `chimera info --dump-config` (default: dump it now)")
    ap.add_argument("--chimera", help="the chimera binary (default: build-dev/ or build/ under the repository)")
    ap.add_argument("--input-lens", type=ints, default=[1024, 8192, 32768])
    ap.add_argument("--batch-sizes", type=ints, default=[1, 8])
    ap.add_argument("--decode-context", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2, help="runs per measurement, best kept (the first warms up)")
    ap.add_argument("--device", default="cuda", help="cuda (default); cpu only to smoke-test the script")
    ap.add_argument("--attn", default=None, help="attn_implementation (default: transformers' choice, sdpa)")
    ap.add_argument("--experts", default=None, help="experts_implementation (default: transformers' choice)")
    ap.add_argument("--mamba-kernels", choices=["on", "off"], default="on",
                    help="use_mamba_kernels (on: mamba_ssm kernels when installed, else transformers' torch path)")
    ap.add_argument("--json-out", help="write the results as JSON")
    args = ap.parse_args()
    if args.new_tokens < 2:
        ap.error("--new-tokens must be >= 2")

    peer = Peer(args)
    log(f"engine_peers: preset {args.preset}{f' ({args.num_layers} layers)' if args.num_layers else ''}, "
        f"time limit {peer.limit:.0f} s (PEER_TIME_LIMIT_S)")
    try:
        import torch
        import transformers
    except ImportError as e:
        log(f"PEER engine=transformers preset={args.preset} mode=all status=skipped reason=\"{e}\"")
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        log(f"PEER engine=transformers preset={args.preset} mode=all status=skipped reason=\"no CUDA device\"")
        return 0
    log(f"transformers {transformers.__version__}, torch {torch.__version__}"
        + (f", {torch.cuda.get_device_name()}" if args.device == "cuda" else ""))

    cfg_path = args.config
    if not cfg_path:
        chimera = args.chimera or find_chimera()
        if not chimera:
            log(f"PEER engine=transformers preset={args.preset} mode=all status=skipped "
                "reason=\"no chimera binary to dump the config (build it or pass --config)\"")
            return 1
        cfg_path = os.path.join(tempfile.mkdtemp(prefix="engine_peers_"), "config.json")
        dump_config(chimera, args.preset, args.num_layers, cfg_path)
        log(f"config: {chimera} info --synthetic {args.preset} --dump-config {cfg_path}")
    with open(cfg_path) as f:
        cfg = decode_hf_floats(json.load(f))

    peer.build(cfg)
    peer.warmup()
    log(f"warm-up done at {peer.elapsed():.1f} s")
    peer.prefill(args.input_lens)
    peer.decode(args.batch_sizes)
    log(f"engine_peers: done in {peer.elapsed():.1f} s")

    if args.json_out:
        j = dict(
            date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            transformers=transformers.__version__,
            torch=torch.__version__,
            device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            preset=args.preset,
            num_layers=args.num_layers or peer.info["layers"],
            dtype="bfloat16",
            settings=dict(decode_context=args.decode_context, new_tokens=args.new_tokens, repeats=args.repeats,
                          time_limit_s=peer.limit, sampling="greedy, min_new_tokens = max_new_tokens"),
            model=peer.info,
            results=peer.results,
        )
        with open(args.json_out, "w") as f:
            json.dump(j, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
