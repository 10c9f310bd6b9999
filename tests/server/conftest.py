# A real `chimera serve` process on a free loopback port (--port 0; the server prints the address it bound),
# shared by the tests of one session. CHIMERA_CLI names the binary (ctest passes it).
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "models", "nemotron-h-tiny")
API_KEY = "test-key"
MODEL_NAME = "tiny"


def cli_path():
    path = os.environ.get("CHIMERA_CLI", os.path.join(ROOT, "build", "chimera"))
    if not os.access(path, os.X_OK):
        pytest.fail(f"CHIMERA_CLI={path} is not an executable chimera binary")
    return path


class Server:
    def __init__(self, *extra, model=MODEL):
        self.proc = subprocess.Popen(
            [cli_path(), "serve", "-m", model, "--host", "127.0.0.1", "--port", "0",
             "--served-model-name", MODEL_NAME, "--api-key", API_KEY, *extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines = []
        deadline = time.time() + 60
        self.port = None
        while time.time() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line)
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
            if m:
                self.port = int(m.group(1))
                break
        if self.port is None:
            self.proc.kill()
            raise RuntimeError("chimera serve did not start:\n" + "".join(self.lines) + self.proc.stdout.read())
        # Keep draining stdout so the server never blocks on a full pipe.
        self._drain = threading.Thread(target=self._read_rest, daemon=True)
        self._drain.start()
        self.base = f"http://127.0.0.1:{self.port}"

    def _read_rest(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    def alive(self):
        return self.proc.poll() is None

    def stop(self, sig=signal.SIGTERM, timeout=30):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None


@pytest.fixture(scope="session")
def server():
    s = Server("--max-num-seqs", "64", "--shutdown-timeout", "5", "--max-request-body-bytes", str(1 << 20),
               "--request-timeout", "10", "--reasoning-parser", "nemotron_v3", "--tool-call-parser", "nemotron_v3")
    yield s
    rc = s.stop()
    assert rc == 0, "chimera serve exited with %r:\n%s" % (rc, "".join(s.lines[-40:]))


def metrics(base):
    """/metrics as {series: value} (series with labels as printed)."""
    import minihttp
    text = minihttp.get(base + "/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            out[series] = float(value)
    return out


def metric(base, name, **labels):
    """One series of /metrics by name and labels (model_name added)."""
    want = dict(labels, model_name=MODEL_NAME)
    for series, value in metrics(base).items():
        if not series.startswith(name + "{"):
            continue
        got = dict(kv.split("=", 1) for kv in series[len(name) + 1:-1].split(","))
        got = {k: v.strip('"') for k, v in got.items()}
        if got == want:
            return value
    raise KeyError(f"{name}{labels} not in /metrics")


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")
