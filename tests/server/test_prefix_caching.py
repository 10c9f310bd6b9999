# chimera serve with --enable-prefix-caching through the real `openai` client: a chat resent turn after turn
# and completions sharing a long prefix get exactly the greedy text of a server with --no-enable-prefix-caching, and
# /metrics counts the queried and hit tokens (the cached server's grow, the other's stay 0).
import openai
import pytest

from conftest import API_KEY, ROOT, Server, metric

KJV = ROOT + "/models/nemotron-h-kjv"
# Long enough to cross several checkpoints of --mamba-checkpoint-interval 32.
PREFIX = ("In the beginning God created the heaven and the earth. And the earth was without form, and void; and "
          "darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters. ")
ENDINGS = ["And God said,", "And the evening and the morning were", "And God saw the light,"]


@pytest.fixture(scope="module")
def servers():
    common = ("--max-num-seqs", "4", "--shutdown-timeout", "5", "--mamba-checkpoint-interval", "32")
    cached = Server(*common, "--enable-prefix-caching", model=KJV)
    plain = Server(*common, "--no-enable-prefix-caching", model=KJV)
    yield cached, plain
    for s in (cached, plain):
        assert s.stop() == 0, "".join(s.lines[-40:])


def client(s):
    return openai.OpenAI(base_url=s.base + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def test_shared_prefixes_give_the_uncached_text_and_count_hits(servers):
    cached, plain = servers
    hits_before = metric(cached.base, "chimera:prefix_cache_hits_total")
    queries_before = metric(cached.base, "chimera:prefix_cache_queries_total")
    for ending in ENDINGS + ENDINGS:  # every prompt twice: the second time all but its tail is cached
        want = client(plain).completions.create(model="tiny", prompt=PREFIX + ending, max_tokens=24, temperature=0)
        got = client(cached).completions.create(model="tiny", prompt=PREFIX + ending, max_tokens=24, temperature=0)
        assert got.choices[0].text == want.choices[0].text
    hits = metric(cached.base, "chimera:prefix_cache_hits_total") - hits_before
    queries = metric(cached.base, "chimera:prefix_cache_queries_total") - queries_before
    assert queries > 0 and hits >= 0.5 * queries, (hits, queries)
    assert metric(plain.base, "chimera:prefix_cache_hits_total") == 0
    assert metric(cached.base, "chimera:mamba_checkpoints") > 0


def test_a_chat_resent_turn_after_turn(servers):
    cached, plain = servers
    hits_before = metric(cached.base, "chimera:prefix_cache_hits_total")
    histories = {id(cached): [], id(plain): []}
    for turn in ["Who created the heaven?", "And what of the earth?", "What moved upon the waters?"]:
        answers = []
        for s in (cached, plain):
            history = histories[id(s)]
            history.append({"role": "user", "content": PREFIX + turn if not history else turn})
            r = client(s).chat.completions.create(model="tiny", messages=history, max_tokens=20, temperature=0)
            history.append({"role": "assistant", "content": r.choices[0].message.content})
            answers.append(r.choices[0].message.content)
        assert answers[0] == answers[1]
    assert metric(cached.base, "chimera:prefix_cache_hits_total") > hits_before
