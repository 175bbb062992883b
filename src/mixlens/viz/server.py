"""Local viewer: a page where the user types a sentence and gets the report view (`mixlens serve`).

Standard library only (ThreadingHTTPServer), bound to 127.0.0.1 by default. It serves fixed routes and the
report files it was given by name — it never maps a request path onto the file system — checks the Host
header (DNS rebinding), accepts only same-origin JSON posts, and refuses oversize input with a clear message.
Reading a request (headers and body) has one deadline in all, at most `max_connections` are served at once and
`max_per_client` from one client address (the rest get 503 at once), and a failed request is one line on stderr,
never a traceback.
"""

from __future__ import annotations

import html
import io
import json
import re
import socket
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import unquote, urlsplit

from mixlens.errors import MixlensError
from mixlens.result import Analysis, Attribution
from mixlens.viz.html import asset, build_payload, page

MAX_CHARS = 1000  # characters per typed input
MAX_TOKENS = 128  # tokens per typed input
READ_TIMEOUT = 10.0  # seconds a client may take to send a whole request (headers and body)
MAX_CONNECTIONS = 32  # connections served at once; more are answered 503 and closed
MAX_PER_CLIENT = 8  # of them from one client address (slow connections of one client never lock out the others)
LOOPBACK = ("127.0.0.1", "localhost", "::1")
HOST = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)(:[0-9]{1,5})?")  # a Host header: name or [IPv6], port
CONTROL = {c: f"\\x{c:02x}" for c in (*range(32), 127)}
BUSY_BODY = b'{"error": "too many connections; retry later"}'
BUSY = b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
    len(BUSY_BODY),
    BUSY_BODY,
)


def log(line: str) -> None:
    """One line on stderr per failed request (control characters escaped, length bounded)."""
    sys.stderr.write(f"mixlens viewer: {line.translate(CONTROL)[:300]}\n")
    sys.stderr.flush()


class Analyzer(Protocol):
    """What the viewer runs on a typed text; the command that starts it builds one from a loaded model
    (`commands.report.ModelAnalyzer`), so the viewer itself runs no model."""

    @property
    def name(self) -> str: ...  # the model's, for the page title

    @property
    def methods(self) -> Sequence[str]: ...

    def count_tokens(self, text: str) -> int: ...

    def analyze(self, text: str) -> tuple[Analysis, dict[str, Attribution]]:
        """The text's analysis and its per-head maps (method → `Attribution`) for the report view."""
        ...


@dataclass
class ViewerConfig:
    analyzer: Analyzer
    max_chars: int = MAX_CHARS
    max_tokens: int = MAX_TOKENS
    files: dict[str, Path] = field(default_factory=dict)  # URL name → the report file it was given
    read_timeout: float = READ_TIMEOUT  # seconds a client may take to send a whole request (headers and body)
    max_connections: int = MAX_CONNECTIONS  # connections served at once
    max_per_client: int = MAX_PER_CLIENT  # of them from one client address


class DeadlineReader(io.RawIOBase):
    """A socket's input with one deadline for all reads (a per-recv timeout lets a client drip bytes forever)."""

    def __init__(self, sock: socket.socket, seconds: float) -> None:
        self.sock, self.end, self.seconds = sock, time.monotonic() + seconds, seconds

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self.end - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError
            self.sock.settimeout(left)
            return self.sock.recv_into(buffer)
        except TimeoutError:
            raise TimeoutError(f"request not received within {self.seconds:g} s") from None


