#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz harnesses (fuzz/corpus/<harness>/) from the repository's fixtures.

Seeds are small on purpose (libFuzzer mutates faster on short inputs): safetensors files keep the real
headers' first tensors with zero data, tokenizers keep their pipeline with a trimmed vocabulary.
Standard library only; run from anywhere: python3 scripts/make_fuzz_corpus.py
"""
import json
import pathlib
import struct

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "fuzz" / "corpus"
FIXTURE_MODELS = [ROOT / "models" / "nemotron-h-tiny"] + sorted((ROOT / "tests" / "fixtures" / "models").iterdir())
DTYPE_SIZE = {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "U8": 1, "I8": 1, "I32": 4, "I64": 8}


def write(harness, name, data):
    d = OUT / harness
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data if isinstance(data, bytes) else data.encode())


def safetensors_image(entries, metadata=None):
    header, offset = {}, 0
    if metadata:
        header["__metadata__"] = metadata
    for name, dtype, shape in entries:
        n = DTYPE_SIZE[dtype]
        for s in shape:
            n *= s
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":"))
    text += " " * ((8 - len(text) % 8) % 8)
    return struct.pack("<Q", len(text)) + text.encode() + bytes(offset)


def read_header(path):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n])


def main():
    names = []
    for model in FIXTURE_MODELS:
        header = read_header(model / "model.safetensors")
        small = [(k, v["dtype"], v["shape"]) for k, v in sorted(header.items()) if k != "__metadata__"]
        names += [k for k, _, _ in small]
        # The first tensors whose data stays small, with the model's own names, dtypes and shapes.
        kept, budget = [], 4096
        for k, dt, shape in small:
            n = DTYPE_SIZE.get(dt, 1)
            for s in shape:
                n *= s
            if dt in DTYPE_SIZE and n <= budget:
                kept.append((k, dt, shape))
                budget -= n
        write("safetensors_header", f"{model.name}.safetensors", safetensors_image(kept, {"format": "pt"}))
        write("model_config", f"{model.name}.json", (model / "config.json").read_text())
        gen = model / "generation_config.json"
        if gen.exists():
            write("generation_config", f"{model.name}.json", gen.read_text())
    write("safetensors_header", "every_dtype.safetensors",
          safetensors_image([(f"t_{d.lower()}", d, [2, 3]) for d in DTYPE_SIZE] + [("scalar", "F32", []),
                                                                                  ("empty", "BF16", [0, 4])]))
    for cfg in sorted((ROOT / "tests" / "fixtures" / "configs").glob("*.json")):
        write("model_config", cfg.name, cfg.read_text())
    write("generation_config", "list_eos.json", json.dumps({"eos_token_id": [2, 11], "bos_token_id": 1}))
    write("generation_config", "empty.json", "{}")

    for qdir in sorted((ROOT / "tests" / "fixtures" / "quant" / "configs").iterdir()):
        for f in sorted(qdir.glob("*.json")):
            write("quant_config", f"{qdir.name}-{f.name}", f.read_text())

    shards = [f"model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)]
    wm = {n: shards[i % 3] for i, n in enumerate(sorted(set(names))[:64])}
    write("safetensors_index", "index.json",
          json.dumps({"metadata": {"total_size": 123456}, "weight_map": wm}, indent=2))
    write("safetensors_index", "nested.json", json.dumps({"weight_map": {"a": "sub/dir/model.safetensors"}}))

    for tok_dir in sorted((ROOT / "tests" / "fixtures" / "tokenizer").iterdir()):
        if not (tok_dir / "tokenizer.json").exists():
            continue
        tok = json.loads((tok_dir / "tokenizer.json").read_text())
        vocab = tok["model"]["vocab"]
        keep = dict(sorted(vocab.items(), key=lambda kv: kv[1])[:300])
        merges = []
        for m in tok["model"].get("merges", []):
            a, b = m.split(" ", 1) if isinstance(m, str) else m
            if a in keep and b in keep and a + b in keep:
                merges.append(m)
        tok["model"]["vocab"] = keep
        tok["model"]["merges"] = merges
        if tok["model"].get("unk_token") not in (None, *keep):
            tok["model"]["unk_token"] = None
        tok["added_tokens"] = [t for t in tok.get("added_tokens") or [] if t["id"] < 300]
        write("tokenizer_json", f"{tok_dir.name}.json", json.dumps(tok, ensure_ascii=False, indent=1))
    lines = (ROOT / "tests" / "fixtures" / "tokenizer" / "corpus.txt").read_text().splitlines()
    for i in range(0, len(lines), 4):
        write("tokenizer_codec", f"corpus_{i // 4:02d}.txt", "\n".join(lines[i : i + 4]))
    write("tokenizer_codec", "chat.txt", "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")


if __name__ == "__main__":
    main()
