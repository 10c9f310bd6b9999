# A small HTTP/1.1 client on the standard library (http.client) for the raw requests of the server tests: exact
# bytes in, status / headers / body out, streaming by lines, keep-alive per Client. The `openai` client covers
# the API as users call it; this covers what it never sends (bad bodies, wrong methods, huge headers, hang-ups).
import http.client
import json as jsonlib
import urllib.parse


class Response:
    def __init__(self, status, headers, body):
        self.status_code = status
        self.headers = {k.lower(): v for k, v in headers}
        self.content = body
        self.text = body.decode("utf-8", "replace")

    def json(self):
        return jsonlib.loads(self.content)


class _Stream:
    def __init__(self, conn, resp):
        self._conn, self._resp = conn, resp
        self.status_code = resp.status
        self.headers = {k.lower(): v for k, v in resp.getheaders()}

    def iter_lines(self):
        while True:
            line = self._resp.readline()
            if not line:
                return
            yield line.decode("utf-8", "replace").rstrip("\r\n")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        # Hang up (the server sees the client go away mid-stream).
        self._conn.close()


class Client:
    def __init__(self, timeout=30):
        self.timeout = timeout
        self._conns = {}

    def _conn(self, netloc):
        c = self._conns.get(netloc)
        if c is None:
            host, port = netloc.rsplit(":", 1)
            c = http.client.HTTPConnection(host, int(port), timeout=self.timeout)
            self._conns[netloc] = c
        return c

    def _prepare(self, url, content, json, headers):
        u = urllib.parse.urlsplit(url)
        path = u.path + ("?" + u.query if u.query else "")
        headers = dict(headers or {})
        if json is not None:
            content = jsonlib.dumps(json)
            headers.setdefault("Content-Type", "application/json")
        if isinstance(content, str):
            content = content.encode("utf-8")
        return u.netloc, path, content, headers

    def request(self, method, url, content=None, json=None, headers=None):
        netloc, path, body, headers = self._prepare(url, content, json, headers)
        for attempt in (0, 1):
            c = self._conn(netloc)
            try:
                c.request(method, path, body=body, headers=headers)
                r = c.getresponse()
                data = r.read()
                if r.getheader("connection", "").lower() == "close":
                    c.close()
                    self._conns.pop(netloc, None)
                return Response(r.status, r.getheaders(), data)
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                # A keep-alive connection the server closed while idle: once more on a fresh one.
                c.close()
                self._conns.pop(netloc, None)
                if attempt:
                    raise

    def get(self, url, **kw):
        return self.request("GET", url, **kw)

    def post(self, url, **kw):
        return self.request("POST", url, **kw)

    def stream(self, method, url, content=None, json=None, headers=None):
        netloc, path, body, headers = self._prepare(url, content, json, headers)
        host, port = netloc.rsplit(":", 1)
        c = http.client.HTTPConnection(host, int(port), timeout=self.timeout)
        c.request(method, path, body=body, headers=headers)
        return _Stream(c, c.getresponse())

    def close(self):
        for c in self._conns.values():
            c.close()
        self._conns.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def get(url, timeout=30, **kw):
    with Client(timeout) as c:
        return c.get(url, **kw)


def post(url, timeout=30, **kw):
    with Client(timeout) as c:
        return c.post(url, **kw)
