# SIGINT / SIGTERM: stop accepting, let in-flight requests finish within --shutdown-timeout, abort the rest
# (their streams end with finish_reason "abort" and [DONE]), exit 0.
import json
import signal
import socket
import threading
import time

import pytest

import minihttp
from conftest import API_KEY, Server

AUTH = {"Authorization": "Bearer " + API_KEY}


def read_stream(s, body, out):
    with minihttp.Client(timeout=60) as c:
        with c.stream("POST", s.base + "/v1/completions", json=body, headers=AUTH) as r:
            for line in r.iter_lines():
                out.append(line)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_shutdown_finishes_or_aborts_in_flight(sig):
    # The short request must finish inside the shutdown timeout even on a loaded machine (60 tokens at a tenth of
    # the tiny model's CPU speed), the long one must outlast it even on a fast one (4000 tokens).
    s = Server("--shutdown-timeout", "3")
    short, long_ = [], []
    threads = [threading.Thread(target=read_stream, args=(s, {"prompt": "a", "max_tokens": 60, "ignore_eos": True,
                                                                "stream": True}, short)),
               threading.Thread(target=read_stream, args=(s, {"prompt": "b", "max_tokens": 4000, "ignore_eos": True,
                                                                "stream": True}, long_))]
    for t in threads:
        t.start()
    deadline = time.time() + 10
    while (len(long_) < 2 or len(short) < 2) and time.time() < deadline:
        time.sleep(0.001)
    assert not any("[DONE]" in l for l in short), "the short stream should still run at the signal"
    t0 = time.time()
    s.proc.send_signal(sig)
    for t in threads:
        t.join(timeout=20)
    rc = s.stop(timeout=20)
    assert rc == 0, "".join(s.lines)
    assert time.time() - t0 < 10

    def finishes(lines):
        return [json.loads(l[6:])["choices"][0]["finish_reason"] for l in lines
                if l.startswith("data: {") and json.loads(l[6:])["choices"][0]["finish_reason"]]

    assert finishes(short) == ["length"] and short[-2:] == ["data: [DONE]", ""]
    assert finishes(long_) == ["abort"] and long_[-2:] == ["data: [DONE]", ""]
    # Nothing listens any more.
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", s.port), timeout=2).close()
