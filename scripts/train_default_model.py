#!/usr/bin/env python3
"""Train Chimera's bundled default model: a small Nemotron-H with an MTP head, on the King James Bible.

Two steps, because the GPU machine reaches no package registry:

    python3 scripts/train_default_model.py prepare      # here: corpus, tokenizer, token ids (.deps/kjv/)
    python3 scripts/train_default_model.py train        # on the GPU machine (.deps/kjv carried): weights, report

`prepare` downloads Debian's `bible-kjv` and `bible-kjv-text` packages (apt-get download; the text is public
domain), unpacks them into .deps/kjv/, prints the whole book with the package's own `bible` program and cleans it
into one verse per line under each chapter heading ("Genesis 1"). It trains a byte-level BPE of 4096 tokens on that
text with HF `tokenizers`, in the Nemotron-H layout of scripts/make_tokenizer_goldens.py (same pre-tokenizer
regex, special tokens and ChatML template), and writes the token ids. The last 5 % of the chapters is held out for
validation.

`train` builds transformers' NemotronHForCausalLM (every layer kind: Mamba-2, attention, a dense ReLU^2 MLP, MoE
with a shared expert) and the MTP head of scripts/make_mtp_fixture.py (one block, sublayers "*E"), trains both for
--minutes on the GPU in fp32 (TF32 matmuls), the head applied recursively to its own output for depths 1..3 as the
engine drafts, and writes models/nemotron-h-kjv/:
  config.json, generation_config.json, tokenizer.json, tokenizer_config.json
  model.safetensors       bf16, NVIDIA's naming (backbone.*, one tensor per expert, mtp.layers.{j}.*); < 16 MB
  training.json           steps, seconds, validation loss and the head's top-1 accuracy at depth 1, 2, 3
  expected.json           prompts and transformers' greedy continuations (float32 on the CPU, from the bf16
                          weights as stored), for tests/models/default_model_test.cpp

Needs torch, transformers >= 5.10 and tokenizers. Seeded; the GPU's reduction order makes reruns differ slightly,
so the committed weights (not a rerun) are the model.
"""

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORK = os.path.join(ROOT, ".deps", "kjv")
DEFAULT_OUT = os.path.join(ROOT, "models", "nemotron-h-kjv")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

VOCAB = 4096
SEQ = 256
CFG = dict(
    vocab_size=VOCAB, hidden_size=256, use_mamba_kernels=False, tie_word_embeddings=False,
    hybrid_override_pattern="MEM*EM-E",
    num_attention_heads=8, num_key_value_heads=2, head_dim=32, attention_bias=False,
    intermediate_size=512, mlp_hidden_act="relu2", mlp_bias=False,
    mamba_num_heads=8, mamba_head_dim=64, ssm_state_size=32, n_groups=2, conv_kernel=4, chunk_size=64,
    use_conv_bias=True, use_bias=False, mamba_hidden_act="silu", layer_norm_epsilon=1e-5,
    n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
    moe_intermediate_size=128, moe_shared_expert_intermediate_size=256,
    routed_scaling_factor=1.0, n_group=1, topk_group=1, norm_topk_prob=True,
    num_nextn_predict_layers=1, mtp_layers_block_type=["full_attention", "moe"],
    bos_token_id=1, eos_token_id=2, pad_token_id=0, max_position_embeddings=8192,
)
PROMPTS = ["In the beginning God created", "And the LORD spake unto Moses, saying,",
           "Blessed are the poor in spirit:", "The LORD is my shepherd;"]
MTP_WEIGHTS = (0.5, 0.3, 0.2)  # the head's loss at depth 1, 2, 3


# ---- prepare (CPU machine) -----------------------------------------------------------------------------------

def clean_bible(raw):
    """`bible` output -> chapters, each [heading, verse, verse, ...] with verse numbers and line wraps removed."""
    chapters, verses, prev_blank = [], None, True
    for line in raw.splitlines():
        if not line.strip():
            prev_blank = True
            continue
        if prev_blank and not line.startswith(" "):  # a heading: "Genesis 1", "Song of Solomon 3"
            verses = [line.strip()]
            chapters.append(verses)
        else:
            m = re.match(r"^\s+\d+ (.*)$", line)
            if m:
                verses.append(m.group(1).strip())
            else:  # a wrapped verse
                verses[-1] += " " + line.strip()
        prev_blank = False
    return chapters


