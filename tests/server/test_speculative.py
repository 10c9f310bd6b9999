# chimera serve with --speculative-config (the trained default model's MTP head drafts) through the real `openai`
# client: greedy completions, streamed and not, equal a server without speculation; a sampled completion is
# reproducible by its seed; /metrics carries the spec_decode counters, which grow with the requests.
import json

import openai
import pytest

from conftest import API_KEY, ROOT, Server, metric

KJV = ROOT + "/models/nemotron-h-kjv"
PROMPTS = ["In the beginning God created", "The LORD is my shepherd;", "And Jesus answered and said unto them,"]


@pytest.fixture(scope="module")
def servers():
    plain = Server("--max-num-seqs", "8", "--shutdown-timeout", "5", model=KJV)
    spec = Server("--max-num-seqs", "8", "--shutdown-timeout", "5", "--speculative-config",
                  json.dumps({"method": "mtp", "num_speculative_tokens": 3}), model=KJV)
    yield plain, spec
    for s in (plain, spec):
        assert s.stop() == 0, "".join(s.lines[-40:])


def client(s):
    return openai.OpenAI(base_url=s.base + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def test_greedy_equals_the_server_without_speculation(servers):
    plain, spec = servers
    drafts_before = metric(spec.base, "chimera:spec_decode_num_drafts")
    for prompt in PROMPTS:
        want = client(plain).completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0)
        got = client(spec).completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0)
        assert got.choices[0].text == want.choices[0].text
        assert got.usage.completion_tokens == 40
        stream = client(spec).completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0,
                                                 stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == want.choices[0].text
    drafts = metric(spec.base, "chimera:spec_decode_num_drafts") - drafts_before
    accepted = metric(spec.base, "chimera:spec_decode_num_accepted_tokens")
    assert drafts > 0 and accepted > 0
    assert metric(spec.base, "chimera:spec_decode_num_accepted_tokens_per_pos", position="0") > 0
    with pytest.raises(KeyError):  # a server without speculation exports no such series
        metric(plain.base, "chimera:spec_decode_num_drafts")


def test_sampling_is_reproducible_by_seed(servers):
    _, spec = servers
    args = dict(model="tiny", prompt=PROMPTS[0], max_tokens=32, temperature=0.8, top_p=0.95, seed=7)
    a = client(spec).completions.create(**args).choices[0].text
    b = client(spec).completions.create(**args).choices[0].text
    assert a == b and len(a) > 0
