# Prompt logprobs through the real `openai` client: /v1/completions with echo and logprobs covers the prompt's
# tokens (the first with null entries, as vLLM and OpenAI's legacy format) then the generated ones, and the
# prompt's values equal the log-softmax of the logits rows that `chimera generate --logits-out` writes for the
# same prompt. vLLM's `prompt_logprobs` extension field gives them per choice.
import math
import os
import struct
import subprocess

import openai
import pytest

from conftest import API_KEY, MODEL, MODEL_NAME, cli_path

PROMPT = "The quick brown fox jumps over the lazy dog because"
K = 2
# The server computes the rows batched and in prefill chunks, --logits-out in one run of its own: fp32 rounding
# moves a logit by at most ~1e-4 of the largest one (tests/common/tolerances.h kModelLogitsRelToMax), a
# log-softmax value by at most twice that.
REL_TO_MAX = 2e-4


def read_npy_f32(path):
    """A little-endian float32 .npy (the format --logits-out writes) as (shape, flat list)."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:6] == b"\x93NUMPY"
    major = data[6]
    hlen = struct.unpack("<H", data[8:10])[0] if major == 1 else struct.unpack("<I", data[8:12])[0]
    start = (10 if major == 1 else 12) + hlen
    header = data[start - hlen:start].decode()
    assert "'<f4'" in header and "'fortran_order': False" in header, header
    shape = tuple(int(x) for x in header.split("'shape': (")[1].split(")")[0].split(",") if x.strip())
    n = math.prod(shape)
    return shape, list(struct.unpack(f"<{n}f", data[start:start + 4 * n]))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(client, tmp_path_factory):
    """Prompt ids and, per prompt position i >= 1, (logprob of token i, [(id, logprob)] of the K most likely,
    max |logit|) from generate's logits rows."""
    ids = client.post("/../tokenize", body={"prompt": PROMPT}, cast_to=object)["tokens"]
    path = os.path.join(tmp_path_factory.mktemp("logits"), "logits.npy")
    subprocess.run([cli_path(), "generate", "-m", MODEL, "--prompt-ids", ",".join(map(str, ids)), "-n", "1", "-q",
                    "--logits-out", path], check=True, capture_output=True)
    (rows, vocab), flat = read_npy_f32(path)
    assert rows == len(ids)  # one row per prompt position (the last one samples the single new token)
    ref = []
    for i in range(1, len(ids)):
        row = flat[(i - 1) * vocab:i * vocab]
        mx = max(row)
        lse = mx + math.log(sum(math.exp(v - mx) for v in row))
        order = sorted(range(vocab), key=lambda t: (-row[t], t))
        ref.append((row[ids[i]] - lse, [(t, row[t] - lse) for t in order[:K]], max(abs(v) for v in row)))
    return ids, ref


def check_prompt_part(client, lp, ids, ref):
    n = len(ids)
    assert lp.tokens[0] == client.post("/../detokenize", body={"tokens": ids[:1]}, cast_to=object)["prompt"]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, n):
        want, top, scale = ref[i - 1]
        tol = REL_TO_MAX * scale
        assert lp.token_logprobs[i] == pytest.approx(want, abs=tol), f"position {i}"
        got = lp.top_logprobs[i]
        # The prompt token itself plus the K most likely (K keys when it is one of them).
        assert lp.tokens[i] in got and got[lp.tokens[i]] == pytest.approx(lp.token_logprobs[i])
        assert len(got) == K + (0 if ids[i] in [t for t, _ in top] else 1)
        for t, v in top:
            s = client.post("/../detokenize", body={"tokens": [t]}, cast_to=object)["prompt"]
            assert got[s] == pytest.approx(v, abs=tol), f"position {i} alternative {t}"
    detok = [client.post("/../detokenize", body={"tokens": [t]}, cast_to=object)["prompt"] for t in ids]
    assert lp.tokens[:n] == detok


def check_offsets(lp):
    # Characters (code points), as vLLM counts them with Python's len.
    at = 0
    for tok, off in zip(lp.tokens, lp.text_offset):
        assert off == at
        at += len(tok)


def test_echo_with_max_tokens_zero_scores_the_prompt_alone(client, reference):
    """vLLM's scoring request (evaluation harnesses): echo, max_tokens 0 and logprobs give the prompt, its
    logprobs, no generated token and finish_reason "length"."""
    ids, ref = reference
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=0, temperature=0, echo=True,
                                  logprobs=K)
    c = r.choices[0]
    assert c.text == PROMPT and c.finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == len(ids)
    check_prompt_part(client, lp, ids, ref)
    check_offsets(lp)
    # Without echo, 0 is a client error naming the field.
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=0)
    assert e.value.body["param"] == "max_tokens"


