#!/usr/bin/env python3
"""Make the tiny random Nemotron-H reference fixtures with Hugging Face transformers itself.

Writes, for each model, tests/fixtures/models/<name>/ (or --out DIR/<name>/):
  config.json, generation_config.json   as transformers writes them (legacy_dense: config.json rewritten
                                        with the legacy field names of old Nemotron-H checkpoints)
  model.safetensors                     float32 checkpoint (naming per model, see MODELS below)
  expected.json                         prompts, greedy continuations, generate() results, margins, notes
  logits_<p>.npy                        float32 [len(prompt_p) + len(greedy_p), vocab]: ONE full forward pass
                                        (no cache) over prompt_p + greedy_p; row i = logits after token i

Reference semantics: greedy[p] is what model.generate(max_new_tokens=32, min_new_tokens=32, do_sample=False)
returned, checked against the argmax of the full-forward logits; where they disagree, the full forward is the
reference (the continuation is recomputed token by token with full forwards, no cache) and generate_agrees=false.

Everything runs on the CPU in float32, one thread, deterministic, eager attention and eager experts, no Mamba kernels.
Needs torch and transformers>=5.10 (dense '-' layers); fixtures were made with the versions in expected.json.

Usage: python3 scripts/make_fixtures.py --out tests/fixtures/models [--tar fixtures.tar.gz] [--only NAME ...]

bf16 mode (the GPU machine): python3 scripts/make_fixtures.py --bf16-logits-only OUTDIR
    [--fixtures tests/fixtures/models] [--device cuda] [--only NAME ...]
  For every existing fixture directory: loads its saved checkpoint with from_pretrained in bfloat16 on the GPU
  (eager attention, eager experts, torch Mamba path, as the fp32 fixtures) and runs it teacher-forced over the
  same positions tests/models/nemotron_h_gpu_test.cpp feeds Chimera: the prompt as one prefill (its logits rows
  0 .. len(prompt)-2), then the reference greedy tokens fed one cached decode step at a time through generate()
  (a logits processor forces each token; the raw logits are kept), len(greedy) rows. Writes, flat in OUTDIR:
    <name>.logits_bf16_<p>.npy   float32 [len(prompt_p) + len(greedy_p) - 1, vocab] (bf16 values, exact in f32)
    <name>.expected_bf16.json    versions, implementations, top-1 agreement with the fp32 fixture, and the bf16
                                 cached-vs-full-forward difference of transformers itself (its own bf16 noise)
    <name>.router_margin_<p>.npy float32 [same rows] (fixtures with MoE layers): at each teacher-forced position,
                                 the smallest top-k selection margin (k-th minus (k+1)-th biased router score) over
                                 the MoE layers, from fp32 math on the same bf16 weights over prompt + greedy[:-1]
                                 (one full forward). Where it is small, bf16 rounding on either side may pick
                                 another expert set; the tests use it to tell those positions apart.
  Copy them into tests/fixtures/models/<name>/ as logits_bf16_<p>.npy, router_margin_<p>.npy and expected_bf16.json
  (the script prints the commands; the tests fail on a MoE fixture without its router margins).
"""

import argparse
import json
import math
import os
import shutil
import sys
import tarfile

import numpy as np
import torch

import transformers
from transformers import NemotronHConfig, NemotronHForCausalLM
from safetensors import safe_open
from safetensors.torch import load_file, save_file

NEW_TOKENS = 32
PROMPT_LENS = (2, 37, 53)
# Margin the seed search aims for (smallest top-1/top-2 logit gap over all greedy steps of all prompts).
TARGET_MARGIN = 0.02
TARGET_ROUTER_MARGIN = 1e-4
MAX_SEED_TRIES = 40

# ---------------------------------------------------------------------------------------------------
# Model definitions
# ---------------------------------------------------------------------------------------------------
COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    use_mamba_kernels=False,
    tie_word_embeddings=False,
    mlp_hidden_act="relu2",
    mamba_hidden_act="silu",
    conv_kernel=4,
    chunk_size=16,
    ssm_state_size=16,
    use_conv_bias=True,
    use_bias=False,
    mlp_bias=False,
    attention_bias=False,
    layer_norm_epsilon=1e-5,
    initializer_range=0.1,
    max_position_embeddings=4096,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

