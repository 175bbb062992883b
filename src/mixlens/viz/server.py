"""Local viewer: a page where the user types a sentence and gets the report view (`mixlens serve`).

Standard library only (ThreadingHTTPServer), bound to 127.0.0.1 by default. It serves fixed routes and the
report files it was given by name — it never maps a request path onto the file system — checks the Host
header (DNS rebinding), accepts only same-origin JSON posts, and refuses oversize input with a clear message.
"""

from __future__ import annotations

import html
import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from mixlens.errors import MixlensError
from mixlens.viz.html import analyze_for_view, asset, build_payload, page

MAX_CHARS = 1000  # characters per typed input
MAX_TOKENS = 128  # tokens per typed input
READ_TIMEOUT = 10.0  # seconds a client may take to send a request body
LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass
class ViewerConfig:
    lens: Any  # mixlens.Lens
    methods: Sequence[str]
    heads: bool = True
    max_chars: int = MAX_CHARS
    max_tokens: int = MAX_TOKENS
    files: dict[str, Path] = field(default_factory=dict)  # URL name → the report file it was given
    read_timeout: float = READ_TIMEOUT  # seconds a client may take to send a request body


def viewer_page(cfg: ViewerConfig) -> str:
    limits = json.dumps({"max_chars": cfg.max_chars, "max_tokens": cfg.max_tokens})
    script = (
        f"(function(){{\n{asset('report.js')}\n{asset('viewer.js')}\n"
        f"mlxViewer(document.getElementById('mlx-viewer'), {limits});\n}})();"
    )
    files = "".join(f'<li><a href="/files/{html.escape(n)}">{html.escape(n)}</a></li>' for n in cfg.files)
    body = (
        f'<link rel="icon" href="data:,"><style>{asset("report.css")}\n'
        "body{font:14px system-ui,sans-serif;margin:16px} textarea{font:inherit;max-width:100%}"
        ".mlx-status[data-error='1']{color:#b00020;font-weight:600}</style>\n"
        f"<h1 style='font-size:20px'>mixlens viewer — {html.escape(getattr(cfg.lens, 'name', ''))}</h1>\n"
        f"<p>Methods: {html.escape(', '.join(cfg.methods))}. Runs locally; nothing leaves this machine.</p>\n"
        + (f"<p>Reports:</p><ul>{files}</ul>\n" if files else "")
        + '<div id="mlx-viewer"></div>\n'
    )
    return page(body, [script], "mixlens viewer", connect=True)


