# /v1/chat/completions: the model's chat template, greedy output equal to `chimera generate` on the rendered
# prompt, streaming and not, the reasoning parser's split, and the other small routes.
import subprocess

import minihttp
import openai
import pytest

from conftest import API_KEY, MODEL, MODEL_NAME, cli_path

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def rendered_ids(server, messages, **kw):
    r = minihttp.post(server.base + "/tokenize", json={"messages": messages, **kw}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def generate_ids(ids, max_tokens):
    out = subprocess.run([cli_path(), "generate", "-m", MODEL, "--prompt-ids", ",".join(map(str, ids)),
                          "-n", str(max_tokens), "-q"], check=True, capture_output=True, text=True).stdout
    assert out.endswith("\n")
    return out[:-1]


def test_chat_greedy_equals_generate(server, client):
    ids = rendered_ids(server, MESSAGES)
    # The template writes the special tokens itself; none is added again (no BOS doubled in front).
    assert ids[:2] != [1, 1]
    expected = generate_ids(ids, 20)
    kw = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=20, temperature=0,
              extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    # enable_thinking false: the nemotron_v3 reasoning parser leaves everything as content; the rendered prompt
    # changes with it, so render it the same way.
    ids_nt = rendered_ids(server, MESSAGES, chat_template_kwargs={"enable_thinking": False})
    expected_nt = generate_ids(ids_nt, 20)
    r = client.chat.completions.create(**kw)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected_nt
    assert r.usage.prompt_tokens == len(ids_nt)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected_nt
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    # With thinking on (the default), output without </think> is all reasoning_content.
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=20, temperature=0)
    reasoning = r.choices[0].message.model_extra.get("reasoning_content")
    assert (reasoning or "") + (r.choices[0].message.content or "") == expected.replace("<think>", "", 1)


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for t in content:
        assert t.logprob <= 0.0
        assert len(t.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert t.top_logprobs[0].token == t.token
        assert abs(t.top_logprobs[0].logprob - t.logprob) < 1e-6
        assert bytes(t.bytes).decode("utf-8", "replace") == t.token


def test_models_health_version(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert minihttp.get(server.base + "/health", timeout=10).status_code == 200
    v = minihttp.get(server.base + "/version", timeout=10)
    assert v.status_code == 200 and v.json()["version"]


def test_tokenize_detokenize(server):
    text = "Hello, world! Ünïcödé ✓"
    ids = minihttp.post(server.base + "/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=10)
    assert ids.status_code == 200
    j = ids.json()
    assert j["count"] == len(j["tokens"]) > 0
    back = minihttp.post(server.base + "/detokenize", json={"tokens": j["tokens"]}, timeout=10)
    assert back.status_code == 200 and back.json()["prompt"] == text
    with_bos = minihttp.post(server.base + "/tokenize", json={"prompt": text}, timeout=10).json()["tokens"]
    assert with_bos == [1] + j["tokens"]