def prepare():
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    import numpy as np
    import make_tokenizer_goldens as mtg

    os.makedirs(WORK, exist_ok=True)
    debs = os.path.join(WORK, "debs")
    os.makedirs(debs, exist_ok=True)
    subprocess.run(["apt-get", "download", "bible-kjv", "bible-kjv-text"], cwd=debs, check=True)
    root = os.path.join(WORK, "root")
    for f in sorted(os.listdir(debs)):
        subprocess.run(["dpkg", "-x", os.path.join(debs, f), root], check=True)
    raw = subprocess.run([os.path.join(root, "usr", "bin", "bible"), "-p", os.path.join(root, "usr", "lib"),
                          "Gen1:1-Rev22:21"], check=True, capture_output=True, text=True).stdout
    chapters = clean_bible(raw)
    assert len(chapters) == 1189, len(chapters)
    texts = ["\n".join(c) + "\n" for c in chapters]
    n_val = len(texts) // 20
    train_text, val_text = "\n".join(texts[:-n_val]), "\n".join(texts[-n_val:])
    with open(os.path.join(WORK, "kjv.txt"), "w", encoding="utf-8") as f:
        f.write(train_text + "\n" + val_text)

    tok = Tokenizer(models.BPE(unk_token=None, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(mtg.NEMOTRON_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - len(mtg.NEMOTRON_NON_SPECIAL), min_frequency=2,
                                  special_tokens=mtg.NEMOTRON_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts[:-n_val], trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in mtg.NEMOTRON_NON_SPECIAL])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B:1",
                                                       special_tokens=[("<s>", 1)])
    assert tok.token_to_id("<s>") == 1 and tok.token_to_id("</s>") == 2
    assert tok.get_vocab_size(with_added_tokens=True) == VOCAB
    tok.save(os.path.join(WORK, "tokenizer.json"))
    # Each chapter: <s> text </s>, concatenated.
    for name, part in (("train", texts[:-n_val]), ("val", texts[-n_val:])):
        ids = []
        for t in part:
            ids += tok.encode(t).ids + [2]  # encode adds <s>
        np.save(os.path.join(WORK, f"{name}_ids.npy"), np.array(ids, dtype=np.int32))
        print(f"{name}: {len(part)} chapters, {len(ids)} tokens")


# ---- train (GPU machine) -------------------------------------------------------------------------------------