def make_server(cfg: ViewerConfig, host: str = "127.0.0.1", port: int = 8765) -> ThreadingHTTPServer:
    """A ready-to-run server (call `.serve_forever()`; port 0 picks a free one)."""
    index = viewer_page(cfg).encode()
    lock = threading.Lock()  # one model, one analysis at a time

    class Handler(BaseHTTPRequestHandler):
        server_version = "mixlens"
        sys_version = ""

        def log_message(self, format: str, *args: object) -> None:  # quiet: no request log on stderr
            pass

        def _send(self, status: int, body: bytes, ctype: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("Cache-Control", "no-store")
            if not ctype.startswith("text/html"):
                self.send_header("Content-Security-Policy", "default-src 'none'")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _error(self, status: int, message: str) -> None:
            self._send(status, json.dumps({"error": message}).encode(), "application/json")

        def _host_ok(self) -> bool:
            address = self.server.server_address  # (host, port, ...) for an IP server
            bound = str(address[0] if isinstance(address, tuple) else address)
            name = urlsplit("//" + (self.headers.get("Host") or "")).hostname or ""
            if bound in ("0.0.0.0", "::") or name in LOOPBACK or name == bound:
                return True
            self._error(HTTPStatus.FORBIDDEN, f"unexpected Host header '{self.headers.get('Host')}'")
            return False

        def do_GET(self) -> None:  # noqa: N802 (http.server API)
            if not self._host_ok():
                return
            path = urlsplit(self.path).path
            if path in ("/", "/index.html"):
                return self._send(HTTPStatus.OK, index, "text/html; charset=utf-8")
            if path.startswith("/files/"):
                name = unquote(path[len("/files/") :])
                if name in cfg.files:  # exact names only: no path is ever joined onto a directory
                    try:
                        return self._send(HTTPStatus.OK, cfg.files[name].read_bytes(), "text/html; charset=utf-8")
                    except OSError:
                        return self._error(HTTPStatus.NOT_FOUND, f"report '{name}' can no longer be read")
            self._error(HTTPStatus.NOT_FOUND, "not found")

        do_HEAD = do_GET

        def do_POST(self) -> None:  # noqa: N802
            if not self._host_ok():
                return
            if urlsplit(self.path).path != "/api/analyze":
                return self._error(HTTPStatus.NOT_FOUND, "not found")
            if (self.headers.get("Content-Type") or "").split(";")[0].strip() != "application/json":
                return self._error(HTTPStatus.UNSUPPORTED_MEDIA_TYPE, 'send JSON: {"text": "..."}')
            try:
                length = int(self.headers.get("Content-Length", ""))
            except ValueError:
                return self._error(HTTPStatus.LENGTH_REQUIRED, "Content-Length required")
            limit = 4 * cfg.max_chars + 256  # UTF-8 and JSON escaping of max_chars characters
            if length > limit:
                self.close_connection = True  # the body is left unread
                return self._error(
                    HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                    f"request of {length} bytes is too large; the input limit is {cfg.max_chars} characters",
                )
            # a client sending less than Content-Length must not hold a thread
            self.connection.settimeout(cfg.read_timeout)
            try:
                body = self.rfile.read(length)
            except TimeoutError:
                self.close_connection = True
                return self._error(
                    HTTPStatus.REQUEST_TIMEOUT, f"request body not received within {cfg.read_timeout:g} s"
                )
            try:
                text = json.loads(body)["text"]
                if not isinstance(text, str):
                    raise TypeError
            except (ValueError, KeyError, TypeError, RecursionError):
                return self._error(HTTPStatus.BAD_REQUEST, 'send JSON: {"text": "..."}')
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                return self._error(HTTPStatus.BAD_REQUEST, "the input contains invalid characters (lone surrogates)")
            if not text.strip():
                return self._error(HTTPStatus.BAD_REQUEST, "the input is empty")
            if len(text) > cfg.max_chars:
                return self._error(
                    HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                    f"input has {len(text)} characters; the limit is {cfg.max_chars}",
                )
            n_tok = len(cfg.lens.tokenizer(text)["input_ids"])
            if n_tok > cfg.max_tokens:
                return self._error(
                    HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                    f"input has {n_tok} tokens; the limit is {cfg.max_tokens} (restart with a larger --max-tokens)",
                )
            try:
                with lock:
                    res, head_maps = analyze_for_view(cfg.lens, [text], cfg.methods, heads=cfg.heads)
                    payload = build_payload(res, head_maps=head_maps, title="mixlens viewer")
            except MixlensError as e:
                return self._error(HTTPStatus.BAD_REQUEST, str(e))
            except Exception as e:  # never drop the connection: one line, the viewer shows it
                return self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"analysis failed: {type(e).__name__}: {e}")
            self._send(HTTPStatus.OK, json.dumps(payload, allow_nan=False).encode(), "application/json")

    return ThreadingHTTPServer((host, port), Handler)


def report_files(paths: Sequence[Path]) -> dict[str, Path]:
    """The files the viewer may serve, by base name; anything else is refused."""
    files: dict[str, Path] = {}
    for p in paths:
        p = Path(p)
        if not p.is_file():
            raise MixlensError(f"no such report file: {p}")
        if p.suffix.lower() not in (".html", ".htm"):
            raise MixlensError(f"only HTML reports can be served, not '{p.name}'")
        if p.name in files:
            raise MixlensError(f"two report files are named '{p.name}'")
        files[p.name] = p.resolve()
    return files
