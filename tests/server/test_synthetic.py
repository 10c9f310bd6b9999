# `chimera serve --synthetic` of a published shape (Nano, vocab 131072): no bundled tokenizer has its vocabulary,
# so the server gets a synthetic byte-level one and answers text and token-id prompts alike.
import minihttp
import pytest

from conftest import API_KEY, Server


@pytest.fixture(scope="module")
def synthetic_server():
    s = Server("--synthetic", "nemotron-3-nano-30b-a3b", "--num-layers", "1", "--max-num-seqs", "4",
               "--max-model-len", "256", "--shutdown-timeout", "5")
    yield s
    rc = s.stop()
    assert rc == 0, "chimera serve exited with %r:\n%s" % (rc, "".join(s.lines[-40:]))


def post(server, body):
    return minihttp.post(server.base + "/v1/completions", json=body,
                         headers={"Authorization": "Bearer " + API_KEY}, timeout=60)


@pytest.mark.parametrize("prompt", [[1, 500, 131071], "Hello"])
def test_completions_with_a_synthetic_tokenizer(synthetic_server, prompt):
    r = post(synthetic_server, {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0,
                                "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == 2
    assert body["usage"]["prompt_tokens"] == (3 if isinstance(prompt, list) else len(prompt.encode()))
    assert isinstance(body["choices"][0]["text"], str) and body["choices"][0]["text"]


def test_chat_needs_a_chat_template(synthetic_server):
    r = minihttp.post(synthetic_server.base + "/v1/chat/completions",
                      json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                      headers={"Authorization": "Bearer " + API_KEY}, timeout=60)
    assert r.status_code == 400, r.text
    assert "chat template" in r.text
