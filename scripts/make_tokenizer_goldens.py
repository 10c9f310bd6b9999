#!/usr/bin/env python3
"""Trains small tokenizers with HF `tokenizers` and writes goldens for Chimera's C++ tokenizer.

Usage (from the repository root):
    python3 -m venv .venv && .venv/bin/pip install -q tokenizers numpy
    .venv/bin/python scripts/make_tokenizer_goldens.py

Writes
    tests/fixtures/tokenizer/<name>/tokenizer.json   trained tokenizer
    tests/fixtures/tokenizer/<name>/golden.json      HF encode/decode results for every corpus case
    models/nemotron-h-tiny/tokenizer.json            the bundled model's tokenizer (vocab exactly 4096)
    models/nemotron-h-tiny/tokenizer_config.json     bos/eos and a ChatML chat template

Corpus: tests/fixtures/tokenizer/corpus.txt, one case per line; the escapes \\n, \\r and \\t inside a line
stand for newline, carriage return and tab (any other backslash is literal). golden.json stores the decoded
texts themselves, so the C++ test never parses the escapes.

Training text: /usr/share/common-licenses/*, /usr/share/doc/*/copyright (English legal prose, present on
Debian/Ubuntu), corpus.txt and train_multilingual.txt. BpeTrainer is deterministic for a given input, but the
system files differ between machines, so the committed tokenizers (not this script's rerun) are the fixture.
"""
import glob
import json
import os
import re

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import trainers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(ROOT, "tests", "fixtures", "tokenizer")

# Nemotron-H / Mistral-Tekken pre-tokenizer regex.
NEMOTRON_REGEX = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|"
    r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Llama-3 regex.
LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def unescape(line):
    return line.replace("\\n", "\n").replace("\\r", "\r").replace("\\t", "\t")


def corpus_cases():
    with open(os.path.join(FIX, "corpus.txt"), encoding="utf-8", newline="") as f:
        lines = [l[:-1] if l.endswith("\n") else l for l in f.read().split("\n")]
    if lines and lines[-1] == "":
        lines.pop()
    cases = [unescape(l) for l in lines]
    # A multi-line document, and a line repeated (exercises any word cache).
    cases.append("\n".join(cases))
    cases.append(" ".join([cases[1]] * 20))
    return cases


def training_files():
    files = sorted(glob.glob("/usr/share/common-licenses/*"))
    files += sorted(glob.glob("/usr/share/doc/*/copyright"))
    files = [f for f in files if os.path.isfile(f) and not os.path.islink(f)]
    files += [os.path.join(FIX, "corpus.txt"), os.path.join(FIX, "train_multilingual.txt")]
    return files


def training_iterator():
    for path in training_files():
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        if path.endswith("corpus.txt"):
            text = unescape(text)
        # Chunks of a few lines, so that \n runs and indentation are seen in context.
        lines = text.split("\n")
        for i in range(0, len(lines), 8):
            yield "\n".join(lines[i:i + 8])


def gpt2_style(vocab_size):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(training_iterator(), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", pair="<|endoftext|> $A <|endoftext|> $B:1",
        special_tokens=[("<|endoftext|>", tok.token_to_id("<|endoftext|>"))])
    return tok


NEMOTRON_SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
NEMOTRON_NON_SPECIAL = ["<tool_call>", "</tool_call>"]


def nemotron_style(vocab_size):
    """Llama-3 / Nemotron-H layout: Split(Tekken regex, isolated) + ByteLevel without its own regex."""
    tok = Tokenizer(models.BPE(unk_token=None, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(NEMOTRON_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(NEMOTRON_NON_SPECIAL), min_frequency=2,
                                  special_tokens=NEMOTRON_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(training_iterator(), trainer)
    # Non-special added tokens (like Nemotron's tool-call markers): matched before the model, kept on decode
    # with skip_special_tokens=True.
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in NEMOTRON_NON_SPECIAL])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B:1", special_tokens=[("<s>", 1)])
    assert tok.token_to_id("<s>") == 1 and tok.token_to_id("</s>") == 2
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size, tok.get_vocab_size(with_added_tokens=True)
    return tok


def llama3_style(vocab_size):
    """Llama-3 regex split; ByteLevel post-processor in a Sequence with a template; lstrip/rstrip tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2,
                                  special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(training_iterator(), trainer)
    tok.add_special_tokens([AddedToken("<|im_start|>", lstrip=True), AddedToken("<|im_end|>", rstrip=True),
                            AddedToken("<s>", single_word=True)])
    tok.add_tokens([AddedToken("<tool_call>", special=False, normalized=True)])
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B:1",
                                      special_tokens=[("<|begin_of_text|>", 0)]),
    ])
    return tok


def llama2_style(vocab_size):
    """SentencePiece-like BPE in tokenizer.json form: Prepend/Replace normalizer, byte_fallback, no pre-tokenizer."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=["<unk>", "<s>", "</s>"],
                                  limit_alphabet=160, show_progress=False)
    tok.train_from_iterator(training_iterator(), trainer)
    # Insert the 256 <0xXX> byte tokens after the specials, as SentencePiece models have them.
    d = json.loads(tok.to_str())
    vocab = d["model"]["vocab"]
    ordered = sorted(vocab.items(), key=lambda kv: kv[1])
    new_vocab = {}
    for t, _ in ordered[:3]:
        new_vocab[t] = len(new_vocab)
    for b in range(256):
        new_vocab["<0x%02X>" % b] = len(new_vocab)
    for t, _ in ordered[3:]:
        if t not in new_vocab:
            new_vocab[t] = len(new_vocab)
    d["model"]["vocab"] = new_vocab
    for at in d["added_tokens"]:
        at["id"] = new_vocab[at["content"]]
    tok = Tokenizer.from_str(json.dumps(d))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                                       special_tokens=[("<s>", 1)])
    return tok