MODELS = {
    # 1. all four layer kinds, Nano-3-style MoE (no latent); checkpoint in NVIDIA's published naming.
    "all_kinds": dict(
        seed=1001,
        naming="nvidia",
        bias_std=0.1,
        cfg=dict(
            COMMON,
            hybrid_override_pattern="M*-EM-E*M",
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=96,
            mamba_num_heads=8, mamba_head_dim=16, n_groups=2,
            n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
            moe_intermediate_size=32, moe_shared_expert_intermediate_size=48,
            moe_latent_size=None, routed_scaling_factor=1.0, n_group=1, topk_group=1, norm_topk_prob=True,
        ),
    ),
    # 2. Nemotron-3-Super-like: LatentMoE, 16 experts top-3, scale 2.5; checkpoint in transformers' in-memory
    #    naming (model.*, fused experts [E, I, Lat] / [E, Lat, I]).
    "super_like": dict(
        seed=2002,
        naming="hf",
        bias_std=0.5,
        cfg=dict(
            COMMON,
            hybrid_override_pattern="MEM*EME",
            num_attention_heads=8, num_key_value_heads=2, head_dim=16,   # Qh*hd = 128 != hidden_size
            intermediate_size=96,                                         # unused (no '-' layer)
            mamba_num_heads=16, mamba_head_dim=8, n_groups=4,
            n_routed_experts=16, num_experts_per_tok=3, n_shared_experts=1,
            moe_intermediate_size=48, moe_shared_expert_intermediate_size=96,    # no square expert matrices
            moe_latent_size=32, routed_scaling_factor=2.5, n_group=1, topk_group=1, norm_topk_prob=True,
        ),
    ),
    # 3. old dense Nemotron-H (M - *), config.json rewritten with legacy field names, embedding saved as
    #    backbone.embedding.weight. head_dim is NOT written (old configs only have attention_head_dim, which
    #    transformers 5.x ignores); it is the default 128 in both spellings.
    "legacy_dense": dict(
        seed=3003,
        naming="nvidia",
        bias_std=None,
        cfg=dict(
            COMMON,
            hybrid_override_pattern="M-M*-M-",
            num_attention_heads=4, num_key_value_heads=2, head_dim=128,
            intermediate_size=128,
            mamba_num_heads=8, mamba_head_dim=16, n_groups=2,
            layer_norm_epsilon=1e-6,
        ),
    ),
}

PATTERN_CHARS = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}


def log(*a):
    print(*a, flush=True)


def loud(msg):
    bar = "!" * 100
    print(f"\n{bar}\n!!! {msg}\n{bar}\n", flush=True)


# ---------------------------------------------------------------------------------------------------
# Building and initializing
# ---------------------------------------------------------------------------------------------------
def build_model(cfg_kwargs):
    cfg = NemotronHConfig(**cfg_kwargs)
    model = NemotronHForCausalLM._from_config(
        cfg, attn_implementation="eager", experts_implementation="eager", dtype=torch.float32
    )
    model.eval()
    assert model.config._attn_implementation == "eager", model.config._attn_implementation
    assert model.config._experts_implementation == "eager", model.config._experts_implementation
    return model


@torch.no_grad()
def randomize(model, bias_std):
    """Deterministic (global torch RNG) non-default values for every parameter and buffer."""
    cfg = model.config
    for name, p in model.named_parameters():
        if name.endswith(".A_log"):
            p.uniform_(-1.0, 1.5)
        elif name.endswith(".dt_bias"):
            p.normal_(0.0, 0.5)
        elif name.endswith(".D"):
            p.normal_(1.0, 0.5)
        elif name.endswith("conv1d.weight"):
            p.normal_(0.0, 0.5)
        elif name.endswith("conv1d.bias"):
            p.normal_(0.0, 0.2)
        elif name.endswith("norm.weight") or name.endswith("norm_f.weight"):
            # block norms (layers.i.norm), Mamba gated norm (mixer.norm), final norm (norm_f)
            p.normal_(0.0, 0.2).add_(1.0)
        elif name.endswith("embeddings.weight"):
            p.normal_(0.0, 1.0)
        elif name == "lm_head.weight":
            p.normal_(0.0, 4.0 / math.sqrt(p.shape[1]))
            # keep pad/bos/eos (0, 1, 2) out of the greedy path so plain argmax == min_new_tokens semantics
            p[:3].mul_(0.1)
        elif name.endswith("experts.up_proj") or name.endswith("experts.down_proj"):
            p.normal_(0.0, 1.0 / math.sqrt(p.shape[2]))  # [E, out, in]
        elif name.endswith("gate.weight"):
            p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))
        elif p.dim() == 2:
            p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))  # nn.Linear [out, in]
        else:
            raise RuntimeError(f"randomize: unhandled parameter {name} {tuple(p.shape)}")
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            if bias_std:
                b.normal_(0.0, bias_std)
        else:
            raise RuntimeError(f"randomize: unhandled buffer {name}")


# ---------------------------------------------------------------------------------------------------
# Reference computations
# ---------------------------------------------------------------------------------------------------
@torch.no_grad()
def full_logits(model, ids):
    out = model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=False)
    return out.logits[0].float().clone()  # [T, V]


def eos_ids(model):
    e = model.config.eos_token_id
    return [e] if isinstance(e, int) else list(e or [])


@torch.no_grad()
def greedy_from_full(model, prompt, n, banned):
    """Greedy continuation recomputed with one full (no-cache) forward per token; banned ids masked (min_new_tokens)."""
    ids = list(prompt)
    for _ in range(n):
        row = full_logits(model, ids)[-1].clone()
        row[banned] = -float("inf")
        ids.append(int(row.argmax()))
    return ids[len(prompt):]