def test_echo_logprobs_cover_the_prompt_then_the_output(client, reference):
    ids, ref = reference
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0, echo=True,
                                  logprobs=K, extra_body={"ignore_eos": True})
    c = r.choices[0]
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids) + 5
    check_prompt_part(client, lp, ids, ref)
    check_offsets(lp)
    assert c.text.startswith(PROMPT)
    assert "".join(lp.tokens[len(ids):]) == c.text[len(PROMPT):]
    # The generated part equals a request without echo.
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=K,
                                      extra_body={"ignore_eos": True}).choices[0].logprobs
    assert lp.tokens[len(ids):] == plain.tokens
    assert lp.token_logprobs[len(ids):] == pytest.approx(plain.token_logprobs)
    # vLLM's per-choice prompt_logprobs: null, then {id: {logprob, rank, decoded_token}} with the prompt token.
    pl = c.model_extra["prompt_logprobs"]
    assert len(pl) == len(ids) and pl[0] is None
    for i in range(1, len(ids)):
        entry = pl[i][str(ids[i])]
        assert entry["logprob"] == pytest.approx(lp.token_logprobs[i])
        assert entry["rank"] >= 1 and entry["decoded_token"] == lp.tokens[i]
        ranks = sorted(e["rank"] for e in pl[i].values())
        assert ranks[:K] == list(range(1, K + 1)) and len(ranks) == K + (entry["rank"] > K)

def test_echo_logprobs_streaming(client, reference):
    ids, ref = reference
    full = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0, echo=True,
                                     logprobs=K, extra_body={"ignore_eos": True}).choices[0]
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0,
                                            echo=True, logprobs=K, stream=True, extra_body={"ignore_eos": True}))
    # The first chunk carries the prompt's text and logprobs with the first token's (as vLLM sends it).
    first = chunks[0].choices[0]
    assert first.text.startswith(PROMPT)
    assert len(first.logprobs.tokens) == len(ids) + 1
    assert "".join(c.choices[0].text for c in chunks) == full.text
    tokens, lps, offsets = [], [], []
    for c in chunks:
        if c.choices[0].logprobs:
            tokens += c.choices[0].logprobs.tokens
            lps += c.choices[0].logprobs.token_logprobs
            offsets += c.choices[0].logprobs.text_offset
    assert tokens == full.logprobs.tokens
    assert lps[0] is None and lps[1:] == pytest.approx(full.logprobs.token_logprobs[1:])
    assert offsets == full.logprobs.text_offset


def test_echo_token_id_prompt_scoring(client, reference):
    """The lm-eval style scoring request: token ids, echo, logprobs 0, one new token; streaming and not."""
    ids, ref = reference
    for stream in (False, True):
        r = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=1, echo=True, logprobs=0,
                                      temperature=0, stream=stream, extra_body={"ignore_eos": True})
        choices = [c.choices[0] for c in r if c.choices] if stream else r.choices
        lp_tokens = [t for c in choices if c.logprobs for t in c.logprobs.tokens]
        lp_values = [v for c in choices if c.logprobs for v in c.logprobs.token_logprobs]
        lp_top = [d for c in choices if c.logprobs for d in c.logprobs.top_logprobs]
        assert len(lp_tokens) == len(lp_values) == len(lp_top) == len(ids) + 1
        assert lp_values[0] is None and lp_top[0] is None
        for i in range(1, len(ids)):
            assert lp_values[i] == pytest.approx(ref[i - 1][0], abs=REL_TO_MAX * ref[i - 1][2])
            assert list(lp_top[i]) == [lp_tokens[i]]  # logprobs 0: the token's own entry only
        assert [c.finish_reason for c in choices if c.finish_reason] == ["length"]


def test_prompt_logprobs_field_without_echo(client, reference):
    ids, ref = reference
    c = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 1}).choices[0]
    assert c.logprobs is None
    pl = c.model_extra["prompt_logprobs"]
    assert len(pl) == len(ids) and pl[0] is None
    for i in range(1, len(ids)):
        assert pl[i][str(ids[i])]["logprob"] == pytest.approx(ref[i - 1][0], abs=REL_TO_MAX * ref[i - 1][2])
        assert 1 <= len(pl[i]) <= 2
        assert any(e["rank"] == 1 for e in pl[i].values())
