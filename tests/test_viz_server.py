"""Local viewer over loopback: routes, limits, refusal of paths it was not given, Host check."""

from __future__ import annotations

import http.client
import json
import threading

import numpy as np
import pytest

from mixlens.viz.server import ViewerConfig, make_server, report_files


@pytest.fixture(scope="module")
def viewer(bundled, tmp_path_factory):
    d = tmp_path_factory.mktemp("served")
    (d / "given.html").write_text("<!doctype html><p>given report</p>")
    (d / "secret.html").write_text("<p>SECRET</p>")
    cfg = ViewerConfig(
        bundled,
        ["attention", "norm_resln"],
        heads=True,
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
