#!/usr/bin/env python3
"""Quantized tiny Nemotron-H checkpoints made by NVIDIA ModelOpt itself, with ModelOpt's own reference logits.

For each recipe (--only picks some):
  fp8    mtq.FP8_DEFAULT_CFG: every linear FP8 (W8A8, static per-tensor scales), ModelOpt's default exclusions
         (routers, conv1d, lm_head)
  nvfp4  mtq.NVFP4_DEFAULT_CFG: every linear NVFP4 (W4A4, 16-element blocks), the same exclusions
  mixed  like Nemotron 3 Super's NVFP4 checkpoint: routed experts NVFP4; shared experts, latent projections and the
         Mamba in_proj / out_proj FP8; attention, conv1d and lm_head unquantized
on each of two tiny random NemotronHForCausalLM models built like scripts/make_fixtures.py's (all_kinds: M * - E
with Nano-style MoE; super_like: LatentMoE), it
  1. quantizes with mtq.quantize, calibrating on random token sequences (fp32 weights, fp32 math),
  2. computes the references BEFORE export (export replaces the weights by their stored form), teacher-forced over
     every prompt position, in fp32 with ModelOpt's fake quantization:
       aq: as the checkpoint says (weights and activations quantized; static input scales from calibration)
       wo: weights only (mtq.disable_quantizer(model, "*input_quantizer"))
     each with its own greedy continuation (full forwards, no cache),
  3. re-enables the input quantizers, sets model.config.architectures and runs export_hf_checkpoint.
Output, OUT/<model>-<recipe>/:
  config.json, hf_quant_config.json, model.safetensors      ModelOpt's export
  logits_<mode>_<p>.npy   float32 [len(prompt_p) + NEW_TOKENS, vocab]: one full forward over prompt_p + greedy;
                          row i = the logits after token i (mode: aq / wo)
  expected.json           prompts, greedy continuations per mode, top-1 margins, versions, the quantizer summary

Runs where torch, transformers (>= 5.10, NemotronH with '-' layers) and nvidia-modelopt are installed: the GPU machine
(scripts/device_deps.sh fetches the wheels, `scripts/device_deps.sh --install-modelopt DIR` installs them there
offline; then PYTHONPATH=DIR). With --device cpu only the fp8 recipe runs: ModelOpt's NVFP4 fake quantization
(dynamic block quantization) asserts a CUDA tensor, so nvfp4 and mixed are skipped there. Usage:
  python3 scripts/make_modelopt_fixtures.py --out OUT [--device cuda|cpu] [--only fp8 mixed] [--models all_kinds]
"""

import argparse
import copy
import json
import math
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

NEW_TOKENS = 16
PROMPT_LENS = (2, 19, 37)
CALIB_SEQS = 8
CALIB_LEN = 48


def log(*a):
    print(*a, flush=True)


def build(name, device):
    import make_fixtures as mf  # the tiny models' definitions and initialization

    spec = mf.MODELS[name]
    torch.manual_seed(spec["seed"])
    model = mf.build_model(spec["cfg"])
    mf.randomize(model, spec["bias_std"])
    return model.to(device).eval()


def fp8_entry(mtq, pattern_prefix):
    """quant_cfg entries making the weight and input quantizers of modules matching pattern_prefix FP8 per tensor."""
    fp8 = {"num_bits": (4, 3), "axis": None}
    return [
        {"quantizer_name": pattern_prefix + "weight_quantizer", "cfg": dict(fp8), "enable": True},
        {"quantizer_name": pattern_prefix + "input_quantizer", "cfg": dict(fp8), "enable": True},
    ]


def recipe(mtq, name):
    if name == "fp8":
        return copy.deepcopy(mtq.FP8_DEFAULT_CFG)
    if name == "nvfp4":
        return copy.deepcopy(mtq.NVFP4_DEFAULT_CFG)
    if name == "mixed":
        cfg = copy.deepcopy(mtq.NVFP4_DEFAULT_CFG)  # routed experts (and everything else not overridden) NVFP4
        q = cfg["quant_cfg"]
        for pat in ("*shared_experts*", "*fc1_latent_proj*", "*fc2_latent_proj*", "*mixer.in_proj*",
                    "*mixer.out_proj*"):
            q += fp8_entry(mtq, pat)
        for pat in ("*q_proj*", "*k_proj*", "*v_proj*", "*o_proj*", "*mixer.conv1d*", "*lm_head*"):
            q.append({"quantizer_name": pat, "enable": False})
        return cfg
    raise ValueError(name)


@torch.no_grad()
def full_logits(model, ids, device):
    out = model(input_ids=torch.tensor([ids], dtype=torch.long, device=device), use_cache=False)
    return out.logits[0].float().cpu().clone()