def train(minutes, seed, device, batch, out_dir):
    import numpy as np
    import torch
    import transformers
    from safetensors.torch import save_file
    import make_fixtures as mf
    import make_mtp_fixture as mm
    import make_tokenizer_goldens as mtg

    torch.manual_seed(seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    dev = torch.device(device)
    model = mf.build_model(CFG)
    head = mm.MtpBlock(model.config)
    model.to(dev).train()
    head.to(dev).train()
    train_ids = torch.from_numpy(np.load(os.path.join(WORK, "train_ids.npy")).astype(np.int64)).to(dev)
    val_ids = torch.from_numpy(np.load(os.path.join(WORK, "val_ids.npy")).astype(np.int64)).to(dev)
    if device == "cpu":  # the script's quick check: a sliver of the validation set
        val_ids = val_ids[:4 * SEQ]
    params = list(model.parameters()) + list(head.parameters())
    n_params = sum(p.numel() for p in params)
    print(f"{n_params / 1e6:.2f} M parameters; train {train_ids.numel()} tokens, val {val_ids.numel()}")
    opt = torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator(device=dev).manual_seed(seed)
    ce = torch.nn.functional.cross_entropy

    def losses(x):
        """LM loss and the head's loss and top-1 hits at each depth, the head applied to its own output."""
        hidden = model.model(input_ids=x, use_cache=False).last_hidden_state  # [B, T, D] after norm_f
        V = CFG["vocab_size"]
        lm = ce(model.lm_head(hidden[:, :-1]).reshape(-1, V), x[:, 1:].reshape(-1))
        out, h = [], hidden
        for d in range(1, 4):
            # Row i of depth d: position i + d - 1, token x_{i+d}, h the previous depth's row i; predicts x_{i+d+1}.
            T = x.shape[1] - d - 1
            hm = head(model.model.embeddings(x[:, d:d + T]), h[:, :T])
            logits = model.lm_head(hm)
            target = x[:, d + 1:d + 1 + T]
            out.append((ce(logits.reshape(-1, V), target.reshape(-1)),
                        (logits.argmax(-1) == target).float().mean()))
            h = hm
        return lm, out

    def sample(ids):
        starts = torch.randint(0, ids.numel() - SEQ - 1, (batch,), device=dev, generator=gen)
        return torch.stack([ids[s:s + SEQ] for s in starts.tolist()])

    @torch.no_grad()
    def evaluate():
        model.eval(), head.eval()
        lm_sum, acc = 0.0, [0.0, 0.0, 0.0]
        n = 0
        for s in range(0, val_ids.numel() - SEQ - 1, SEQ * batch):
            starts = list(range(s, min(s + SEQ * batch, val_ids.numel() - SEQ - 1), SEQ))
            x = torch.stack([val_ids[i:i + SEQ] for i in starts])
            lm, out = losses(x)
            lm_sum += float(lm) * len(starts)
            for d in range(3):
                acc[d] += float(out[d][1]) * len(starts)
            n += len(starts)
        model.train(), head.train()
        return lm_sum / n, [a / n for a in acc]

    # Warm-up 100 steps, cosine decay to 10 % over the steps the time budget allows (estimated after 20 steps).
    budget = minutes * 60.0
    t0 = time.time()
    step, total = 0, 10 ** 9
    log = []
    best = None  # (validation loss, head accuracies, step, model and head state)
    while step < total:
        lr_scale = min(1.0, (step + 1) / 100) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, step / total))))
        for g in opt.param_groups:
            g["lr"] = 3e-3 * lr_scale
        lm, out = losses(sample(train_ids))
        loss = lm + sum(w * l for w, (l, _) in zip(MTP_WEIGHTS, out))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if step == 20:
            per_step = (time.time() - t0) / 20
            total = max(20, int(budget / per_step))
            print(f"{per_step * 1e3:.1f} ms a step: {total} steps")
        if step % 100 == 0 or step == total:
            # Early stopping: 1M tokens are few for 6.75M parameters (the training loss keeps falling while the
            # held-out chapters' rises), so the weights kept are those of the best validation loss.
            val_loss, val_acc = evaluate()
            print(f"step {step}: lm {float(lm):.3f}, mtp " + " ".join(f"{float(l):.3f}" for l, _ in out) +
                  f"; validation {val_loss:.3f}, head top-1 " + " ".join(f"{a:.3f}" for a in val_acc), flush=True)
            log.append(dict(step=step, lm=float(lm), mtp=[float(l) for l, _ in out], validation_loss=val_loss))
            if best is None or val_loss < best[0]:
                best = (val_loss, val_acc, step, {k: v.detach().clone() for k, v in model.state_dict().items()},
                        {k: v.detach().clone() for k, v in head.state_dict().items()})
    seconds = time.time() - t0
    val_loss, val_acc, best_step, model_sd, head_sd = best
    model.load_state_dict(model_sd)
    head.load_state_dict(head_sd)
    print(f"{step} steps in {seconds:.0f} s; kept step {best_step}: validation loss {val_loss:.4f} "
          f"(ppl {math.exp(val_loss):.2f}), "
          f"head top-1 " + " ".join(f"{a:.3f}" for a in val_acc))

    # Export: bf16 under NVIDIA's names, the config as transformers writes it.
    OUT = out_dir
    shutil.rmtree(OUT, ignore_errors=True)
    os.makedirs(OUT)
    model.to("cpu").eval()
    head.to("cpu").eval()
    model.save_pretrained(OUT)
    os.remove(os.path.join(OUT, "model.safetensors"))
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    tensors = mf.to_nvidia_names(sd)
    tensors.update(mm.mtp_names(head, len(CFG["mtp_layers_block_type"])))
    keep_f32 = (".A_log", ".D", ".dt_bias", "e_score_correction_bias")  # as NVIDIA's checkpoints store them
    tensors = {k: (v if k.endswith(keep_f32) else v.to(torch.bfloat16)) for k, v in tensors.items()}
    save_file(tensors, os.path.join(OUT, "model.safetensors"), metadata={"format": "pt"})
    size = os.path.getsize(os.path.join(OUT, "model.safetensors"))
    assert size < 16 << 20, size
    with open(os.path.join(OUT, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": [2, 4], "pad_token_id": 0}, f, indent=2)
        f.write("\n")
    shutil.copy(os.path.join(WORK, "tokenizer.json"), OUT)
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
               "unk_token": "<unk>", "pad_token": None, "add_bos_token": True, "add_eos_token": False,
               "model_max_length": 8192, "clean_up_tokenization_spaces": False,
               "chat_template": mtg.CHATML_TEMPLATE}
    with open(os.path.join(OUT, "tokenizer_config.json"), "w") as f:
        json.dump(tok_cfg, f, ensure_ascii=False, indent=2)
        f.write("\n")

    # The reference continuations: the stored (bf16-rounded) weights in float32 on the CPU, greedy, eager.
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(OUT, "tokenizer.json"))
    ref = mf.build_model(CFG)
    ref_head = mm.MtpBlock(ref.config).eval()
    with torch.no_grad():
        for (k, v), (_, w) in zip(ref.state_dict().items(), model.state_dict().items()):
            v.copy_(w.to(torch.bfloat16).float() if not k.endswith(keep_f32) else w)
        for (k, v), (_, w) in zip(ref_head.state_dict().items(), head.state_dict().items()):
            v.copy_(w.to(torch.bfloat16).float())
    prompts, greedy, texts = [], [], []
    with torch.no_grad():
        for p in PROMPTS:
            ids = tok.encode(p).ids
            x = torch.tensor([ids])
            out = ref.generate(x, max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
            gen_ids = out[0, len(ids):].tolist()
            prompts.append(ids)
            greedy.append(gen_ids)
            texts.append(p + tok.decode(gen_ids))
            print(texts[-1].replace("\n", " | "))
    with open(os.path.join(OUT, "expected.json"), "w") as f:
        json.dump(dict(prompt_texts=PROMPTS, prompts=prompts, greedy=greedy, texts=texts,
                       notes=["transformers' NemotronHForCausalLM.generate, greedy, float32 on the CPU from the "
                              "bf16 weights as stored, eager attention and experts, 32 new tokens, EOS ignored."]),
                  f, indent=1)
        f.write("\n")
    with open(os.path.join(OUT, "training.json"), "w") as f:
        json.dump(dict(steps=step, kept_step=best_step, seconds=round(seconds, 1), batch=batch, sequence=SEQ, parameters=n_params,
                       seed=seed, validation_loss=val_loss, validation_perplexity=math.exp(val_loss),
                       mtp_top1_accuracy_by_depth=val_acc, mtp_loss_weights=MTP_WEIGHTS, log=log,
                       corpus="Debian bible-kjv-text (King James Version, public domain), 5 % of chapters held out",
                       versions=dict(torch=torch.__version__, transformers=transformers.__version__),
                       device=torch.cuda.get_device_name(0) if device == "cuda" else device), f, indent=1)
        f.write("\n")
    print(f"wrote {OUT}: {len(tensors)} tensors, {size / 2 ** 20:.1f} MiB")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("step", choices=["prepare", "train"])
    ap.add_argument("--minutes", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=1611)
    ap.add_argument("--device", default="cuda", help="cpu: a quick check of the script, not the model")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--out", default=DEFAULT_OUT)
    a = ap.parse_args()
    prepare() if a.step == "prepare" else train(a.minutes, a.seed, a.device, a.batch, a.out)


if __name__ == "__main__":
    main()