@torch.no_grad()
def run_generate(model, prompt):
    inp = torch.tensor([prompt], dtype=torch.long)
    out = model.generate(
        inp,
        attention_mask=torch.ones_like(inp),
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        num_beams=1,
        return_dict_in_generate=True,
        output_logits=True,
    )
    toks = [int(t) for t in out.sequences[0, len(prompt):]]
    raw = torch.stack([l[0].float() for l in out.logits])  # [new, V] raw (unprocessed) logits, cached path
    return toks, raw


def margins_of(logits, start, n):
    rows = logits[start:start + n]
    top2 = rows.topk(2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]).tolist()


def selection_margin(gate, router_logits):
    """[T]: per token, the k-th minus the (k+1)-th biased router score (sigmoid + e_score_correction_bias, what the
    top-k is taken over): how far the chosen expert set is from another one. Needs top_k < the number of experts."""
    scores = torch.sigmoid(router_logits.float()) + gate.e_score_correction_bias.float()
    v = scores.topk(gate.top_k + 1, dim=-1).values
    return v[:, -2] - v[:, -1]


class Probe:
    """Forward hooks collecting diagnostics during full forwards: router selection margins, min softplus(dt)."""

    def __init__(self, model):
        self.handles = []
        self.router_margin = float("inf")
        self.min_dt = float("inf")
        cfg = model.config
        for i, layer in enumerate(model.model.layers):
            mixer = layer.mixer
            if layer.block_type == "moe":
                gate = mixer.gate

                def hook_gate(mod, inp, out):
                    x = inp[0].reshape(-1, mod.hidden_dim).float()
                    logits = x @ mod.weight.float().t()  # fp32 logits whatever the model's dtype
                    if mod.top_k < logits.shape[-1]:
                        self.router_margin = min(self.router_margin, float(selection_margin(mod, logits).min()))

                self.handles.append(gate.register_forward_hook(hook_gate))
            elif layer.block_type == "linear_attention":
                H = cfg.mamba_num_heads

                def hook_in(mod, inp, out, mixer=mixer, H=H):
                    dt = torch.nn.functional.softplus(out[..., -H:] + mixer.dt_bias)
                    self.min_dt = min(self.min_dt, float(dt.min()))

                self.handles.append(mixer.in_proj.register_forward_hook(hook_in))

    def close(self):
        for h in self.handles:
            h.remove()


def make_prompts(seed, vocab):
    g = torch.Generator().manual_seed(seed + 7)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def evaluate(model, prompts):
    """Reference continuations + logits for every prompt. Returns list of per-prompt dicts."""
    banned = eos_ids(model)
    res = []
    for p in prompts:
        gen, gen_logits = run_generate(model, p)
        logits = full_logits(model, p + gen)
        arg = logits[len(p) - 1:len(p) - 1 + NEW_TOKENS].argmax(-1).tolist()
        agrees = arg == gen
        # cached (prefill + per-token decode) logits vs the no-cache full forward, same token path
        cache_diff = float((gen_logits - logits[len(p) - 1:len(p) - 1 + NEW_TOKENS]).abs().max())
        greedy = gen
        eos_hit = any(t in banned for t in arg)
        if not agrees:
            first = next(i for i, (a, b) in enumerate(zip(arg, gen)) if a != b)
            loud(
                f"generate() DISAGREES with the full forward for prompt len {len(p)} at new token {first}: "
                f"generate={gen[first]} full-forward argmax={arg[first]}; recomputing the continuation with full forwards"
            )
            greedy = greedy_from_full(model, p, NEW_TOKENS, banned)
            logits = full_logits(model, p + greedy)
            arg = logits[len(p) - 1:len(p) - 1 + NEW_TOKENS].argmax(-1).tolist()
            eos_hit = any(t in banned for t in arg)
            if arg != greedy and not eos_hit:
                raise RuntimeError("full-forward greedy recompute is not self-consistent")
        if eos_hit:
            loud(f"an EOS id is the unmasked argmax on the greedy path (prompt len {len(p)}); argmax checks need masking")
        m = margins_of(logits, len(p) - 1, NEW_TOKENS)
        res.append(dict(prompt=p, greedy=greedy, generate=gen, agrees=agrees, logits=logits,
                        margin=min(m), eos_hit=eos_hit, cache_diff=cache_diff))
    return res


# ---------------------------------------------------------------------------------------------------
# Writing checkpoints
# ---------------------------------------------------------------------------------------------------
def to_nvidia_names(sd, embedding_key="backbone.embeddings.weight"):
    """transformers in-memory state dict -> NVIDIA published naming (backbone.*, one tensor per expert)."""
    out = {}
    for k, v in sd.items():
        if k.startswith("model."):
            nk = "backbone." + k[len("model."):]
        else:
            nk = k
        if nk == "backbone.embeddings.weight":
            nk = embedding_key
        if nk.endswith(".mixer.experts.up_proj") or nk.endswith(".mixer.experts.down_proj"):
            base, proj = nk.rsplit(".", 1)
            for e in range(v.shape[0]):
                out[f"{base}.{e}.{proj}.weight"] = v[e].contiguous().clone()
        else:
            out[nk] = v.contiguous().clone()
    return out