@torch.no_grad()
def greedy(model, prompt, device, banned):
    ids = list(prompt)
    for _ in range(NEW_TOKENS):
        row = full_logits(model, ids, device)[-1]
        row[banned] = -float("inf")
        ids.append(int(row.argmax()))
    return ids[len(prompt):]


def references(model, prompts, device, banned):
    res = []
    for p in prompts:
        g = greedy(model, p, device, banned)
        logits = full_logits(model, p + g, device)
        rows = logits[len(p) - 1:len(p) - 1 + NEW_TOKENS]
        top2 = rows.topk(2, dim=-1).values
        res.append(dict(greedy=g, logits=logits, margins=(top2[:, 0] - top2[:, 1]).tolist()))
    return res


def quantizer_summary(model):
    """Which modules ended up with enabled weight / input quantizers, and their kind (for expected.json)."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    out = {}
    for name, m in model.named_modules():
        if isinstance(m, TensorQuantizer) and m.is_enabled:
            nb = m.num_bits
            bs = getattr(m, "block_sizes", None)
            out[name] = "nvfp4" if (nb == (2, 1) and bs) else ("fp8" if nb == (4, 3) else str(nb))
    return out


def enabled_input_quantizers(model):
    from modelopt.torch.quantization.nn import TensorQuantizer

    return {n for n, m in model.named_modules()
            if isinstance(m, TensorQuantizer) and "input_quantizer" in n and m.is_enabled}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--only", nargs="*", default=["fp8", "nvfp4", "mixed"])
    ap.add_argument("--models", nargs="*", default=["all_kinds", "super_like"])
    args = ap.parse_args()

    import transformers
    import modelopt
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint

    torch.use_deterministic_algorithms(True, warn_only=True)
    if args.device == "cpu":
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    for model_name in args.models:
        for rname in args.only:
            if args.device == "cpu" and rname != "fp8":
                log(f"== {model_name} / {rname}: skipped (ModelOpt's NVFP4 fake quantization needs CUDA)")
                continue
            out = os.path.join(args.out, f"{model_name}-{rname}")
            os.makedirs(out, exist_ok=True)
            log(f"== {model_name} / {rname} -> {out}")
            model = build(model_name, args.device)
            vocab = model.config.vocab_size
            eos = model.config.eos_token_id
            banned = [eos] if isinstance(eos, int) else list(eos or [])
            g = torch.Generator().manual_seed(4242)
            calib = [torch.randint(3, vocab, (1, CALIB_LEN), generator=g) for _ in range(CALIB_SEQS)]

            def forward_loop(m):
                for ids in calib:
                    m(input_ids=ids.to(args.device), use_cache=False)

            model = mtq.quantize(model, recipe(mtq, rname), forward_loop)
            summary = quantizer_summary(model)
            log(f"   {len(summary)} enabled quantizers")
            prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]

            refs = {"aq": references(model, prompts, args.device, banned)}
            # mtq.disable_quantizer(model, "*input_quantizer"), restricted to the input quantizers the recipe
            # enabled: enabling the wildcard afterwards would also turn on those the recipe left off.
            on = enabled_input_quantizers(model)
            mtq.disable_quantizer(model, lambda name: name in on)
            refs["wo"] = references(model, prompts, args.device, banned)
            mtq.enable_quantizer(model, lambda name: name in on)
            # the activation-quantized model again: the export must see the state the aq references came from
            check = full_logits(model, prompts[0] + refs["aq"][0]["greedy"], args.device)
            reenable_diff = float((check - refs["aq"][0]["logits"]).abs().max())
            log(f"   aq logits after disable + enable of the input quantizers: max |diff| {reenable_diff}")

            for mode, rs in refs.items():
                for p, r in zip(prompts, rs):
                    np.save(os.path.join(out, f"logits_{mode}_{len(p)}.npy"), r["logits"].numpy())
            model.config.architectures = ["NemotronHForCausalLM"]
            export_hf_checkpoint(model, export_dir=out)
            expected = dict(
                model=model_name,
                recipe=rname,
                device=args.device,
                math="float32, teacher-forced full forwards (no cache), ModelOpt fake quantization",
                modes=dict(aq="weights and activations quantized (static input scales)",
                           wo="weights quantized, activations not (input quantizers disabled)"),
                versions=dict(torch=torch.__version__, transformers=transformers.__version__,
                              modelopt=modelopt.__version__),
                new_tokens=NEW_TOKENS,
                prompts=prompts,
                greedy={m: [r["greedy"] for r in rs] for m, rs in refs.items()},
                min_margin={m: [min(r["margins"]) for r in rs] for m, rs in refs.items()},
                quantizers=summary,
                reenable_max_abs_diff=reenable_diff,
            )
            with open(os.path.join(out, "expected.json"), "w") as f:
                json.dump(expected, f, indent=1)
                f.write("\n")
            log(f"   wrote {sorted(os.listdir(out))}")


if __name__ == "__main__":
    main()
