#!/usr/bin/env python3
"""Layer by layer: is Chimera's bf16 engine as accurate as transformers' bf16? (the GPU machine)

For each prompt of a fixture (tests/fixtures/models/<name>) this runs `chimera generate --dump-activations` (the
prompt as one prefill, bf16 on CUDA) and transformers on the same GPU in bf16 and in fp32 math on the same bf16
weights ("fp32w", the neutral reference both bf16 runs scatter around), then prints per layer:
  stream  the residual stream entering the layer, against fp32w: Chimera's and transformers' bf16 divergence
  local   one block's own error: the layer's input (Chimera's, or transformers bf16's) fed to fp32w's block, against
          that run's own block output (the next layer's input); it separates a block's arithmetic from what it
          inherited
  router  MoE layers: the positions whose expert set differs (Chimera vs transformers bf16, each vs fp32w) with
          fp32w's selection margin there (k-th minus (k+1)-th biased score)
Row error: max|a - b| / max|b| per position; median / p90 / max over positions.

Usage: python3 scripts/bf16_layer_error.py [--fixture super_like] [--chimera build/chimera] [--keep DIR]
Needs torch and transformers (the versions in the fixture's expected_bf16.json) and a CUDA build of chimera.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import torch
import transformers
from transformers import NemotronHForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_fixtures  # noqa: E402


def row_err(a, b):
    return (a - b).abs().amax(-1) / b.abs().amax(-1).clamp_min(1e-30)


def stats(e):
    return f"med {e.median():.2e} p90 {e.quantile(0.9):.2e} max {e.max():.2e}"


def forward(model, ids, replace=None):
    """One full forward (no cache). Records each layer's input and output [T, D] and each MoE gate's outputs;
    replace = (i, x) feeds x to layer i instead of what the layer before produced."""
    D = model.config.hidden_size
    seen, hooks = {}, []
    for i, layer in enumerate(model.model.layers):
        def pre(mod, args, kwargs, i=i):
            hs = args[0] if args else kwargs["hidden_states"]
            if replace is not None and replace[0] == i:
                hs = replace[1].to(hs.dtype).reshape(hs.shape)
                args, kwargs = ((hs,) + tuple(args[1:]), kwargs) if args else (args, dict(kwargs, hidden_states=hs))
            seen[("in", i)] = hs.reshape(-1, D).float()
            return args, kwargs

        def post(mod, args, out, i=i):
            seen[("out", i)] = (out[0] if isinstance(out, tuple) else out).reshape(-1, D).float()

        hooks += [layer.register_forward_pre_hook(pre, with_kwargs=True), layer.register_forward_hook(post)]
        if layer.block_type == "moe":
            hooks.append(layer.mixer.gate.register_forward_hook(
                lambda mod, a, out, i=i: seen.__setitem__(("router", i), out)))
    model(input_ids=ids, use_cache=False)
    for h in hooks:
        h.remove()
    return seen


@torch.no_grad()
def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    ap.add_argument("--fixture", default="super_like")
    ap.add_argument("--fixtures", default=os.path.join(root, "tests", "fixtures", "models"))
    ap.add_argument("--chimera", default=os.path.join(root, "build", "chimera"))
    ap.add_argument("--keep", help="write Chimera's dumps here (default: a temporary directory)")
    args = ap.parse_args()
    transformers.logging.set_verbosity_error()
    fix = os.path.join(args.fixtures, args.fixture)
    expected = json.load(open(os.path.join(fix, "expected.json")))
    bf = NemotronHForCausalLM.from_pretrained(fix, dtype=torch.bfloat16, attn_implementation="eager",
                                              experts_implementation="eager").to("cuda").eval()
    fw = make_fixtures.fp32_on_bf16_weights(bf, fix)
    layers = bf.model.layers
    D = bf.config.hidden_size
    print(f"{args.fixture}: transformers {transformers.__version__}, torch {torch.__version__}, "
          f"{torch.cuda.get_device_name()}")
    tmp = args.keep or tempfile.mkdtemp(prefix="chimera_dump_")
    lower = blocks = 0
    flips = {"chimera": 0, "transformers": 0}
    for p, prompt in enumerate(expected["prompts"]):
        dump = os.path.join(tmp, f"prompt{p}")
        subprocess.run([args.chimera, "generate", "-m", fix, "--prompt-ids", ",".join(map(str, prompt)), "-n", "1",
                        "--device", "cuda", "--dtype", "bfloat16", "--dump-activations", dump, "-q"],
                       check=True, stdout=subprocess.DEVNULL)
        if os.path.exists(os.path.join(dump, "step1_layer0_input.npy")):
            raise SystemExit(f"prompt {p}: chimera split the prompt into several prefill steps; this script compares one")
        ours = [torch.from_numpy(np.load(os.path.join(dump, f"step0_layer{i}_input.npy"))).cuda().reshape(-1, D)
                for i in range(len(layers))]
        ids = torch.tensor([prompt], device="cuda")
        T = len(prompt)
        hb, hf = forward(bf, ids), forward(fw, ids)
        print(f"\nprompt {p} ({T} tokens)")
        for i, layer in enumerate(layers):
            print(f" layer {i} {layer.block_type:16s} stream vs fp32w: chimera {stats(row_err(ours[i], hf[('in', i)]))}"
                  f" | transformers bf16 {stats(row_err(hb[('in', i)], hf[('in', i)]))}")
            if i + 1 < len(layers):
                lo = row_err(ours[i + 1], forward(fw, ids, (i, ours[i]))[("out", i)])
                lh = row_err(hb[("out", i)], forward(fw, ids, (i, hb[("in", i)]))[("out", i)])
                print(f"   local block error: chimera {stats(lo)} | transformers bf16 {stats(lh)}")
                blocks += 1
                lower += bool(lo.median() <= lh.median())
            if layer.block_type == "moe":
                gate = fw.model.layers[i].mixer.gate
                logits_f, _, idf = hf[("router", i)]
                idb = hb[("router", i)][2]
                ido = np.load(os.path.join(dump, f"step0_layer{i}_experts.npy")).reshape(T, -1)
                margin = make_fixtures.selection_margin(gate, logits_f)

                def differ(a, b):
                    return [t for t in range(T) if set(a[t].tolist()) != set(b[t].tolist())]

                ob, of, bfl = differ(ido, idb.cpu().numpy()), differ(ido, idf.cpu().numpy()), differ(idb, idf)
                flips["chimera"] += len(of)
                flips["transformers"] += len(bfl)
                print(f"   router: chimera vs transformers bf16 differ at {ob}; vs fp32w: chimera {of}, transformers "
                      f"bf16 {bfl}; fp32w margins there: " +
                      (" ".join(f"{t}:{margin[t]:.4f}" for t in sorted(set(ob + of + bfl))) or "-") +
                      f"; positions with margin < {make_fixtures.ROUTER_TIE_MARGIN}: "
                      f"{int((margin < make_fixtures.ROUTER_TIE_MARGIN).sum())} of {T}")
    print(f"\nsummary: Chimera's local block error median <= transformers bf16's in {lower} of {blocks} blocks; "
          f"expert sets differing from fp32w: Chimera {flips['chimera']}, transformers bf16 {flips['transformers']}")
    if not args.keep:
        shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
