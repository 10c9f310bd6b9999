# /v1/completions through the real `openai` client and curl against a `chimera serve` process: greedy output
# equals `chimera generate`'s, streaming and not; usage; stop strings; n; echo; lists of prompts and token ids.
import json
import subprocess

import openai
import pytest

from conftest import API_KEY, MODEL, MODEL_NAME, cli_path

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "1, 2, 3,"]


def generate_reference(prompt, max_tokens):
    """Greedy text of `chimera generate` (it prints the prompt, then the generated text, then a newline)."""
    out = subprocess.run([cli_path(), "generate", "-m", MODEL, "-p", prompt, "-n", str(max_tokens), "-q"],
                         check=True, capture_output=True, text=True).stdout
    assert out.startswith(prompt) and out.endswith("\n")
    return out[len(prompt):-1]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def references():
    return {p: generate_reference(p, 24) for p in PROMPTS}


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_equals_generate(client, references, prompt):
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0)
    assert r.object == "text_completion"
    assert r.model == MODEL_NAME
    assert len(r.choices) == 1
    assert r.choices[0].text == references[prompt]
    assert r.choices[0].finish_reason in ("length", "stop")
    ids = client.post("/../tokenize", body={"prompt": prompt}, cast_to=object)["tokens"]
    assert r.usage.prompt_tokens == len(ids)
    if r.choices[0].finish_reason == "length":
        assert r.usage.completion_tokens == 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


@pytest.mark.parametrize("prompt", PROMPTS)
def test_streaming_equals_generate(client, references, prompt):
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == references[prompt]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishes) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens >= 1
    assert all(c.usage is None for c in chunks[:-1])


def test_curl_stream_framing(server, references):
    """The raw SSE bytes: `data: {json}` events separated by blank lines, ending in `data: [DONE]`."""
    prompt = PROMPTS[0]
    out = subprocess.run(["curl", "-sS", "-N", "--fail-with-body", server.base + "/v1/completions",
                          "-H", "Authorization: Bearer " + API_KEY, "-H", "Content-Type: application/json",
                          "-d", json.dumps({"prompt": prompt, "max_tokens": 24, "temperature": 0, "stream": True})],
                         check=True, capture_output=True, text=True).stdout
    events = out.split("\n\n")
    assert events[-1] == ""
    assert events[-2] == "data: [DONE]"
    text = ""
    for e in events[:-2]:
        assert e.startswith("data: ") and "\n" not in e
        text += json.loads(e[len("data: "):])["choices"][0]["text"]
    assert text == references[prompt]


def test_token_id_prompt_and_list(client, references):
    ids = client.post("/../tokenize", body={"prompt": PROMPTS[1]}, cast_to=object)["tokens"]
    r = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=24, temperature=0)
    assert r.choices[0].text == references[PROMPTS[1]]
    r = client.completions.create(model=MODEL_NAME, prompt=[PROMPTS[0], PROMPTS[2], ids], max_tokens=24,
                                  temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [references[PROMPTS[0]], references[PROMPTS[2]], references[PROMPTS[1]]]


def test_echo(client, references):
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=24, temperature=0, echo=True)
    assert r.choices[0].text == PROMPTS[0] + references[PROMPTS[0]]
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                            echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == PROMPTS[0] + references[PROMPTS[0]]


def test_stop_string_spanning_tokens(client, references):
    full = references[PROMPTS[0]]
    # A stop string from the middle of the greedy text, at least 3 characters (it spans a token boundary:
    # the tokens are short on this vocabulary).
    stop = full[6:10]
    assert len(stop) >= 3
    expected = full[:full.index(stop)]
    for stream in (False, True):
        if stream:
            chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=24,
                                                    temperature=0, stop=[stop, "\u00e9\u00e9\u00e9"], stream=True))
            text = "".join(c.choices[0].text for c in chunks)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
            assert finish == ["stop"]
        else:
            r = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                          stop=stop)
            text = r.choices[0].text
            assert r.choices[0].finish_reason == "stop"
        assert text == expected


def test_n_choices_seeded(client):
    kw = dict(model=MODEL_NAME, prompt=PROMPTS[3], max_tokens=12, temperature=1.0, top_p=0.95, n=3, seed=7)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1  # the choices draw with different seeds
    assert 3 <= a.usage.completion_tokens <= 3 * 12


def test_max_tokens_length(client):
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=3, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 3


def test_logprobs(client, references):
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert "".join(lp.tokens) == r.choices[0].text == references[PROMPTS[0]][:len(r.choices[0].text)]
    assert lp.text_offset[0] == 0
    for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert v <= 0.0
        # Greedy: the chosen token is the most likely of the top ones.
        assert tok in top and top[tok] == max(top.values())
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                            logprobs=2, stream=True, extra_body={"ignore_eos": True}))
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs)


def test_n_streaming(client):
    kw = dict(model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=6, temperature=0.9, n=2, seed=11)
    whole = client.completions.create(**kw)
    texts = ["", ""]
    for c in client.completions.create(**kw, stream=True):
        texts[c.choices[0].index] += c.choices[0].text
    assert texts == [c.text for c in whole.choices]