def read_safetensors(path):
    with safe_open(path, "pt") as f:
        return f.metadata(), {k: f.get_tensor(k) for k in f.keys()}


def legacy_config(cfg_json):
    """Rewrite a transformers 5.x config.json dict with the field names old Nemotron-H checkpoints used."""
    c = cfg_json
    pattern = "".join(PATTERN_CHARS[t] for t in c["layers_block_type"])
    assert c["head_dim"] == 128, "legacy configs have no head_dim; transformers then uses its default 128"
    legacy = {
        "architectures": ["NemotronHForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_nemotron_h.NemotronHConfig",
            "AutoModelForCausalLM": "modeling_nemotron_h.NemotronHForCausalLM",
        },
        "model_type": "nemotron_h",
        "hybrid_override_pattern": pattern,
        "num_hidden_layers": len(pattern),
        "vocab_size": c["vocab_size"],
        "hidden_size": c["hidden_size"],
        "intermediate_size": c["intermediate_size"],
        "hidden_act": "relu2",
        "mlp_hidden_act": c["mlp_hidden_act"],
        "mlp_bias": c["mlp_bias"],
        "num_attention_heads": c["num_attention_heads"],
        "num_key_value_heads": c["num_key_value_heads"],
        "attention_head_dim": c["head_dim"],
        "attention_bias": c["attention_bias"],
        "attention_dropout": 0.0,
        "hidden_dropout": 0.0,
        "mamba_num_heads": c["mamba_num_heads"],
        "mamba_head_dim": c["mamba_head_dim"],
        "ssm_state_size": c["ssm_state_size"],
        "mamba_n_groups": c["n_groups"],
        "mamba_d_conv": c["conv_kernel"],
        "mamba_expand": c["expand"],
        "mamba_chunk_size": c["chunk_size"],
        "mamba_conv_bias": c["use_conv_bias"],
        "mamba_proj_bias": c["mamba_proj_bias"],
        "mamba_hidden_act": c["mamba_hidden_act"],
        "mamba_dt_min": c["time_step_min"],
        "mamba_dt_max": c["time_step_max"],
        "mamba_dt_init_floor": c["time_step_floor"],
        "use_bias": c["use_bias"],
        "layer_norm_epsilon": c["layer_norm_epsilon"],
        "rms_norm_eps": c["layer_norm_epsilon"],
        "residual_in_fp32": False,
        "rescale_prenorm_residual": True,
        "initializer_range": c["initializer_range"],
        "max_position_embeddings": 8192,
        "num_logits_to_keep": 1,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_mamba_kernels": False,
        "bos_token_id": c["bos_token_id"],
        "eos_token_id": c["eos_token_id"],
        "pad_token_id": c["pad_token_id"],
        "torch_dtype": "float32",
        "transformers_version": "4.48.0.dev0",
    }
    return legacy


def reload_check(d, ref_model, prompts_and_greedy, key_mapping=None):
    kw = {}
    if key_mapping:
        kw["key_mapping"] = key_mapping
    m2, info = NemotronHForCausalLM.from_pretrained(
        d, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager",
        output_loading_info=True, **kw,
    )
    m2.eval()
    bad = {k: v for k, v in info.items() if v and k != "error_msgs"} if isinstance(info, dict) else {}
    if bad or (isinstance(info, dict) and info.get("error_msgs")):
        raise RuntimeError(f"reload of {d}: loading info not clean: {info}")
    sd1, sd2 = ref_model.state_dict(), m2.state_dict()
    assert sd1.keys() == sd2.keys(), (set(sd1) ^ set(sd2))
    for k in sd1:
        if not torch.equal(sd1[k], sd2[k]):
            raise RuntimeError(f"reload of {d}: tensor {k} differs")
    # As loaded (tensors live in the mmap'ed file, not 64-byte aligned): BLAS may round differently -> tiny diffs.
    maxdiff = 0.0
    for p, g, ref_logits in prompts_and_greedy:
        l2 = full_logits(m2, p + g)
        maxdiff = max(maxdiff, float((l2 - ref_logits).abs().max()))
    if maxdiff > 1e-4:
        raise RuntimeError(f"reload of {d}: logits differ, max abs diff {maxdiff}")
    # Copied into fresh (aligned) memory, the reloaded model must reproduce the logits bit for bit.
    for prm in m2.parameters():
        prm.data = prm.data.clone()
    for name, buf in list(m2.named_buffers()):
        mod = m2.get_submodule(name.rsplit(".", 1)[0])
        setattr(mod, name.rsplit(".", 1)[1], buf.clone())
    for p, g, ref_logits in prompts_and_greedy:
        if not torch.equal(full_logits(m2, p + g), ref_logits):
            raise RuntimeError(f"reload of {d}: logits not bit-identical after copying weights to aligned memory")
    return m2, maxdiff


