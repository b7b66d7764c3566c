"""Loopback servers for the storage tests: a fault-injecting HTTP proxy and a static file server.

Everything binds 127.0.0.1 on a port the OS picks; nothing here talks to anything else.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import http.client
import json
import os
import re
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.parse
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from checkpointer.storage.retry import RetryPolicy

S3_BUCKET = "ckpt-test"
GCS_BUCKET = "ckpt-test-gcs"
SECRET_KEY = "test-secret-DO-NOT-LEAK-4f1c"
FAST = RetryPolicy(retries=8, base_delay=0.005, max_delay=0.02, max_elapsed=60.0)
"""Quick retries for tests (the count and backoff are the production code's; only the pauses shrink)."""

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "expect",
              "proxy-authorization", "proxy-connection", "content-length"}


def unique(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port: int, proc: subprocess.Popen, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{out[-4000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {timeout}s")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        # Clients that hang up (a reset, a closed pooled connection) are part of the tests.
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)


def _read_body(handler: BaseHTTPRequestHandler) -> bytes:
    if handler.headers.get("Transfer-Encoding", "").lower() == "chunked":
        out = bytearray()
        while True:
            size = int(handler.rfile.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while handler.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass
                return bytes(out)
            out += handler.rfile.read(size)
            handler.rfile.readline()
    return handler.rfile.read(int(handler.headers.get("Content-Length") or 0))


@dataclass
class Fault:
    """The next ``count`` requests matching ``method``/``path`` fail as ``mode``, after ``skip`` matches pass.

    Modes: ``503`` (answer 503 Slow Down), ``error`` (answer ``status`` with the S3 error ``code``), ``drop`` (close without answering; the request
    never reaches the server), ``reset`` (the same, with a TCP reset), ``lost`` (forward, then close without answering: the server
    acted but the client never hears), ``truncate`` (forward, send the headers and half the
    body, close), ``stall`` (wait ``stall_s`` seconds, then close), ``hold`` (wait until the
    test sets ``released``, at most 60 s, then forward).
    """

    count: int
    mode: str = "503"
    method: str | None = None
    path: str | None = None
    skip: int = 0
    stall_s: float = 2.0
    status: int = 503
    code: str = "SlowDown"
    fired: int = 0
    released: threading.Event = field(default_factory=threading.Event)

    def matches(self, method: str, path: str) -> bool:
        return (self.method is None or method == self.method) and (self.path is None or self.path in path)


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    fault: str | None = None


@dataclass
class FaultProxy:
    """A reverse proxy to ``upstream`` (``http://127.0.0.1:port``) that injects :class:`Fault` s.

    With ``conditional=True`` it also makes conditional creates atomic, as the real stores
    are: requests with ``If-None-Match`` (S3) or ``ifGenerationMatch`` (GCS) pass one at a
    time (moto checks and then stores in two steps, on many threads), and ``ifGenerationMatch=0``,
    which gcp-storage-emulator ignores, is answered 412 when the object exists. GCS downloads
    are answered as GCS answers them and the emulator does not: with the object's generation in
    ``x-goog-generation``, and 412 where ``ifGenerationMatch`` names another generation.

    With ``upload_times=True`` S3 multipart uploads are listed with the time they were created,
    as S3 lists them: moto lists every upload as initiated at 2010-11-10T20:48:33Z. The proxy
    notes when each upload created through it was created (also when the answer is then
    lost); uploads created past it keep moto's date.

    With ``chunked_gets=True`` answers to GETs are sent chunked, without Content-Length, as
    some gateways and S3-compatible stores send them.

    With ``ignore_range=True`` GETs reach the store without their ``Range`` header, as from a
    store or cache that ignores it: the answer is a 200 with the whole object. With
    ``wrong_part=True`` a GET of ``bytes=a-b`` reaches it as ``bytes=0-(b-a)``: the answer is a 206
    of another part of the object, whose ``Content-Range`` says so.
    """

    upstream: str
    faults: list[Fault] = field(default_factory=list)
    seen: list[Seen] = field(default_factory=list)
    conditional: bool = False
    upload_times: bool = False
    chunked_gets: bool = False
    ignore_range: bool = False
    wrong_part: bool = False

    def __post_init__(self) -> None:
        parsed = urllib.parse.urlsplit(self.upstream)
        self._up = (parsed.hostname, parsed.port)
        self._lock = threading.Lock()
        self._conditional_lock = threading.Lock()
        self._initiated: dict[bytes, bytes] = {}
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _handle(self) -> None:
                proxy._serve(self)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _handle

        self._server = _Server(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        self.url = f"http://127.0.0.1:{self._server.server_port}"

    def fail(self, count: int, mode: str = "503", **kw) -> Fault:
        fault = Fault(count, mode, **kw)
        with self._lock:
            self.faults.append(fault)
        return fault

    def clear(self) -> None:
        with self._lock:
            self.faults.clear()
            self.seen.clear()

    def _pick(self, method: str, path: str) -> Fault | None:
        with self._lock:
            for fault in self.faults:
                if fault.fired < fault.count and fault.matches(method, path):
                    if fault.skip:
                        fault.skip -= 1
                        return None
                    fault.fired += 1
                    return fault
        return None

    def _serve(self, h: BaseHTTPRequestHandler) -> None:
        body = _read_body(h)
        fault = self._pick(h.command, h.path)
        with self._lock:
            self.seen.append(Seen(h.command, h.path, dict(h.headers), fault.mode if fault else None))
        mode = fault.mode if fault else None
        if mode in ("503", "error"):
            payload = f"<Error><Code>{fault.code}</Code><Message>injected</Message></Error>".encode()
            h.send_response(fault.status)
            h.send_header("Content-Type", "application/xml")
            h.send_header("Content-Length", str(len(payload)))
            h.end_headers()
            h.wfile.write(payload)
            return
        if mode == "reset":  # abortive close: the client reads ECONNRESET
            h.close_connection = True
            h.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            h.connection.close()
            return
        if mode == "hold":
            fault.released.wait(60)
        if mode in ("drop", "stall"):
            if mode == "stall":
                time.sleep(fault.stall_s)
            h.close_connection = True
            h.connection.shutdown(socket.SHUT_RDWR)
            return
        download = self.conditional and h.command == "GET" and h.path.startswith("/download/")
        conditional = self.conditional and not download and ("If-None-Match" in h.headers or "ifGenerationMatch=" in h.path)
        with self._conditional_lock if conditional else contextlib.nullcontext():
            generation = self._gcs_generation(h.path) if download else None
            wanted = urllib.parse.parse_qs(urllib.parse.urlsplit(h.path).query).get("ifGenerationMatch", [None])[0]
            if (conditional and wanted == "0" and self._gcs_generation(h.path) is not None) or (
                download and generation is not None and wanted not in (None, generation)
            ):
                status, reason = 412, "Precondition Failed"
                headers = [("Content-Type", "application/json")]
                data = b'{"error": {"code": 412, "message": "At least one of the pre-conditions did not hold."}}'
            else:
                sent = [(k, v) for k, v in h.headers.items()
                        if not (self.ignore_range and h.command == "GET" and k.lower() == "range")]
                if self.wrong_part and h.command == "GET":
                    sent = [(k, _from_zero(v) if k.lower() == "range" else v) for k, v in sent]
                status, reason, headers, data = self._forward(h.command, h.path, sent, body)
                if generation is not None and status in (200, 206):
                    headers = [*headers, ("x-goog-generation", generation)]
        if self.upload_times and status == 200:
            data = self._upload_times(h.command, h.path, data)
        if mode == "lost":
            h.close_connection = True
            h.connection.shutdown(socket.SHUT_RDWR)
            return
        h.send_response(status, reason)
        length = None
        for key, value in headers:
            if key.lower() == "content-length":
                length = value
            elif key.lower() not in HOP_BY_HOP and key.lower() not in ("server", "date"):
                h.send_header(key, value)
        if self.chunked_gets and h.command == "GET" and mode is None:
            h.send_header("Transfer-Encoding", "chunked")
            h.end_headers()
            h.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data) if data else b"0\r\n\r\n")
            return
        h.send_header("Content-Length", length if h.command == "HEAD" and length else str(len(data)))
        h.end_headers()
        if mode == "truncate":
            h.wfile.write(data[: len(data) // 2])
            h.wfile.flush()
            h.close_connection = True
            h.connection.shutdown(socket.SHUT_RDWR)
            return
        if h.command != "HEAD":
            h.wfile.write(data)

    def _forward(self, method: str, path: str, headers, body: bytes) -> tuple[int, str, list, bytes]:
        conn = http.client.HTTPConnection(*self._up, timeout=120)
        try:
            conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
            for key, value in headers:
                if key.lower() not in HOP_BY_HOP:
                    conn.putheader(key, value)
            if body or method in ("PUT", "POST", "PATCH"):
                conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body or None)
            resp = conn.getresponse()
            return resp.status, resp.reason, resp.getheaders(), resp.read()
        finally:
            conn.close()

    def _upload_times(self, method: str, path: str, data: bytes) -> bytes:
        """Note when CreateMultipartUpload (``POST ...?uploads``) created an upload; put that time
        in ListMultipartUploads (``GET /bucket?uploads``) answers."""
        if "uploads" not in urllib.parse.parse_qs(urllib.parse.urlsplit(path).query, keep_blank_values=True):
            return data
        if method == "POST":
            upload_id = re.search(rb"<UploadId>([^<]+)</UploadId>", data)
            if upload_id:
                now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
                with self._lock:
                    self._initiated[upload_id.group(1)] = now.encode()
            return data

        def stamp(upload: re.Match) -> bytes:
            upload_id = re.search(rb"<UploadId>([^<]+)</UploadId>", upload.group(0))
            with self._lock:
                when = self._initiated.get(upload_id.group(1)) if upload_id else None
            if when is None:
                return upload.group(0)
            return re.sub(rb"<Initiated>[^<]*</Initiated>", b"<Initiated>" + when + b"</Initiated>", upload.group(0))

        return re.sub(rb"<Upload>.*?</Upload>", stamp, data, flags=re.S)

    def _gcs_generation(self, path: str) -> str | None:
        """The generation of the object a JSON-API upload (``/upload/storage/v1/b/B/o?name=N``) or
        download (``/download/storage/v1/b/B/o/N?alt=media``) names; None if it does not exist."""
        parts = urllib.parse.urlsplit(path)
        bucket, _, tail = parts.path.rstrip("/").split("/b/", 1)[1].partition("/")
        key = tail[2:] if tail.startswith("o/") else ""
        if not key:
            key = urllib.parse.quote(urllib.parse.parse_qs(parts.query)["name"][0], safe="")
        status, _, _, data = self._forward("GET", f"/storage/v1/b/{bucket}/o/{key}", [("Host", "%s:%s" % self._up)], b"")
        return str(json.loads(data)["generation"]) if status == 200 else None

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class _TLSServer(_Server):
    """``_Server`` over TLS, which can drop the next handshakes (read the ClientHello, close)."""

    context = None  # an ssl.SSLContext with the server's certificate
    connections = 0
    drop_handshakes = 0

    def get_request(self):
        sock, addr = self.socket.accept()
        self.connections += 1
        if self.drop_handshakes > 0:
            self.drop_handshakes -= 1
            sock.recv(4096)
            sock.close()
            raise ConnectionAbortedError("handshake dropped by the test server")  # serve_forever goes on
        return self.context.wrap_socket(sock, server_side=True), addr


def self_signed_cert(directory: str) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and its key (PEM files in ``directory``), trusted by no one."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
    with open(cert_file, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(key_file, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    return cert_file, key_file


def _from_zero(spec: str) -> str:
    """``bytes=a-b`` as ``bytes=0-(b-a)``: as long a range, from the object's start."""
    first, _, last = spec.removeprefix("bytes=").partition("-")
    return f"bytes=0-{int(last) - int(first)}" if last else "bytes=0-"


class RangeFileServer:
    """Serves the files under ``root`` over HTTP/1.1 with ``Range`` support (or, if
    ``ranges=False``, ignoring ``Range`` like ``python -m http.server``), optionally behind
    basic auth and a ``?token=`` query parameter, or redirects everything to ``redirect_to``.
    With ``chunked=True`` bodies are sent with ``Transfer-Encoding: chunked`` (no
    ``Content-Length``), in chunks of 1000 bytes, as dynamic servers and some proxies do.
    With ``tls`` (an ``ssl.SSLContext``) it serves https; ``self._server.drop_handshakes`` and
    ``.connections`` (see ``_TLSServer``) drop handshakes and count connections. Setting
    ``cut_bodies`` cuts that many of the next bodies halfway: the connection closes (a chunked
    body's last chunk never comes). ``missing_status=403`` answers 403 for a missing file, as a
    public S3 bucket without list permission does. ``content_length`` is sent as every answer's
    ``Content-Length`` instead of the body's length (a server that lies, or writes nonsense).
    ``wrong_part=True`` answers every range with as many bytes from the file's start, and a
    ``Content-Range`` that says so (a cache or proxy that serves another part)."""

    def __init__(self, root: str, *, ranges: bool = True, auth: tuple[str, str] | None = None,
                 token: str | None = None, redirect_to: str | None = None, chunked: bool = False,
                 tls=None, missing_status: int = 404, content_length: str | None = None, wrong_part: bool = False):
        server = self
        self.wrong_part = wrong_part
        self.missing_status = missing_status
        self.content_length = content_length
        self.root, self.ranges, self.token, self.redirect_to = root, ranges, token, redirect_to
        self.chunked = chunked
        self.cut_bodies = 0
        self.authorization_seen: list[str | None] = []
        self.auth = "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode() if auth else None
        self.ranges_seen: list[str | None] = []

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                server._serve(self, head=True)

            def do_GET(self) -> None:
                server._serve(self, head=False)

        self._server = (_TLSServer if tls else _Server)(("127.0.0.1", 0), Handler)
        self._server.context = tls
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self._server.server_port}"

    def _reply(self, h: BaseHTTPRequestHandler, status: int, headers: dict[str, str], body: bytes, head: bool) -> None:
        h.send_response(status)
        for key, value in headers.items():
            h.send_header(key, value)
        cut = self.cut_bodies > 0 and not head
        if cut:
            self.cut_bodies -= 1
        if self.chunked and not head:
            h.send_header("Transfer-Encoding", "chunked")
            h.end_headers()
            for i in range(0, len(body) // 2 if cut else len(body), 1000):
                h.wfile.write(b"%x\r\n%s\r\n" % (len(body[i : i + 1000]), body[i : i + 1000]))
            if not cut:
                h.wfile.write(b"0\r\n\r\n")
        else:
            length = headers.get("X-Length", str(len(body))) if self.content_length is None else self.content_length
            h.send_header("Content-Length", length)
            h.end_headers()
            if not head:
                h.wfile.write(body[: len(body) // 2] if cut else body)
        if cut:
            h.wfile.flush()
            h.close_connection = True
            h.connection.shutdown(socket.SHUT_RDWR)

    def _serve(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        parts = urllib.parse.urlsplit(h.path)
        query = urllib.parse.parse_qs(parts.query)
        self.authorization_seen.append(h.headers.get("Authorization"))
        if self.redirect_to:
            return self._reply(h, 302, {"Location": self.redirect_to + parts.path}, b"", head)
        if (self.auth and h.headers.get("Authorization") != self.auth) or (
                self.token and query.get("token") != [self.token]):
            return self._reply(h, 401, {}, b"unauthorized", head)
        path = os.path.join(self.root, urllib.parse.unquote(parts.path).lstrip("/"))
        if not os.path.isfile(path):
            return self._reply(h, self.missing_status, {}, b"not found", head)
        with open(path, "rb") as f:
            data = f.read()
        rng = h.headers.get("Range")
        self.ranges_seen.append(rng)
        if not rng or not self.ranges or head:
            return self._reply(h, 200, {"X-Length": str(len(data))} if head else {}, data, head)
        first, _, last = rng.removeprefix("bytes=").partition("-")
        start, end = int(first), min(len(data), int(last) + 1 if last else len(data))
        if start >= len(data):
            return self._reply(h, 416, {"Content-Range": f"bytes */{len(data)}"}, b"", head)
        if self.wrong_part:
            start, end = 0, end - start
        return self._reply(h, 206, {"Content-Range": f"bytes {start}-{end - 1}/{len(data)}"}, data[start:end], head)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
