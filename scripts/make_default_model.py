#!/usr/bin/env python3
"""Writes Chimera's bundled default model: a small Nemotron-H with random weights.

    .venv/bin/python scripts/make_default_model.py [--out models/nemotron-h-tiny]

The weights are random (seeded, so the file is reproducible), stored in bf16 under NVIDIA's published tensor
names (backbone.*, one tensor per expert). The tokenizer beside them (tokenizer.json) is a real trained
byte-level BPE made by scripts/make_tokenizer_goldens.py. The model covers every layer kind: Mamba-2 (M),
attention (*), dense relu2 MLP (-) and a routed MoE with a shared expert (E). It produces text-shaped
gibberish: it exists so the first command in the README runs with no download.
"""
import argparse
import json
import os

import numpy as np

CONFIG = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "vocab_size": 4096,
    "hidden_size": 128,
    "hybrid_override_pattern": "MEM*EM-E",
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "attention_bias": False,
    "intermediate_size": 256,
    "mlp_hidden_act": "relu2",
    "mlp_bias": False,
    "mamba_num_heads": 8,
    "mamba_head_dim": 32,
    "ssm_state_size": 32,
    "n_groups": 2,
    "conv_kernel": 4,
    "chunk_size": 64,
    "use_conv_bias": True,
    "use_bias": False,
    "mamba_hidden_act": "silu",
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 128,
    "moe_shared_expert_intermediate_size": 256,
    "n_shared_experts": 1,
    "moe_latent_size": None,
    "routed_scaling_factor": 2.5,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "layer_norm_epsilon": 1e-5,
    "tie_word_embeddings": False,
    "max_position_embeddings": 4096,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "torch_dtype": "bfloat16",
}


def bf16(a: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bits (round to nearest even), stored as uint16 then viewed by safetensors as BF16."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return r


def write_safetensors(path: str, tensors: dict) -> None:
    """The safetensors format written directly: numpy has no bf16, so bf16 arrays arrive as uint16 bits."""
    header, offset, blobs = {"__metadata__": {"format": "pt"}}, 0, []
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        dtype = {np.dtype(np.uint16): "BF16", np.dtype(np.float32): "F32"}[a.dtype]
        raw = a.tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        blobs.append(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)  # the data section starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little"))
        f.write(h)
        for raw in blobs:
            f.write(raw)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "models", "nemotron-h-tiny"))
    args = ap.parse_args()
    c = CONFIG
    rng = np.random.default_rng(20261130)
    D, V = c["hidden_size"], c["vocab_size"]
    H, P, N, G, K = c["mamba_num_heads"], c["mamba_head_dim"], c["ssm_state_size"], c["n_groups"], c["conv_kernel"]
    Di = H * P
    Cd = Di + 2 * G * N
    t = {}

    def lin(name, out_f, in_f, gain=1.0):
        t[name] = rng.normal(0, gain / np.sqrt(in_f), (out_f, in_f))

    t["backbone.embeddings.weight"] = rng.normal(0, 1.0, (V, D))
    for i, kind in enumerate(c["hybrid_override_pattern"]):
        p = f"backbone.layers.{i}."
        t[p + "norm.weight"] = 1.0 + rng.normal(0, 0.1, (D,))
        m = p + "mixer."
        if kind == "M":
            lin(m + "in_proj.weight", 2 * Di + 2 * G * N + H, D)
            t[m + "conv1d.weight"] = rng.normal(0, 0.5, (Cd, 1, K))
            t[m + "conv1d.bias"] = rng.normal(0, 0.1, (Cd,))
            t[m + "A_log"] = np.log(rng.uniform(1, 16, (H,)))
            t[m + "D"] = 1.0 + rng.normal(0, 0.2, (H,))
            t[m + "dt_bias"] = rng.normal(-2.0, 0.5, (H,))
            t[m + "norm.weight"] = 1.0 + rng.normal(0, 0.1, (Di,))
            lin(m + "out_proj.weight", D, Di)
        elif kind == "*":
            qh, kvh, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
            lin(m + "q_proj.weight", qh * hd, D)
            lin(m + "k_proj.weight", kvh * hd, D)
            lin(m + "v_proj.weight", kvh * hd, D)
            lin(m + "o_proj.weight", D, qh * hd)
        elif kind == "-":
            lin(m + "up_proj.weight", c["intermediate_size"], D)
            lin(m + "down_proj.weight", D, c["intermediate_size"])
        elif kind == "E":
            E, I, Ish = c["n_routed_experts"], c["moe_intermediate_size"], c["moe_shared_expert_intermediate_size"]
            lin(m + "gate.weight", E, D)
            t[m + "gate.e_score_correction_bias"] = rng.normal(0, 0.1, (E,))
            for e in range(E):
                lin(m + f"experts.{e}.up_proj.weight", I, D)
                lin(m + f"experts.{e}.down_proj.weight", D, I)
            lin(m + "shared_experts.up_proj.weight", Ish, D)
            lin(m + "shared_experts.down_proj.weight", D, Ish)
    t["backbone.norm_f.weight"] = 1.0 + rng.normal(0, 0.1, (D,))
    lin("lm_head.weight", V, D, gain=3.0)

    os.makedirs(args.out, exist_ok=True)
    tensors = {}
    for name, a in t.items():
        if name.endswith("e_score_correction_bias"):
            tensors[name] = a.astype(np.float32)  # kept fp32, as in the released checkpoints
        else:
            tensors[name] = bf16(a)
    path = os.path.join(args.out, "model.safetensors")
    write_safetensors(path, tensors)
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(c, f, indent=2)
        f.write("\n")
    with open(os.path.join(args.out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": [2, 4], "pad_token_id": 0}, f, indent=2)
        f.write("\n")
    n_params = sum(a.size for a in t.values())
    print(f"wrote {args.out}: {n_params} parameters, {os.path.getsize(path)} bytes")


if __name__ == "__main__":
    main()
