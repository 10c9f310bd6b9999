#!/usr/bin/env python3
"""Where does a bf16 run leave transformers' bf16 run? (the super_like gap). CPU only.

Runs one fixture (tests/fixtures/models/<name>) with transformers on the CPU, teacher-forced exactly as
make_fixtures.py --bf16-logits-only does on the GPU, in several precisions, and scores each against the committed
GPU bf16 logits (logits_bf16_<p>.npy) with the GPU test's measure (top-1 over decidable positions, p90 of
max|logit - ref| / max|ref|):
  bf16        transformers in bf16 (how close transformers' CPU bf16 is to its GPU bf16: the noise floor)
  fp32w       fp32 math on the bf16-rounded weights (e_score_correction_bias fp32): what Chimera's CPU backend
              computes on a bf16 checkpoint (models/nemotron_h_bf16_test.cpp)
  bf16-<mod>  transformers bf16 with one family of modules run in fp32 (mamba, moe, mnorm = the gated norm)
Then one full forward per prompt in bf16 and in fp32w: per layer, the residual stream's divergence, and every
router whose top-k expert set differs, with its selection margin (k-th vs (k+1)-th biased score).

Usage: python3 scripts/bf16_divergence.py [--fixture super_like] [--variants bf16,fp32w,bf16-mamba,...]
Needs torch and transformers (the versions in the fixture's expected_bf16.json).
"""
import argparse
import json
import os
import sys

import numpy as np
import torch
import transformers
from transformers import LogitsProcessorList, NemotronHForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_fixtures  # noqa: E402
from make_fixtures import ForceTokens  # noqa: E402


def measure(got, ref):
    """The GPU test's measure over every teacher-forced row; returns (agree, decidable, p90, max, flips)."""
    agree = decidable = 0
    errs, flips = [], []
    for p, (g, w) in enumerate(zip(got, ref)):
        for r in range(w.shape[0]):
            top_g, top_w = int(np.argmax(g[r])), int(np.argmax(w[r]))
            second = np.max(np.delete(w[r], top_w))
            max_abs = np.abs(w[r]).max()
            errs.append(np.abs(g[r] - w[r]).max() / max_abs)
            dec = w[r, top_w] - second > max_abs / 64
            decidable += dec
            agree += dec and top_g == top_w
            if top_g != top_w:
                flips.append(f"prompt {p} row {r}: {top_g} vs {top_w}, margin {(w[r, top_w] - second) / max_abs:.2e}"
                             f"{' (decidable)' if dec else ''}")
    errs = np.sort(errs)
    return agree, decidable, errs[int(0.9 * (len(errs) - 1))], errs[-1], flips


def load(fixture_dir, dtype):
    return NemotronHForCausalLM.from_pretrained(
        fixture_dir, dtype=dtype, attn_implementation="eager", experts_implementation="eager").eval()


def fp32_on_bf16_weights(fixture_dir):
    return make_fixtures.fp32_on_bf16_weights(load(fixture_dir, torch.bfloat16), fixture_dir)


def run_in_fp32(module):
    """One submodule of a bf16 model in fp32: its (bf16-valued) weights upcast, inputs upcast, outputs rounded."""
    module.float()
    inner = module.forward

    def cast(x, dtype):
        return x.to(dtype) if torch.is_tensor(x) and x.is_floating_point() else x

    def forward(*a, **k):
        out = inner(*[cast(x, torch.float32) for x in a], **{n: cast(v, torch.float32) for n, v in k.items()})
        return tuple(cast(o, torch.bfloat16) for o in out) if isinstance(out, tuple) else cast(out, torch.bfloat16)

    module.forward = forward


def variant(fixture_dir, name):
    if name == "fp32w":
        return fp32_on_bf16_weights(fixture_dir)
    m = load(fixture_dir, torch.bfloat16)
    if name == "bf16":
        return m
    kind = name.removeprefix("bf16-")
    for layer in m.model.layers:
        if kind == "mamba" and layer.block_type == "linear_attention":
            run_in_fp32(layer.mixer)
        elif kind == "mnorm" and layer.block_type == "linear_attention":
            run_in_fp32(layer.mixer.norm)
        elif kind == "moe" and layer.block_type == "moe":
            run_in_fp32(layer.mixer)
        elif kind not in ("mamba", "mnorm", "moe"):
            raise SystemExit(f"unknown variant {name} (bf16, fp32w, bf16-mamba, bf16-mnorm, bf16-moe)")
    return m