# ---------------------------------------------------------------------------------------------------
# bf16 reference logits from the saved fixtures (--bf16-logits-only)
# ---------------------------------------------------------------------------------------------------
class ForceTokens:
    """A logits processor that makes greedy decoding pick tokens[step] (teacher forcing through generate)."""

    def __init__(self, tokens):
        self.tokens = tokens
        self.step = 0

    def __call__(self, input_ids, scores):
        forced = torch.full_like(scores, -float("inf"))
        forced[:, self.tokens[self.step]] = 0.0
        self.step += 1
        return forced


def rel_to_max(got, ref):
    """Per row max|got - ref| / max|ref|, the test's logit error measure; returns the worst row's value."""
    err = (got - ref).abs().amax(dim=-1)
    scale = ref.abs().amax(dim=-1).clamp_min(1e-30)
    return float((err / scale).max())


def fp32_on_bf16_weights(bf16_model, fixture_dir, **kw):
    """fp32 math on the bf16 model's (rounded) weights: the neutral reference both bf16 runs scatter around.
    e_score_correction_bias is fp32 in the bf16 model too (transformers keeps it so)."""
    m = NemotronHForCausalLM.from_pretrained(
        fixture_dir, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager", **kw
    ).to(next(bf16_model.parameters()).device).eval()
    src = {**dict(bf16_model.named_parameters()), **dict(bf16_model.named_buffers())}
    for n, t in [*m.named_parameters(), *m.named_buffers()]:
        t.copy_(src[n].float())
    return m


# Router margin below which bf16 rounding on either side may pick another expert set (the tests' kBf16RouterTieMargin,
# tests/common/tolerances.h; scripts/bf16_layer_error.py counts such positions too).
ROUTER_TIE_MARGIN = 0.01


@torch.no_grad()
def router_margins(model, ids):
    """[T] smallest top-k selection margin over the MoE layers at each position of one full forward (None: no MoE).
    The gate's outputs are (router logits [T, E], weights, indices); selection is on sigmoid + correction bias, over
    all experts (group-limited routing, n_group > 1, would need the group mask: not handled, so refused)."""
    margins, hooks = [], []
    for layer in model.model.layers:
        if layer.block_type != "moe":
            continue
        gate = layer.mixer.gate
        if model.config.n_group != 1 or gate.top_k >= model.config.n_routed_experts:
            raise RuntimeError(f"router_margins: n_group {model.config.n_group}, top_k {gate.top_k} of "
                               f"{model.config.n_routed_experts} experts is not supported (n_group 1, top_k < experts)")

        hooks.append(gate.register_forward_hook(lambda mod, args, out: margins.append(selection_margin(mod, out[0]))))
    model(input_ids=ids, use_cache=False)
    for h in hooks:
        h.remove()
    return torch.stack(margins).amin(0).cpu() if margins else None


