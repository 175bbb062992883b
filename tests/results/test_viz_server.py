"""Local viewer over loopback: routes, limits, refusal of paths it was not given, Host check."""

from __future__ import annotations

import contextlib
import http.client
import json
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from mixlens.commands.report import ModelAnalyzer
from mixlens.viz.server import ViewerConfig, make_server, report_files


@pytest.fixture(scope="module")
def viewer(bundled, tmp_path_factory):
    d = tmp_path_factory.mktemp("served")
    (d / "given.html").write_text("<!doctype html><p>given report</p>")
    (d / "secret.html").write_text("<p>SECRET</p>")
    cfg = ViewerConfig(
        ModelAnalyzer(bundled, ["attention", "norm_resln"], heads=True),
        max_chars=200,
        max_tokens=24,
        files=report_files([d / "given.html"]),
        read_timeout=1.0,
    )
    srv = make_server(cfg, "127.0.0.1", 0)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv.server_address[1], d
    srv.shutdown()
    srv.server_close()
    t.join(5)


def request(port: int, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


def post(port: int, payload, ctype: str = "application/json"):
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return request(port, "POST", "/api/analyze", body, {"Content-Type": ctype})


def test_index_page(viewer):
    port, _ = viewer
    status, headers, body = request(port, "GET", "/")
    doc = body.decode()
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert "default-src 'none'" in doc and "connect-src 'self'" in doc
    assert '<a href="/files/given.html">' in doc


def test_analyze_returns_the_view_payload(viewer, bundled):
    port, _ = viewer
    status, headers, body = post(port, {"text": "The cat sat."})
    assert status == 200 and headers["Content-Type"] == "application/json"
    p = json.loads(body)
    ref = bundled.analyze(["The cat sat."], ["attention", "norm_resln"])
    assert p["inputs"][0]["tokens"] == ref.tokens[0]
    att = p["methods"][0]
    n = len(ref.tokens[0])
    assert att["name"] == "attention" and att["heads"] == bundled.adapter.layers[0].n_heads
    np.testing.assert_allclose(
        np.array(p["methods"][1]["values"][0]).reshape(-1, n, n), ref["norm_resln"].input(0), rtol=6e-4, atol=1e-7
    )


@pytest.mark.parametrize(
    "payload, status, message",
    [
        ({"text": "word " * 41}, 413, "input has 205 characters; the limit is 200"),
        ({"text": "a b c d e f g h i j k l m n o p q r s t u v w x y z"}, 413, "input has 28 tokens; the limit is 24"),
        ({"text": "   "}, 400, "the input is empty"),
        ({"txt": "x"}, 400, "send JSON"),
        (b"not json", 400, "send JSON"),
        (b"x" * 5000, 413, "too large; the input limit is 200 characters"),
        (b"[" * 1050, 400, "send JSON"),  # deeper than Python's recursion limit
        (b'{"text": "bad \\ud800 surrogate"}', 400, "lone surrogates"),
    ],
)
def test_refuses_bad_or_oversize_input(viewer, payload, status, message):
    port, _ = viewer
    got, _, body = post(port, payload)
    assert got == status and message in json.loads(body)["error"]


def test_slow_body_times_out(viewer):
    """A client that sends fewer bytes than Content-Length gets 408 instead of holding a thread."""
    import socket

    port, _ = viewer
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(
            b"POST /api/analyze HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"text"'
        )
        chunks = []
        while chunk := s.recv(4096):  # the server closes the connection after its answer
            chunks.append(chunk)
        reply = b"".join(chunks).decode()
    assert reply.startswith("HTTP/1.0 408") and "not received within 1 s" in reply


def test_refuses_forms_and_unknown_routes(viewer):
    port, _ = viewer
    got, _, body = post(port, b"text=x", "application/x-www-form-urlencoded")
    assert got == 415
    assert request(port, "POST", "/files/given.html", b"{}", {"Content-Type": "application/json"})[0] == 404


@pytest.mark.parametrize(
    "path",
    [
        "/files/secret.html",
        "/files/../secret.html",
        "/files/%2e%2e/secret.html",
        "/files/..%2fsecret.html",
        "/../../etc/passwd",
        "/etc/passwd",
        "/files/%2Fetc%2Fpasswd",
        "/files/",
        "/viewer.js",
        "/report.js",
    ],
)
def test_serves_only_what_it_was_given(viewer, path):
    port, _ = viewer
    status, _, body = request(port, "GET", path)
    assert status == 404 and b"SECRET" not in body and b"root:" not in body


def test_serves_a_given_report(viewer):
    port, d = viewer
    status, _, body = request(port, "GET", "/files/given.html")
    assert status == 200 and body == (d / "given.html").read_bytes()


def test_rejects_foreign_host_header(viewer):
    port, _ = viewer
    status, _, body = request(port, "GET", "/", headers={"Host": "evil.example:80"})
    assert status == 403 and b"unexpected Host" in body
    assert request(port, "GET", "/", headers={"Host": f"localhost:{port}"})[0] == 200


def test_serve_command_binds_loopback(monkeypatch, capsys):
    """`mixlens serve` end to end: the CLI builds the server on 127.0.0.1; shut down from the test."""
    import mixlens.viz.server as server_mod
    from mixlens.cli import main

    made = []

    def capture(*args, **kwargs):
        made.append(make_server(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(server_mod, "make_server", capture)
    codes = []

    def run():
        try:
            main(["serve", "--port", "0", "--method", "attention", "--max-chars", "50"])
        except SystemExit as e:
            codes.append(e.code)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    for _ in range(600):  # bounded wait for the model to load (≤ 60 s)
        if made:
            break
        t.join(0.1)
    assert made, "server was not created"
    srv = made[0]
    assert srv.server_address[0] == "127.0.0.1"
    port = srv.server_address[1]
    for _ in range(100):  # bounded wait for serve_forever to start answering
        try:
            status, _, body = request(port, "GET", "/")
            break
        except OSError:
            t.join(0.05)
    assert status == 200 and b"Methods: attention." in body
    assert post(port, {"text": "x" * 51})[0] == 413
    srv.shutdown()
    t.join(10)
    assert codes == [0]
    assert f"mixlens viewer on http://127.0.0.1:{port}/" in capsys.readouterr().err


# --- issue 32 items 20-23: raw-socket probes against a viewer with no model (no probe reaches one) ---


@pytest.fixture
def probe(tmp_path):
    """A viewer with a 1 s request deadline and 4 connection slots; yields (port, server)."""
    (tmp_path / "big.html").write_bytes(b"<p>" + b"x" * 4_000_000)
    cfg = ViewerConfig(
        SimpleNamespace(name="probe", methods=["attention"]),
        files=report_files([tmp_path / "big.html"]),
        read_timeout=1.0,
        max_connections=4,
        max_per_client=4,
    )
    srv = make_server(cfg, "127.0.0.1", 0)
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    yield srv.server_address[1], srv
    srv.shutdown()
    srv.server_close()
    t.join(5)


def read_reply(s: socket.socket, limit: float = 3.0) -> bytes:
    """What the server sends until it closes the connection (or `limit` seconds pass)."""
    end, chunks = time.monotonic() + limit, []
    while (left := end - time.monotonic()) > 0:
        s.settimeout(left)
        try:
            chunk = s.recv(65536)
        except (TimeoutError, ConnectionResetError):
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def raw(port: int, data: bytes, limit: float = 3.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=limit) as s:
        s.sendall(data)
        return read_reply(s, limit)


def handlers_done(limit: float = 5.0) -> None:
    """Wait (bounded) until no request thread of any viewer is running."""
    end = time.monotonic() + limit
    while any("process_request_thread" in t.name for t in threading.enumerate()) and time.monotonic() < end:
        time.sleep(0.02)


def test_partial_headers_hold_no_thread_past_the_deadline(probe, capsys):
    """Slowloris: connections that never finish their headers fill the 4 slots, the 5th gets 503 at once, and the
    4 are closed at the 1 s deadline; then the viewer answers again."""
    port, _ = probe
    slow = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(4)]
    try:
        for s in slow:
            s.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", port), timeout=5) as extra:
            assert read_reply(extra, 0.9).startswith(b"HTTP/1.0 503")
        for s in slow:
            assert read_reply(s, 4.0) == b""  # closed by the server (read_reply would wait 4 s otherwise)
        assert time.monotonic() - started < 3.0
    finally:
        for s in slow:
            s.close()
    handlers_done()
    for _ in range(40):  # the slots are free again (a release can trail the close by a moment)
        if (reply := raw(port, b"GET / HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")).startswith(b"HTTP/1.0 200"):
            break
        time.sleep(0.05)
    assert reply.startswith(b"HTTP/1.0 200")
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("request not received within 1 s") == 4
    assert "refused: more than 4 connections at once" in err


@pytest.mark.parametrize("head, reply", [(b"GET / HTTP/1.1\r\nX-Drip: ", b""), (None, b"HTTP/1.0 408")])
def test_dripped_request_meets_one_deadline(probe, head, reply):
    """A request dripped 1 byte / 0.2 s (each recv well within the 1 s timeout) is ended at the 1 s deadline."""
    port, _ = probe
    body = (
        b"POST /api/analyze HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(head or body)
        started, got = time.monotonic(), None
        for _ in range(25):  # ≤ 5 s of dripping
            try:
                s.sendall(b"x")
            except OSError:  # closed by the server
                got = read_reply(s, 1.0)
                break
            s.settimeout(0.2)
            try:
                got = s.recv(65536)
            except TimeoutError:
                continue
            got += read_reply(s, 1.0)
            break
        elapsed = time.monotonic() - started
    assert got is not None and got.startswith(reply) and elapsed < 3.0
    if reply:
        assert b"not received within 1 s" in got


@pytest.mark.parametrize(
    "headers, status, message",
    [
        (b"Content-Length: -1", 400, b"invalid Content-Length"),
        (b"Content-Length: 1_0", 400, b"invalid Content-Length"),  # int() would take it
        (b"Content-Length: \xb2", 400, b"invalid Content-Length"),  # superscript two: str.isdigit() is true
        (b"Content-Length: 5\r\nContent-Length: 70", 400, b"invalid Content-Length"),
        (b"", 411, b"Content-Length required"),
        (b"Transfer-Encoding: chunked", 411, b"Content-Length required"),
        (b"Content-Length: 99999999999999999999", 413, b"request of over 1000000000000000 bytes"),
    ],
)
def test_bad_content_length_is_refused_without_reading_the_body(probe, headers, status, message):
    """The refusal comes before the body (here 64 KB of a body that never ends) and before the 1 s deadline."""
    port, _ = probe
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(
            b"POST /api/analyze HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            + (headers + b"\r\n" if headers else b"")
            + b"\r\n"
        )
        started = time.monotonic()
        with contextlib.suppress(OSError):  # the server may have answered and closed already
            s.sendall(b"x" * 65536)
        got = read_reply(s, 3.0)
    assert got.startswith(b"HTTP/1.0 %d" % status) and message in got
    assert time.monotonic() - started < 0.9  # not the 408 of a read that waited for the body


@pytest.mark.parametrize(
    "hosts",
    [
        b"Host: 127.0.0.1\r\nHost: evil.example",  # CRLF + a second Host
        b"Host: [",
        b"Host: 127.0.0.1\r\n evil.example",  # folded onto a second line
        b"Host: 127.0.0.1 evil.example",
        b"Host: 127.0.0.1:80:80",
        b"Host: 127.0.0.1\x00",
        b"",
    ],
)
@pytest.mark.parametrize("method", [b"GET", b"POST"])
def test_duplicate_or_malformed_host_is_400(probe, hosts, method):
    port, _ = probe
    head = method + b" / HTTP/1.1\r\n" + (hosts + b"\r\n" if hosts else b"") + b"Content-Length: 0\r\n\r\n"
    got = raw(port, head)
    assert got.startswith(b"HTTP/1.0 400") and b"one well-formed Host header" in got


@pytest.mark.parametrize("host", [b"[::1]:8765", b"LOCALHOST", b"127.0.0.1:1"])
def test_well_formed_loopback_hosts_still_served(probe, host):
    port, _ = probe
    assert raw(port, b"GET / HTTP/1.0\r\nHost: " + host + b"\r\n\r\n").startswith(b"HTTP/1.0 200")


def test_probes_log_one_line_each_and_no_traceback(probe, capsys):
    """Resets mid-request, a client gone while a 4 MB report is written, bad request lines and paths: each failed
    request is one `mixlens viewer:` line on stderr, never a traceback, and the viewer keeps answering."""
    port, _ = probe

    def reset(data: bytes, read: int = 0) -> None:
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # close = RST
        s.sendall(data)
        if read:
            s.recv(read)
        s.close()

    reset(b"GET / HTTP/1.1\r\nHo")  # ConnectionReset while reading headers
    reset(b"GET /files/big.html HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n", read=100)  # BrokenPipe / reset on write
    for data in (
        b"GET http://[/ HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n",  # urlsplit raises ValueError
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n",  # TLS hello
        b"GET / HTTP/1.1\r\nX: " + b"a" * 70000 + b"\r\n\r\n",  # header line too long
        b"BREW / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
    ):
        assert raw(port, data).startswith(b"HTTP/1.")
    handlers_done()
    assert raw(port, b"GET / HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").startswith(b"HTTP/1.0 200")
    handlers_done()
    lines = capsys.readouterr().err.splitlines()
    assert not [ln for ln in lines if not ln.startswith("mixlens viewer: 127.0.0.1: ")], lines
    assert 5 <= len(lines) <= 6, lines  # one per failed request (the big file: none if it all fit in the buffers)
    assert not [ln for ln in lines if "big.html" in ln], lines  # a failed write is not "can no longer be read"


SERVE_WITHOUT_MODEL = """
import contextlib, signal, sys, time, types
signal.signal(signal.SIGINT, signal.default_int_handler)  # as a terminal gives it, even under a runner that ignores it
lens = types.ModuleType("mixlens.lens")  # no torch, no weights: a stand-in whose tokenizer takes 60 s
lens.load = lambda *a, **k: types.SimpleNamespace(name="stand-in", tokenizer=lambda text: time.sleep(60))
lens.runtime = lambda *a, **k: contextlib.nullcontext()  # --dtype / --device
sys.modules["mixlens.lens"] = lens
import mixlens.commands.report as report
report.check_methods = lambda given: ["attention"]
from mixlens.cli import main
main(["serve", "--port", "0"])
"""


@pytest.mark.parametrize("busy", [False, True])
def test_ctrl_c_stops_the_viewer_cleanly(busy):
    """SIGINT stops `mixlens serve` within seconds, with open slow connections and (busy) an analysis running."""
    proc = subprocess.Popen([sys.executable, "-c", SERVE_WITHOUT_MODEL], stderr=subprocess.PIPE, text=True)
    try:
        assert select.select([proc.stderr], [], [], 20)[0], "the viewer did not start within 20 s"
        line = proc.stderr.readline()  # "mixlens viewer on http://127.0.0.1:PORT/ (Ctrl-C stops it)"
        assert "mixlens viewer on http://127.0.0.1:" in line, line
        port = int(line.split("127.0.0.1:")[1].split("/")[0])
        slow = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(3)]
        for s in slow:
            s.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        if busy:  # an analysis in progress (the stand-in tokenizer runs under the analysis lock)
            post = socket.create_connection(("127.0.0.1", port), timeout=5)
            post.sendall(
                b"POST /api/analyze HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b'Content-Length: 14\r\n\r\n{"text": "hi"}'
            )
            slow.append(post)
        time.sleep(0.3)
        started = time.monotonic()
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=30)  # a loaded machine: the bound that matters is `elapsed` below
        elapsed = time.monotonic() - started
        err = line + proc.stderr.read()
        for s in slow:
            s.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        proc.stderr.close()
    assert rc == 0 and "Traceback" not in err and elapsed < 10.0, err
    assert err.rstrip().endswith("stopped (the analysis in progress was abandoned)" if busy else "stopped"), err


def test_one_client_cannot_take_every_connection(tmp_path, capsys):
    """#45 item 24: 32 slow connections from one client locked every other client out with 503; one client holds
    at most `max_per_client` connections (here 2 of 4), so another is still served."""
    cfg = ViewerConfig(
        SimpleNamespace(name="probe", methods=["attention"]), read_timeout=2.0, max_connections=4, max_per_client=2
    )
    srv = make_server(cfg, "127.0.0.1", 0)
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    port = srv.server_address[1]
    slow = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(2)]
    try:
        for s in slow:
            s.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        time.sleep(0.2)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as third:
            assert read_reply(third, 1.0).startswith(b"HTTP/1.0 503")
        other = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=("127.0.0.2", 0))
        with other:
            other.sendall(b"GET / HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
            assert read_reply(other, 1.5).startswith(b"HTTP/1.0 200")
    finally:
        for s in slow:
            s.close()
        srv.shutdown()
        srv.server_close()
        t.join(5)
    assert "more than 2 connections from 127.0.0.1" in capsys.readouterr().err
