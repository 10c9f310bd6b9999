#!/usr/bin/env python3
"""A mock OpenAI-compatible server for the `chimera bench serve` tests (Python standard library only).

POST /v1/completions and /v1/chat/completions stream SSE chunks in OpenAI's format: after --ttft-ms one chunk
per token every --token-delay-ms, then (with stream_options.include_usage) a usage chunk with empty choices,
then `data: [DONE]`; HTTP/1.1 keep-alive with chunked transfer encoding, as vLLM's server answers. Tokens per
request: max_tokens (or --tokens). GET /v1/models lists --model. GET /stats returns what the server saw:
request count, peak concurrency, each request's arrival time (monotonic seconds), prompt length, whether the
prompt was a token-id list, max_tokens and ignore_eos.

Failure modes for the error tests (K-th request counted from 1): --fail-every K answers HTTP 500 with an
OpenAI error body; --malformed-every K streams one chunk of invalid JSON; --drop-every K closes the
connection after the first token. --api-key KEY answers 401 to requests without "Authorization: Bearer KEY".
--unavailable-first K answers the first K POSTs 503 (a server still starting; they are not counted in /stats).

Prints "PORT <n>" on stdout once listening (--port 0 picks a free loopback port).
"""
import argparse
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.requests = 0
        self.active = 0
        self.peak = 0
        self.arrivals = []
        self.prompt_lens = []
        self.prompt_is_ids = []
        self.max_tokens = []
        self.ignore_eos = []
        self.include_usage = []

    def begin(self, body):
        with self.lock:
            self.requests += 1
            self.active += 1
            self.peak = max(self.peak, self.active)
            self.arrivals.append(time.monotonic())
            prompt = body.get("prompt", body.get("messages"))
            is_ids = isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)
            self.prompt_is_ids.append(is_ids)
            self.prompt_lens.append(len(prompt) if is_ids else -1)
            self.max_tokens.append(body.get("max_tokens", body.get("max_completion_tokens")))
            self.ignore_eos.append(bool(body.get("ignore_eos", False)))
            self.include_usage.append(bool((body.get("stream_options") or {}).get("include_usage", False)))
            return self.requests

    def end(self):
        with self.lock:
            self.active -= 1

    def as_json(self):
        with self.lock:
            return {
                "requests": self.requests,
                "peak_concurrency": self.peak,
                "arrivals": self.arrivals,
                "prompt_lens": self.prompt_lens,
                "prompt_is_ids": self.prompt_is_ids,
                "max_tokens": self.max_tokens,
                "ignore_eos": self.ignore_eos,
                "include_usage": self.include_usage,
            }


def hits(k, n):
    return k > 0 and n % k == 0


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def send_json(self, code, obj):
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def write_chunk(self, data):
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def do_GET(self):
        opt = self.server.opt
        if self.path == "/v1/models":
            self.send_json(200, {"object": "list", "data": [{"id": opt.model, "object": "model"}]})
        elif self.path == "/stats":
            self.send_json(200, self.server.stats.as_json())
        else:
            self.send_json(404, {"error": {"message": "no such path", "type": "NotFoundError", "code": 404}})

    def do_POST(self):
        opt = self.server.opt
        length = int(self.headers.get("Content-Length", "0"))
        raw = self.rfile.read(length)
        chat = self.path == "/v1/chat/completions"
        if self.path not in ("/v1/completions", "/v1/chat/completions"):
            self.send_json(404, {"error": {"message": "no such path", "type": "NotFoundError", "code": 404}})
            return
        try:
            body = json.loads(raw)
        except ValueError:
            self.send_json(400, {"error": {"message": "malformed JSON", "type": "BadRequestError", "code": 400}})
            return
        if opt.api_key and self.headers.get("Authorization") != "Bearer " + opt.api_key:
            self.send_json(401, {"error": {"message": "invalid API key", "type": "AuthenticationError",
                                           "code": 401}})
            return
        with self.server.stats.lock:
            self.server.unavailable_left -= 1
            unavailable = self.server.unavailable_left >= 0
        if unavailable:
            self.send_json(503, {"error": {"message": "starting", "type": "ServiceUnavailableError", "code": 503}})
            return
        n = self.server.stats.begin(body)
        try:
            self.stream(body, n, chat)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client gave up on the stream (as it does on malformed SSE)
        finally:
            self.server.stats.end()

    def stream(self, body, n, chat):
        opt = self.server.opt
        if hits(opt.fail_every, n):
            self.send_json(500, {"error": {"message": "mock failure of request %d" % n,
                                           "type": "InternalServerError", "code": 500}})
            return
        tokens = opt.tokens if opt.tokens > 0 else int(body.get("max_tokens", body.get("max_completion_tokens", 16)))
        prompt = body.get("prompt", [])
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        created = int(time.time())
        rid = "cmpl-mock-%d" % n
        time.sleep(opt.ttft_ms / 1000.0)
        for i in range(tokens):
            if i > 0:
                time.sleep(opt.token_delay_ms / 1000.0)
            finish = "length" if i == tokens - 1 else None
            if chat:
                choice = {"index": 0, "delta": {"content": " tok"}, "finish_reason": finish}
                obj = {"id": rid, "object": "chat.completion.chunk", "created": created,
                       "model": body.get("model"), "choices": [choice]}
            else:
                choice = {"index": 0, "text": " tok", "logprobs": None, "finish_reason": finish}
                obj = {"id": rid, "object": "text_completion", "created": created,
                       "model": body.get("model"), "choices": [choice]}
            if hits(opt.malformed_every, n) and i == 1:
                self.write_chunk(b"data: {\"choices\": [ not json\n\n")
                continue
            self.write_chunk(b"data: " + json.dumps(obj).encode() + b"\n\n")
            if hits(opt.drop_every, n):
                self.close_connection = True
                self.wfile.flush()
                self.connection.shutdown(2)
                return
        if (body.get("stream_options") or {}).get("include_usage") and not opt.no_usage:
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": tokens,
                     "total_tokens": prompt_tokens + tokens}
            obj = {"id": rid, "object": "text_completion", "created": created, "model": body.get("model"),
                   "choices": [], "usage": usage}
            self.write_chunk(b"data: " + json.dumps(obj).encode() + b"\n\n")
        self.write_chunk(b"data: [DONE]\n\n")
        self.write_chunk(b"")


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # the listen backlog: a burst of connects must not wait for SYN retries


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--model", default="mock-model")
    ap.add_argument("--ttft-ms", type=float, default=0.0, help="delay before the first token")
    ap.add_argument("--token-delay-ms", type=float, default=0.0, help="delay between tokens")
    ap.add_argument("--tokens", type=int, default=0, help="tokens per response (0: the request's max_tokens)")
    ap.add_argument("--no-usage", action="store_true", help="never send the usage chunk")
    ap.add_argument("--fail-every", type=int, default=0)
    ap.add_argument("--malformed-every", type=int, default=0)
    ap.add_argument("--drop-every", type=int, default=0)
    ap.add_argument("--api-key", default="")
    ap.add_argument("--unavailable-first", type=int, default=0)
    opt = ap.parse_args()
    server = Server(("127.0.0.1", opt.port), Handler)
    server.opt = opt
    server.stats = Stats()
    server.unavailable_left = opt.unavailable_first
    print("PORT %d" % server.server_address[1], flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