@torch.no_grad()
def make_bf16_one(fixture_dir, name, outdir, device):
    from transformers import LogitsProcessorList

    expected = json.load(open(os.path.join(fixture_dir, "expected.json")))
    kw = {}
    if name == "legacy_dense":  # the old embedding name; see make_one
        kw["key_mapping"] = {r"^backbone\.embedding\.weight$": "backbone.embeddings.weight"}
    model = NemotronHForCausalLM.from_pretrained(
        fixture_dir, dtype=torch.bfloat16, attn_implementation="eager", experts_implementation="eager", **kw
    ).to(device)
    model.eval()
    assert not model.config.use_mamba_kernels, "the fixtures use transformers' torch Mamba path"
    assert next(model.parameters()).dtype == torch.bfloat16
    model32 = fp32_on_bf16_weights(model, fixture_dir, **kw)
    rows_written, agree, total, worst_cache_vs_full, worst_vs_fp32 = [], 0, 0, 0.0, 0.0
    for p, (prompt, greedy) in enumerate(zip(expected["prompts"], expected["greedy"])):
        n_prompt, n_new = len(prompt), len(greedy)
        ids = torch.tensor([prompt], dtype=torch.long, device=device)
        # Prompt rows: the prefill (a forward over the prompt; row i = logits after token i).
        pre = model(input_ids=ids, use_cache=False).logits[0].float()  # [n_prompt, V]
        # Decode rows: generate() feeding the reference tokens one cached step at a time; out.logits are the raw
        # (unprocessed) logits of each step, the first from the prefill's last position.
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
            num_beams=1, return_dict_in_generate=True, output_logits=True,
            logits_processor=LogitsProcessorList([ForceTokens(greedy)]),
        )
        got_tokens = out.sequences[0, n_prompt:].tolist()
        assert got_tokens == greedy, f"{name} prompt {p}: forced generate returned {got_tokens[:8]}..."
        dec = torch.stack([l[0].float() for l in out.logits])  # [n_new, V]
        # Teacher-forced rows: prompt positions 0 .. n_prompt-2, then the n_new decode rows (position n_prompt-1 is
        # the first decode row, produced by the prefill inside generate()).
        logits = torch.cat([pre[: n_prompt - 1], dec], dim=0).cpu()
        assert logits.shape[0] == n_prompt + n_new - 1
        # Diagnostics: transformers' own bf16 noise (cached path vs one full forward over the same tokens) and
        # top-1 agreement with the fp32 fixture logits.
        full = model(input_ids=torch.tensor([prompt + greedy[:-1]], device=device), use_cache=False).logits[0]
        worst_cache_vs_full = max(worst_cache_vs_full, rel_to_max(logits, full.float().cpu()))
        ref32 = torch.from_numpy(np.load(os.path.join(fixture_dir, f"logits_{p}.npy")))[: logits.shape[0]]
        worst_vs_fp32 = max(worst_vs_fp32, rel_to_max(logits, ref32))
        agree += int((logits.argmax(-1) == ref32.argmax(-1)).sum())
        total += logits.shape[0]
        fn = f"{name}.logits_bf16_{p}.npy"
        np.save(os.path.join(outdir, fn), logits.numpy().astype(np.float32))
        rows_written.append((fn, logits.shape[0]))
        rm = router_margins(model32, torch.tensor([prompt + greedy[:-1]], device=device))
        if rm is not None:
            assert rm.shape[0] == logits.shape[0]
            np.save(os.path.join(outdir, f"{name}.router_margin_{p}.npy"), rm.numpy().astype(np.float32))
            log(f"  {name} prompt {p}: {int((rm < ROUTER_TIE_MARGIN).sum())} of {rm.shape[0]} positions with a "
                f"router margin below {ROUTER_TIE_MARGIN} (smallest {float(rm.min()):.2e})")
    meta = {
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "device": torch.cuda.get_device_name() if str(device).startswith("cuda") else str(device),
        "model": name,
        "dtype": "bfloat16 (from_pretrained(dtype=torch.bfloat16) of the float32 checkpoint)",
        "implementation": "eager attention, eager experts, torch Mamba path (use_mamba_kernels=False)",
        "rows": "teacher forced: prompt rows 0..len(prompt)-2 from a forward over the prompt, then len(greedy) "
                "cached decode steps through generate() with each reference greedy token forced",
        "logits_files": [fn for fn, _ in rows_written],
        "top1_agreement_with_fp32_fixture": agree / total,
        "max_rel_to_max_vs_fp32_fixture": worst_vs_fp32,
        "max_rel_to_max_cached_vs_full_forward_bf16": worst_cache_vs_full,
    }
    with open(os.path.join(outdir, f"{name}.expected_bf16.json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    log(f"  {name}: {len(rows_written)} files, top-1 vs fp32 fixture {agree}/{total} = {100.0 * agree / total:.2f} %, "
        f"max rel-to-max vs fp32 {worst_vs_fp32:.3e}, transformers bf16 cached vs full forward {worst_cache_vs_full:.3e}")
    return rows_written


def make_bf16_logits(fixtures_root, outdir, only, device):
    os.makedirs(outdir, exist_ok=True)
    names = sorted(n for n in os.listdir(fixtures_root)
                   if os.path.exists(os.path.join(fixtures_root, n, "expected.json")) and (not only or n in only))
    if not names:
        raise RuntimeError(f"no fixtures (expected.json) under {fixtures_root}")
    log(f"bf16 reference logits on {device} for {', '.join(names)} -> {outdir}")
    for name in names:
        make_bf16_one(os.path.join(fixtures_root, name), name, outdir, device)
    log("\ninstall them with (repository root):")
    for name in names:
        margins = (f"{outdir}/{name}.router_margin_*.npy "
                   if os.path.exists(os.path.join(outdir, f"{name}.router_margin_0.npy")) else "")
        log(f"  for f in {outdir}/{name}.logits_bf16_*.npy {margins}{outdir}/{name}.expected_bf16.json; do "
            f"cp \"$f\" tests/fixtures/models/{name}/\"${{f##*/{name}.}}\"; done")


# ---------------------------------------------------------------------------------------------------
def make_one(name, spec, outdir):
    log(f"\n=== {name} ===")
    cfg_kwargs = dict(spec["cfg"])
    vocab = cfg_kwargs["vocab_size"]

    # Seed search: first seed (spec seed, +1, ...) whose smallest greedy top-2 logit margin >= TARGET_MARGIN and
    # whose smallest router selection margin (k-th vs (k+1)-th biased score) >= TARGET_ROUTER_MARGIN.
    best = None
    for attempt in range(MAX_SEED_TRIES):
        seed = spec["seed"] + attempt
        torch.manual_seed(seed)
        model = build_model(cfg_kwargs)
        randomize(model, spec["bias_std"])
        prompts = make_prompts(seed, vocab)
        res = evaluate(model, prompts)
        # Diagnostics over the reference full forwards.
        probe = Probe(model)
        for r in res:
            full_logits(model, r["prompt"] + r["greedy"])
        probe.close()
        mm = min(r["margin"] for r in res)
        rm = probe.router_margin
        ok = mm >= TARGET_MARGIN and rm >= TARGET_ROUTER_MARGIN
        score = (ok, min(mm / TARGET_MARGIN, rm / TARGET_ROUTER_MARGIN))
        log(f"  seed {seed}: min top-2 margin {mm:.5f}, router margin {rm:.6f}, "
            f"generate agrees {[r['agrees'] for r in res]}")
        if best is None or score > best[0]:
            best = (score, seed, model, prompts, res, probe)
        if ok:
            break
    score, seed, model, prompts, res, probe = best
    if not score[0]:
        loud(f"{name}: no seed reached the margin targets; using seed {seed}")

    d = os.path.join(outdir, name)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    model.save_pretrained(d)  # config.json, generation_config.json, model.safetensors
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    st_path = os.path.join(d, "model.safetensors")
    meta, saved = read_safetensors(st_path)
    nv = to_nvidia_names(sd)
    same_as_save_pretrained = saved.keys() == nv.keys() and all(torch.equal(saved[k], nv[k]) for k in nv)
    log(f"  save_pretrained wrote {len(saved)} tensors, metadata {meta}; NVIDIA naming: {same_as_save_pretrained}")
    if not same_as_save_pretrained:
        log(f"  save_pretrained keys (first 8): {sorted(saved)[:8]}")

    key_mapping = None
    notes = []
    if spec["naming"] == "hf":
        tensors = sd
        notes.append("model.safetensors uses transformers' in-memory naming (model.*, fused experts "
                     "mixer.experts.up_proj [E, I_moe, Lat] and mixer.experts.down_proj [E, Lat, I_moe]).")
    elif name == "legacy_dense":
        tensors = to_nvidia_names(sd, embedding_key="backbone.embedding.weight")
        key_mapping = {r"^backbone\.embedding\.weight$": "backbone.embeddings.weight"}
        notes.append("model.safetensors uses NVIDIA naming with the old embedding name backbone.embedding.weight. "
                     "transformers 5.17 has no alias for it: the reload check used from_pretrained(key_mapping="
                     "{'^backbone\\\\.embedding\\\\.weight$': 'backbone.embeddings.weight'}).")
    else:
        tensors = nv
        notes.append("model.safetensors uses NVIDIA's published naming (backbone.*, backbone.embeddings.weight, one "
                     "tensor per expert backbone.layers.{i}.mixer.experts.{e}.{up,down}_proj.weight).")
    os.remove(st_path)
    save_file(tensors, st_path, metadata={"format": "pt"})

    cfg_path = os.path.join(d, "config.json")
    if name == "legacy_dense":
        cfg_json = json.load(open(cfg_path))
        legacy = legacy_config(cfg_json)
        with open(cfg_path, "w") as f:
            json.dump(legacy, f, indent=2, sort_keys=True)
            f.write("\n")
        notes.append("config.json rewritten with legacy field names: hybrid_override_pattern, num_hidden_layers, "
                     "attention_head_dim (no head_dim; transformers ignores attention_head_dim and uses its default "
                     "head_dim 128, which equals attention_head_dim here), rms_norm_eps + layer_norm_epsilon (1e-6), "
                     "mamba_n_groups, mamba_d_conv, mamba_expand, mamba_chunk_size, mamba_conv_bias, mamba_dt_min/"
                     "max/init_floor, torch_dtype, auto_map; no MoE fields and no time_step_limit. The script "
                     "reloaded this directory with from_pretrained and got bit-identical weights and logits.")

    # Reload with transformers and check bitwise-identical weights and logits.
    pg = [(r["prompt"], r["greedy"], r["logits"]) for r in res]
    m2, reload_diff = reload_check(d, model, pg, key_mapping)
    if name == "legacy_dense":
        c1, c2 = model.config, m2.config
        for f in ("layers_block_type", "n_groups", "conv_kernel", "chunk_size", "head_dim", "layer_norm_epsilon",
                  "use_conv_bias", "num_attention_heads", "num_key_value_heads", "mamba_num_heads",
                  "mamba_head_dim", "ssm_state_size", "intermediate_size", "time_step_min"):
            a, b = getattr(c1, f), getattr(c2, f)
            assert a == b, f"legacy config field {f}: {a} != {b}"
            log(f"  legacy reload: {f} = {b}")
    log(f"  reload check OK ({d}): weights bit-identical, logits bit-identical (as mmap-loaded: max abs diff {reload_diff:.3g})")

    # Outputs.
    for i, r in enumerate(res):
        arr = r["logits"].numpy().astype(np.float32)
        assert arr.shape == (len(r["prompt"]) + len(r["greedy"]), vocab)
        np.save(os.path.join(d, f"logits_{i}.npy"), arr)

    layers = "".join(PATTERN_CHARS[t] for t in model.config.layers_block_type)
    notes.append(f"pattern {layers}; seed {seed}; float32 CPU, eager attention, eager experts, torch Mamba path "
                 "(use_mamba_kernels=False). greedy = generate(max_new_tokens=32, min_new_tokens=32, do_sample=False) "
                 "where generate_agrees, else recomputed with full forwards. lm_head rows 0..2 (pad/bos/eos) were "
                 "scaled by 0.1 so EOS never wins and plain argmax of logits_<p> rows len(prompt)-1.. reproduces greedy.")
    notes.append("transformers 5.17 Mamba prefill clamps softplus(dt) to >= time_step_min (0.001) in the chunked "
                 "scan but not in the single-token decode step; diagnostics.min_softplus_dt shows whether that matters.")
    expected = {
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "model": name,
        "weight_naming": spec["naming"],
        "pattern": layers,
        "seed": seed,
        "prompts": [r["prompt"] for r in res],
        "greedy": [r["greedy"] for r in res],
        "generate_greedy": [r["generate"] for r in res],
        "generate_agrees": [r["agrees"] for r in res],
        "min_top2_margin": [r["margin"] for r in res],
        "logits_files": [f"logits_{i}.npy" for i in range(len(res))],
        "diagnostics": {
            "min_router_selection_margin": (probe.router_margin if math.isfinite(probe.router_margin) else None),
            "min_softplus_dt": (probe.min_dt if math.isfinite(probe.min_dt) else None),
            "eos_argmax_on_greedy_path": [r["eos_hit"] for r in res],
            "generate_vs_full_forward_logits_max_abs_diff": [r["cache_diff"] for r in res],
            "save_pretrained_wrote_nvidia_naming": same_as_save_pretrained,
            "reload_logits_max_abs_diff_mmap": reload_diff,
        },
        "notes": " ".join(notes),
    }
    with open(os.path.join(d, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1)
        f.write("\n")

    nparams = sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers())
    files = {fn: os.path.getsize(os.path.join(d, fn)) for fn in sorted(os.listdir(d))}
    total = sum(files.values())
    if total > 3 * 1024 * 1024:
        loud(f"{name}: fixture directory is {total} bytes (> 3 MiB)")
    return dict(name=name, layers=layers, params=nparams, files=files, total=total,
                agrees=[r["agrees"] for r in res], margins=[r["margin"] for r in res], seed=seed,
                router=expected["diagnostics"]["min_router_selection_margin"],
                min_dt=expected["diagnostics"]["min_softplus_dt"], ntensors=len(tensors))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="output directory (one subdirectory per model)")
    ap.add_argument("--bf16-logits-only", metavar="OUTDIR",
                    help="only write bf16 reference logits of the existing fixtures, flat into OUTDIR (see above)")
    ap.add_argument("--fixtures", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                                       "fixtures", "models"),
                    help="--bf16-logits-only: the fixture directories to read")
    ap.add_argument("--device", default="cuda", help="--bf16-logits-only: torch device (cuda; cpu to smoke-test)")
    ap.add_argument("--tar", help="also pack the output directory's contents into this .tar.gz")
    ap.add_argument("--only", nargs="*", help="model names to make (default: all)")
    args = ap.parse_args()
    if args.bf16_logits_only:
        transformers.logging.set_verbosity_error()
        log(f"transformers {transformers.__version__}, torch {torch.__version__}, numpy {np.__version__}")
        torch.manual_seed(0)
        make_bf16_logits(args.fixtures, args.bf16_logits_only, args.only, args.device)
        return
    if not args.out:
        ap.error("--out is required (or --bf16-logits-only OUTDIR)")

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.set_grad_enabled(False)
    transformers.logging.set_verbosity_error()
    log(f"transformers {transformers.__version__}, torch {torch.__version__}, numpy {np.__version__}, "
        f"python {sys.version.split()[0]}")

    os.makedirs(args.out, exist_ok=True)
    rows = []
    for name, spec in MODELS.items():
        if args.only and name not in args.only:
            continue
        rows.append(make_one(name, spec, args.out))

    log("\n=== summary ===")
    log(f"transformers {transformers.__version__}, torch {torch.__version__}")
    hdr = f"{'model':<14}{'layers':<12}{'params':>9}{'tensors':>9}{'bytes':>10}  generate_agrees       min_top2_margin (per prompt)   router_margin  min_dt  seed"
    log(hdr)
    for r in rows:
        log(f"{r['name']:<14}{r['layers']:<12}{r['params']:>9}{r['ntensors']:>9}{r['total']:>10}  "
            f"{str(r['agrees']):<21} {', '.join(f'{m:.4f}' for m in r['margins']):<30} "
            f"{(r['router'] if r['router'] is not None else float('nan')):>13.5f} {r['min_dt']:.4f} {r['seed']}")
        for fn, sz in r["files"].items():
            log(f"    {fn:<26}{sz:>10}")
    if any(not all(r["agrees"]) for r in rows):
        loud("generate() disagreed with the full forward somewhere (see generate_agrees); the full forward is the reference")

    if args.tar:
        os.makedirs(os.path.dirname(os.path.abspath(args.tar)), exist_ok=True)
        with tarfile.open(args.tar, "w:gz") as t:
            for r in rows:
                t.add(os.path.join(args.out, r["name"]), arcname=r["name"])
        log(f"packed {args.tar} ({os.path.getsize(args.tar)} bytes)")


if __name__ == "__main__":
    main()