def invalid_utf8_cases(tok, byte_token):
    """Id sequences whose bytes are not valid UTF-8, with neighbours that are."""
    def ids(*parts):
        out = []
        for p in parts:
            if isinstance(p, int):
                out.append(byte_token(p))
            else:
                out.extend(tok.encode(p, add_special_tokens=False).ids)
        return out
    specials = [t for t in tok.get_added_tokens_decoder().values() if t.special]
    sp = tok.token_to_id(specials[-1].content)
    return [
        ids(0x80),                                  # lone continuation byte
        ids("a", 0x80, 0x81, "b"),                  # two continuation bytes
        ids(0xF0, 0x9F, 0x98),                      # truncated 4-byte emoji
        ids("x", 0xF0, 0x9F, 0x98, "y"),            # truncated emoji between letters
        ids(0xE2, 0x82),                            # truncated 3-byte sequence
        ids(0xC0, 0x80),                            # overlong NUL
        ids(0xE0, 0x80, 0x80),                      # overlong 3-byte
        ids(0xED, 0xA0, 0x80),                      # UTF-16 surrogate
        ids(0xF4, 0x90, 0x80, 0x80),                # above U+10FFFF
        ids(0xFF, 0xFE, "ok"),                      # bytes never valid in UTF-8
        ids(0xF0, 0x9F, 0x98, 0x80),                # a complete emoji from single bytes (valid)
        ids(0xE2, "z", 0x82, 0xAC),                 # interrupted sequence
        [sp] + ids(0xF0, 0x9F) + [sp],              # special tokens around a fragment
    ]


def byte_level_byte_token(tok):
    table = {}
    # GPT-2 bytes_to_unicode
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    for b, c in zip(bs, cs):
        table[b] = chr(c)
    return lambda b: tok.token_to_id(table[b])


def write_goldens(name, tok, byte_token):
    out_dir = os.path.join(FIX, name)
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    # Reload from the file, so the goldens come from exactly what the C++ side reads.
    tok = Tokenizer.from_file(os.path.join(out_dir, "tokenizer.json"))
    cases = []
    for text in corpus_cases():
        ids = tok.encode(text, add_special_tokens=False).ids
        ids_special = tok.encode(text, add_special_tokens=True).ids
        cases.append({
            "text": text,
            "ids": ids,
            "ids_with_special": ids_special,
            "decoded": tok.decode(ids_special, skip_special_tokens=False),
            "decoded_skip_special": tok.decode(ids_special, skip_special_tokens=True),
        })
    invalid = []
    for ids in invalid_utf8_cases(tok, byte_token):
        assert all(i is not None for i in ids), (name, ids)
        invalid.append({"ids": ids, "decoded": tok.decode(ids, skip_special_tokens=False),
                        "decoded_skip_special": tok.decode(ids, skip_special_tokens=True)})
    golden = {"tokenizer": name, "vocab_size": tok.get_vocab_size(with_added_tokens=True),
              "cases": cases, "invalid_utf8": invalid}
    with open(os.path.join(out_dir, "golden.json"), "w", encoding="utf-8") as f:
        json.dump(golden, f, ensure_ascii=False, indent=0)
        f.write("\n")
    print(f"{name}: vocab {golden['vocab_size']}, {len(cases)} cases, {len(invalid)} invalid-utf8 cases")
    return tok


def main():
    gpt2 = gpt2_style(2048)
    write_goldens("gpt2_style", gpt2, byte_level_byte_token(gpt2))

    nemo = nemotron_style(4096)
    write_goldens("nemotron_style", nemo, byte_level_byte_token(nemo))

    llama3 = llama3_style(2048)
    write_goldens("llama3_style", llama3, byte_level_byte_token(llama3))

    llama2 = llama2_style(2048)
    write_goldens("llama2_style", llama2, lambda b: llama2.token_to_id("<0x%02X>" % b))

    # The bundled tiny model's tokenizer is the Nemotron-style one.
    model_dir = os.path.join(ROOT, "models", "nemotron-h-tiny")
    os.makedirs(model_dir, exist_ok=True)
    nemo.save(os.path.join(model_dir, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": 8192,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHATML_TEMPLATE,
    }
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=2)
        f.write("\n")
    sample = "The quick brown fox jumps over the lazy dog. Licensed under the Apache License."
    print("nemotron-h-tiny sample:", nemo.encode(sample).tokens)


if __name__ == "__main__":
    main()
