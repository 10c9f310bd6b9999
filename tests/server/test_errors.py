# Every bad request gets its 4xx in OpenAI's error shape, and the server goes on serving.
import json
import socket
import subprocess
import threading
import time

import minihttp
import pytest

from conftest import API_KEY, MODEL_NAME, Server

AUTH = {"Authorization": "Bearer " + API_KEY}


def post(server, path, body, headers=AUTH, raw=None):
    content = raw if raw is not None else json.dumps(body)
    return minihttp.post(server.base + path, content=content, headers={"Content-Type": "application/json", **headers},
                      timeout=30)


def assert_error(r, status, param=None):
    assert r.status_code == status, (r.status_code, r.text)
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"}
    assert e["message"]
    assert e["code"] == status
    if param is not None:
        assert e["param"] == param, e


BAD_COMPLETIONS = [
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({}, "prompt"),
    ({"prompt": 12}, "prompt"),
    ({"prompt": [999999]}, "prompt"),  # outside the vocabulary
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 5000}, "max_tokens"),  # prompt + max_tokens over --max-model-len 4096
    ({"prompt": [5] * 4096}, "prompt"),                   # the prompt alone fills --max-model-len
    ({"prompt": "x", "temperature": -0.5}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_k": -7}, "top_k"),
    ({"prompt": "x", "min_p": 1.5}, "min_p"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "presence_penalty": 9}, "presence_penalty"),
    ({"prompt": "x", "repetition_penalty": -1}, "repetition_penalty"),
    ({"prompt": "x", "stop": [1, 2]}, "stop"),
    ({"prompt": "x", "stop_token_ids": [999999]}, "stop_token_ids"),
    ({"prompt": "x", "logprobs": 50}, "logprobs"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "seed": "abc"}, "seed"),
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),  # vLLM's "whole vocabulary": over the 20 cap
    ({"prompt": "x", "prompt_logprobs": "2"}, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt": "x", "echo": True, "logprobs": 21}, "logprobs"),
]


@pytest.mark.parametrize("body,param", BAD_COMPLETIONS)
def test_bad_completion_fields(server, body, param):
    assert_error(post(server, "/v1/completions", body), 400, param)


BAD_CHAT = [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1}, "max_completion_tokens"),
]


@pytest.mark.parametrize("body,param", BAD_CHAT)
def test_bad_chat_fields(server, body, param):
    assert_error(post(server, "/v1/chat/completions", body), 400, param)


@pytest.mark.parametrize("raw", ["{", "not json", "[1, 2]", "null", '{"prompt": "x"} extra', "\xff\xfe", ""])
def test_malformed_json(server, raw):
    assert_error(post(server, "/v1/completions", None, raw=raw.encode("utf-8", "surrogateescape")), 400)


def test_api_key(server):
    body = {"prompt": "x", "max_tokens": 1}
    assert_error(post(server, "/v1/completions", body, headers={}), 401)
    assert_error(post(server, "/v1/completions", body, headers={"Authorization": "Bearer wrong"}), 401)
    assert_error(minihttp.get(server.base + "/v1/models", timeout=10), 401)
    # Routes outside /v1 need no key (health checks, Prometheus), as in vLLM.
    assert minihttp.get(server.base + "/health", timeout=10).status_code == 200
    assert minihttp.get(server.base + "/metrics", timeout=10).status_code == 200


def test_unknown_model_and_path(server):
    assert_error(post(server, "/v1/completions", {"model": "gpt-9", "prompt": "x"}), 404, "model")
    assert_error(minihttp.get(server.base + "/v2/anything", timeout=10), 404)
    assert_error(minihttp.get(server.base + "/v1/completionsX", headers=AUTH, timeout=10), 404)


def test_wrong_method(server):
    r = minihttp.get(server.base + "/v1/completions", headers=AUTH, timeout=10)
    assert_error(r, 405)
    assert r.headers["allow"] == "POST"
    assert_error(minihttp.post(server.base + "/metrics", timeout=10), 405)


def test_body_too_large(server):
    big = json.dumps({"prompt": "x" * (2 << 20)})
    # Refused from Content-Length before the body is read (the server answers and closes).
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(big)).encode() + b"\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413 "), head
    assert json.loads(body)["error"]["code"] == 413
    # A chunked body (no Content-Length) that grows past the limit is cut off with 413 as well.
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        data = b""
        try:
            for _ in range(40):
                s.sendall(b"10000\r\n" + b"x" * 0x10000 + b"\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            while chunk := s.recv(65536):
                data += chunk
        except ConnectionResetError:
            pass
    assert data.startswith(b"HTTP/1.1 413 ") or data == b"", data[:200]
    # curl announces large bodies with Expect: 100-continue; the server refuses from the header alone.
    out = subprocess.run(["curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", "-H", "Expect: 100-continue",
                          "-H", "Authorization: Bearer " + API_KEY, "--data-binary", "@-",
                          server.base + "/v1/completions"], input=big, capture_output=True, text=True, timeout=30)
    assert out.stdout == "413", out


def test_header_too_large(server):
    r = minihttp.get(server.base + "/health", headers={"X-Big": "a" * (100 << 10)}, timeout=10)
    assert_error(r, 431)


def test_garbage_http_is_400_or_closed(server):
    for raw in [b"GARBAGE\r\n\r\n", b"GET / HTTP/9.9\r\n\r\n", b"\x00\x01\x02\r\n\r\n",
                b"POST /v1/completions HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
                b"POST /v1/completions HTTP/1.1\r\nContent-Length: 10\r\nContent-Length: 20\r\n\r\n"]:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(raw)
            data = s.recv(65536)
            assert data == b"" or data.startswith(b"HTTP/1.1 4"), data[:100]
    assert minihttp.get(server.base + "/health", timeout=10).status_code == 200


def test_slow_client_is_closed(server):
    """A client that sends half a header and stalls is dropped after --request-timeout (10 s here)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        t0 = time.time()
        assert s.recv(100) == b""
        assert 5 < time.time() - t0 < 25
    assert minihttp.get(server.base + "/health", timeout=10).status_code == 200


def test_queue_full_is_503_with_retry_after():
    s = Server("--max-num-seqs", "1", "--max-waiting-seqs", "0")
    try:
        auth = {"Authorization": "Bearer " + API_KEY}
        long_req = {"prompt": "x", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        with minihttp.Client(timeout=60) as c:
            with c.stream("POST", s.base + "/v1/completions", json=long_req, headers=auth) as first:
                assert first.status_code == 200
                next(first.iter_lines())  # it runs
                r = c.post(s.base + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=auth)
                assert_error(r, 503)
                assert int(r.headers["retry-after"]) >= 1
        # The first stream was closed: its slot frees and the server serves again.
        deadline = time.time() + 10
        while True:
            r = minihttp.post(s.base + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=auth, timeout=30)
            if r.status_code == 200 or time.time() > deadline:
                break
            time.sleep(0.05)
        assert r.status_code == 200, r.text
    finally:
        assert s.stop() == 0