def teacher_forced(model, expected):
    """make_fixtures.make_bf16_one's rows: prompt prefill rows, then cached decode steps forced to the reference."""
    out_rows = []
    for prompt, greedy in zip(expected["prompts"], expected["greedy"]):
        ids = torch.tensor([prompt])
        pre = model(input_ids=ids, use_cache=False).logits[0].float()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(greedy),
                             min_new_tokens=len(greedy), do_sample=False, num_beams=1, return_dict_in_generate=True,
                             output_logits=True, logits_processor=LogitsProcessorList([ForceTokens(greedy)]))
        dec = torch.stack([l[0].float() for l in out.logits])
        out_rows.append(torch.cat([pre[: len(prompt) - 1], dec]).numpy())
    return out_rows


def divergence(fixture_dir, expected):
    """Full forwards in bf16 and fp32w: per-layer residual divergence and the routers that choose differently."""
    models = {"bf16": load(fixture_dir, torch.bfloat16), "fp32w": fp32_on_bf16_weights(fixture_dir)}
    for p, (prompt, greedy) in enumerate(zip(expected["prompts"], expected["greedy"])):
        ids = torch.tensor([prompt + greedy[:-1]])
        seen = {}
        for key, m in models.items():
            st = seen[key] = {}
            hooks = []
            for i, layer in enumerate(m.model.layers):
                hooks.append(layer.register_forward_hook(lambda mod, a, o, i=i, st=st: st.__setitem__(i, o[0].float())))
                if layer.block_type == "moe":
                    hooks.append(layer.mixer.gate.register_forward_hook(
                        lambda mod, a, o, i=i, st=st: st.__setitem__(("router", i), o)))
            st["logits"] = m(input_ids=ids, use_cache=False).logits[0].float()
            for h in hooks:
                h.remove()
        b, f = seen["bf16"], seen["fp32w"]
        row_err = (b["logits"] - f["logits"]).abs().amax(-1) / b["logits"].abs().amax(-1)
        print(f"\nprompt {p} ({ids.shape[1]} rows): bf16 vs fp32w logits rel err median {row_err.median():.3f} "
              f"max {row_err.max():.3f} (row {int(row_err.argmax())})")
        for i, layer in enumerate(models["bf16"].model.layers):
            e = (b[i] - f[i]).abs().amax(-1) / f[i].abs().amax(-1)
            line = f"  layer {i} {layer.block_type:16s} residual rel err median {e.median():.2e} max {e.max():.2e}"
            if layer.block_type == "moe":
                gate = models["fp32w"].model.layers[i].mixer.gate
                ib, (rl, _, i_f) = b[("router", i)][2], f[("router", i)]
                margin = make_fixtures.selection_margin(gate, rl)
                flips = [t for t in range(ids.shape[1]) if set(ib[t].tolist()) != set(i_f[t].tolist())]
                line += (f"; router: {len(flips)} expert-set flips " +
                         " ".join(f"[row {t} margin {margin[t]:.4f} logit err {row_err[t]:.2f}]" for t in flips) +
                         f"; rows with selection margin < {make_fixtures.ROUTER_TIE_MARGIN}: "
                         f"{int((margin < make_fixtures.ROUTER_TIE_MARGIN).sum())}")
            print(line)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixture", default="super_like")
    ap.add_argument("--fixtures", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "models"))
    ap.add_argument("--variants", default="bf16,fp32w,bf16-mamba,bf16-moe,bf16-mnorm")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    transformers.logging.set_verbosity_error()
    d = os.path.join(args.fixtures, args.fixture)
    expected = json.load(open(os.path.join(d, "expected.json")))
    ref = [np.load(os.path.join(d, f"logits_bf16_{p}.npy")) for p in range(len(expected["prompts"]))]
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, CPU; reference: {d}/logits_bf16_*.npy")
    for name in args.variants.split(","):
        agree, dec, p90, worst, flips = measure(teacher_forced(variant(d, name), expected), ref)
        print(f"{name:12s} top-1 {agree}/{dec} = {100 * agree / dec:.2f} % of decidable positions, p90 {p90:.3e}, "
              f"max {worst:.3e}")
        for fl in flips:
            print(f"    {fl}")
    divergence(d, expected)


if __name__ == "__main__":
    main()
