# chimera serve --tensor-parallel-size 2 (the bundled tiny model sharded over two CPU ranks, threads of the server)
# through the real `openai` client: greedy completions and chat completions, streamed and not, equal a server on
# one rank; several requests at once share the ranks' engine; /metrics exports the same series.
import concurrent.futures

import openai
import pytest

from conftest import API_KEY, MODEL_NAME, Server, metric, metrics

PROMPTS = ["Hello, my name is", "The capital of France is", "1, 2, 3, 4,"]
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]


@pytest.fixture(scope="module")
def servers():
    one = Server("--max-num-seqs", "8", "--shutdown-timeout", "5")
    two = Server("--max-num-seqs", "8", "--shutdown-timeout", "5", "--tensor-parallel-size", "2")
    yield one, two
    for s in (one, two):
        assert s.stop() == 0, "".join(s.lines[-40:])


def client(s):
    return openai.OpenAI(base_url=s.base + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def test_the_server_says_it_runs_two_ranks(servers):
    one, two = servers
    assert any("tensor parallel 2" in line for line in two.lines), "".join(two.lines)
    assert not any("tensor parallel" in line for line in one.lines), "".join(one.lines)


def test_greedy_completions_equal_one_rank(servers):
    one, two = servers
    for prompt in PROMPTS:
        want = client(one).completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0,
                                              extra_body={"ignore_eos": True})
        got = client(two).completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0,
                                             extra_body={"ignore_eos": True})
        assert got.choices[0].text == want.choices[0].text
        assert got.usage.completion_tokens == want.usage.completion_tokens == 24
        stream = client(two).completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0,
                                                extra_body={"ignore_eos": True}, stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == want.choices[0].text


def test_greedy_chat_equals_one_rank(servers):
    one, two = servers
    want = client(one).chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=24, temperature=0)
    got = client(two).chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=24, temperature=0)
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.choices[0].finish_reason == want.choices[0].finish_reason


def test_concurrent_requests_equal_one_rank(servers):
    # The scheduler batches them into shared steps over both ranks (prefill chunks and decodes together).
    one, two = servers

    def run(s, prompt):
        return client(s).completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0,
                                            extra_body={"ignore_eos": True}).choices[0].text

    want = [run(one, p) for p in PROMPTS]
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS) * 2) as pool:
        got = list(pool.map(lambda p: run(two, p), PROMPTS * 2))
    assert got == want * 2


def test_metrics_export_the_same_series(servers):
    one, two = servers
    client(two).completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=4, temperature=0)
    def names(base):
        return {series.partition("{")[0] for series in metrics(base)}

    assert names(two.base) == names(one.base)
    assert metric(two.base, "chimera:num_requests_running") == 0


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_serve_the_completions_of_one_rank(servers):
    # --nnodes 2: rank 1 in a second process (dist::HostGroup over loopback), which runs node 0's steps; it idles
    # between requests for longer than twice --dist-timeout and is still there, and ends when node 0 stops.
    import subprocess
    import time

    from conftest import MODEL, cli_path

    one, _ = servers
    port = str(free_port())
    nodes = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-port", port, "--dist-timeout", "1"]
    worker = subprocess.Popen(
        [cli_path(), "serve", "-m", MODEL, "--max-num-seqs", "8", *nodes, "--node-rank", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        node0 = Server("--max-num-seqs", "8", "--shutdown-timeout", "5", *nodes, "--node-rank", "0")
        try:
            assert any("tensor parallel 2" in line for line in node0.lines), "".join(node0.lines)
            for i, prompt in enumerate(PROMPTS):
                if i == 1:
                    time.sleep(3)  # idle: > 2 x --dist-timeout
                want = client(one).completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0,
                                                      extra_body={"ignore_eos": True})
                got = client(node0).completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16,
                                                       temperature=0, extra_body={"ignore_eos": True})
                assert got.choices[0].text == want.choices[0].text
            assert worker.poll() is None
        finally:
            assert node0.stop() == 0, "".join(node0.lines[-40:])
        out, _ = worker.communicate(timeout=30)
        assert worker.returncode == 0, out
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


def test_a_node_that_dies_makes_the_server_unhealthy(servers):
    # Node 1 is killed: the next step fails (500, naming node 1), then /health and every request answer 503 with
    # the reason, so an orchestrator can restart the server; the server itself keeps answering.
    import signal
    import subprocess

    import minihttp
    from conftest import MODEL, cli_path

    port = str(free_port())
    nodes = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-port", port, "--dist-timeout", "5"]
    worker = subprocess.Popen(
        [cli_path(), "serve", "-m", MODEL, "--max-num-seqs", "8", *nodes, "--node-rank", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    node0 = Server("--max-num-seqs", "8", "--shutdown-timeout", "5", *nodes, "--node-rank", "0")
    try:
        c = client(node0)
        assert c.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=4, temperature=0).choices
        assert minihttp.get(node0.base + "/health", timeout=10).status_code == 200
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=10)
        with pytest.raises(openai.InternalServerError) as e:
            c.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=4, temperature=0)
        assert "node 1 (rank 1)" in str(e.value)
        health = minihttp.get(node0.base + "/health", timeout=10)
        assert health.status_code == 503
        assert "node 1 (rank 1)" in health.text
        with pytest.raises(openai.APIStatusError) as e:
            c.completions.create(model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=4, temperature=0)
        assert e.value.status_code == 503
        assert node0.alive()
    finally:
        assert node0.stop() == 0, "".join(node0.lines[-40:])
        if worker.poll() is None:
            worker.kill()
            worker.wait()