class ViewerServer(ThreadingHTTPServer):
    """Threads for at most `max_connections` connections; `stop` waits for a running analysis."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: Any, max_connections: int, max_per_client: int) -> None:
        self.slots = threading.BoundedSemaphore(max_connections)
        self.max_connections, self.max_per_client = max_connections, max_per_client
        self.clients: dict[str, int] = {}  # client address → connections it holds
        self.counting = threading.Lock()
        self.analysis = threading.Lock()  # one model, one analysis at a time
        super().__init__(address, handler)

    def _refuse(self, request: Any, client_address: Any, why: str) -> None:
        try:
            request.settimeout(0)  # never block the accepting thread
            request.send(BUSY)
        except OSError:
            pass
        log(f"{client_address[0]}: refused: {why}")
        self.shutdown_request(request)

    def _leave(self, client: str) -> None:
        with self.counting:
            self.clients[client] -= 1
            if not self.clients[client]:
                del self.clients[client]
        self.slots.release()

    def process_request(self, request: Any, client_address: Any) -> None:
        client = client_address[0]
        if not self.slots.acquire(blocking=False):
            self._refuse(request, client_address, f"more than {self.max_connections} connections at once")
            return
        with self.counting:
            mine = self.clients.get(client, 0)
            if mine < self.max_per_client:
                self.clients[client] = mine + 1
        if mine >= self.max_per_client:
            self.slots.release()
            self._refuse(request, client_address, f"more than {self.max_per_client} connections from {client}")
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._leave(client)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._leave(client_address[0])

    def handle_error(self, request: Any, client_address: Any) -> None:  # one line, not a traceback
        e = sys.exc_info()[1]
        log(f"{client_address[0]}: request failed: {type(e).__name__}: {e}")

    def stop(self, wait: float) -> bool:
        """Close the socket and take the analysis lock (no analysis starts after this); False if one is still
        running after `wait` seconds."""
        self.server_close()
        return self.analysis.acquire(timeout=wait)


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
        f"<h1 style='font-size:20px'>mixlens viewer — {html.escape(cfg.analyzer.name)}</h1>\n"
        f"<p>Methods: {html.escape(', '.join(cfg.analyzer.methods))}. Runs locally; nothing leaves this machine.</p>\n"
        + (f"<p>Reports:</p><ul>{files}</ul>\n" if files else "")
        + '<div id="mlx-viewer"></div>\n'
    )
    return page(body, [script], "mixlens viewer", connect=True)


def make_server(cfg: ViewerConfig, host: str = "127.0.0.1", port: int = 8765) -> ViewerServer:
    """A ready-to-run server (call `.serve_forever()`; port 0 picks a free one)."""
    index = viewer_page(cfg).encode()

    class Handler(BaseHTTPRequestHandler):
        server_version = "mixlens"
        sys_version = ""
        default_request_version = "HTTP/1.0"  # errors on a garbled request line get a status line too
        server: ViewerServer

        def setup(self) -> None:  # HTTP/1.0: one request per connection, so one deadline per request
            super().setup()
            self.rfile.close()
            self.rfile = io.BufferedReader(DeadlineReader(self.connection, cfg.read_timeout))

        def log_message(self, format: str, *args: object) -> None:  # quiet: no request log on stderr
            pass

        def log_error(self, format: str, *args: object) -> None:  # one line per failed request
            log(f"{self.client_address[0]}: {format % args}")

        def send_response(self, code: int, message: str | None = None) -> None:
            self.connection.settimeout(cfg.read_timeout)  # writes: a fresh timeout, not what the read left
            super().send_response(code, message)

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
            self.log_error("%s %s: %d %s", self.command, self.path[:100], status, message)
            self._send(status, json.dumps({"error": message}).encode(), "application/json")

        def parse_request(self) -> bool:  # every method: one well-formed Host naming this server
            if not super().parse_request():
                return False
            hosts = self.headers.get_all("Host") or []
            match = HOST.fullmatch(hosts[0]) if len(hosts) == 1 else None
            if match is None:
                self.close_connection = True
                self._error(HTTPStatus.BAD_REQUEST, "send exactly one well-formed Host header")
                return False
            address = self.server.server_address  # (host, port, ...) for an IP server
            bound = str(address[0] if isinstance(address, tuple) else address)
            name = match[1].strip("[]").lower()
            if bound in ("0.0.0.0", "::") or name in LOOPBACK or name == bound:
                return True
            self._error(HTTPStatus.FORBIDDEN, f"unexpected Host header '{hosts[0]}'")
            return False

        def _route(self) -> str:
            try:
                return urlsplit(self.path).path
            except ValueError:  # e.g. "//[": no route
                return ""

        def do_GET(self) -> None:  # noqa: N802 (http.server API)
            path = self._route()
            if path in ("/", "/index.html"):
                return self._send(HTTPStatus.OK, index, "text/html; charset=utf-8")
            if path.startswith("/files/"):
                name = unquote(path[len("/files/") :])
                if name in cfg.files:  # exact names only: no path is ever joined onto a directory
                    try:
                        data = cfg.files[name].read_bytes()
                    except OSError:
                        return self._error(HTTPStatus.NOT_FOUND, f"report '{name}' can no longer be read")
                    return self._send(HTTPStatus.OK, data, "text/html; charset=utf-8")
            return self._error(HTTPStatus.NOT_FOUND, "not found")

        do_HEAD = do_GET

        def do_POST(self) -> None:  # noqa: N802
            if self._route() != "/api/analyze":
                return self._error(HTTPStatus.NOT_FOUND, "not found")
            if (self.headers.get("Content-Type") or "").split(";")[0].strip() != "application/json":
                return self._error(HTTPStatus.UNSUPPORTED_MEDIA_TYPE, 'send JSON: {"text": "..."}')
            # any refusal below leaves the body unread (the connection closes after the answer)
            lengths = self.headers.get_all("Content-Length") or []
            if not lengths or "Transfer-Encoding" in self.headers:
                return self._error(HTTPStatus.LENGTH_REQUIRED, "Content-Length required")
            raw = lengths[0].strip(" \t")
            if len(lengths) > 1 or not (raw.isascii() and raw.isdigit()):
                return self._error(HTTPStatus.BAD_REQUEST, f"invalid Content-Length '{', '.join(lengths)[:40]}'")
            limit = 4 * cfg.max_chars + 256  # UTF-8 and JSON escaping of max_chars characters
            if len(raw) > 15 or int(raw) > limit:
                size = str(int(raw)) if len(raw) <= 15 else f"over {10**15}"
                return self._error(
                    HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                    f"request of {size} bytes is too large; the input limit is {cfg.max_chars} characters",
                )
            try:  # within what is left of the request's deadline
                body = self.rfile.read(int(raw))
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
            with self.server.analysis:  # no model code runs once `stop` holds the lock
                n_tok = cfg.analyzer.count_tokens(text)
            if n_tok > cfg.max_tokens:
                return self._error(
                    HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                    f"input has {n_tok} tokens; the limit is {cfg.max_tokens} (restart with a larger --max-tokens)",
                )
            try:
                with self.server.analysis:
                    res, head_maps = cfg.analyzer.analyze(text)
                    payload = build_payload(res, head_maps=head_maps, title="mixlens viewer")
            except MixlensError as e:
                return self._error(HTTPStatus.BAD_REQUEST, str(e))
            except Exception as e:  # never drop the connection: one line, the viewer shows it
                return self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"analysis failed: {type(e).__name__}: {e}")
            return self._send(HTTPStatus.OK, json.dumps(payload, allow_nan=False).encode(), "application/json")

    return ViewerServer((host, port), Handler, cfg.max_connections, cfg.max_per_client)


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
