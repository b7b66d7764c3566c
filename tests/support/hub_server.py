"""A Hugging Face hub on 127.0.0.1: the file-resolve route ``huggingface_hub`` calls, and nothing else.

``GET`` and ``HEAD`` of ``/{org}/{name}/resolve/{revision}/{path}`` serve ``repos[org/name]/path``
(a local folder) at any revision, with the headers the hub sends: ``ETag`` (the file's sha256,
as for LFS files), ``X-Repo-Commit`` (one fixed commit per repository), ``Content-Length``. A
missing file is a 404 with ``X-Error-Code: EntryNotFound``, a missing repository one with
``RepoNotFound``. Every request is recorded as ``(method, path)``, and its ``Authorization``
header in :attr:`tokens`.
"""

from __future__ import annotations

import hashlib
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote


class HubServer:
    """``HubServer({"org/name": folder})``; :attr:`url` is the endpoint (``HF_ENDPOINT``).

    Files named in :attr:`expired` are redirected, as the hub redirects large files, to a signed
    CDN URL (``/cdn/...?X-Amz-Signature=SECRET-SIGNATURE``) that answers 403 (the signature expired)."""

    SIGNATURE = "SECRET-SIGNATURE"

    def __init__(self, repos: dict[str, str]):
        self.repos = repos
        self.expired: set[str] = set()
        self.requests: list[tuple[str, str]] = []
        self.tokens: list[str | None] = []
        self._lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                hub._serve(self, body=False)

            def do_GET(self):
                hub._serve(self, body=True)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def gets(self) -> list[str]:
        """The paths downloaded (``GET``), in order."""
        with self._lock:
            return [path for method, path in self.requests if method == "GET"]

    def clear(self) -> None:
        with self._lock:
            self.requests.clear()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _serve(self, handler: BaseHTTPRequestHandler, *, body: bool) -> None:
        path = unquote(handler.path.split("?", 1)[0])
        with self._lock:
            self.requests.append(("GET" if body else "HEAD", path))
            self.tokens.append(handler.headers.get("Authorization"))
        parts = path.strip("/").split("/")
        if parts[0] == "cdn":
            return self._error(handler, 403, "SignatureExpired")
        if len(parts) >= 5 and "/".join(parts[4:]) in self.expired:
            handler.send_response(302)
            handler.send_header("Location", f"{self.url}/cdn/{parts[-1]}?X-Amz-Credential=AKIAEXAMPLE&X-Amz-Signature={self.SIGNATURE}")
            handler.send_header("X-Repo-Commit", hashlib.sha1("/".join(parts[:2]).encode()).hexdigest())
            handler.send_header("X-Linked-Etag", '"' + "b" * 64 + '"')
            handler.send_header("X-Linked-Size", "100")
            handler.send_header("Content-Length", "0")
            return handler.end_headers()
        if len(parts) < 5 or parts[2] != "resolve":
            return self._error(handler, 404, "RepoNotFound")
        repo, filename = "/".join(parts[:2]), "/".join(parts[4:])
        folder = self.repos.get(repo)
        if folder is None:
            return self._error(handler, 404, "RepoNotFound")
        file = os.path.join(folder, filename)
        if ".." in parts or not os.path.isfile(file):
            return self._error(handler, 404, "EntryNotFound")
        with open(file, "rb") as f:
            data = f.read()
        handler.send_response(200)
        handler.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        handler.send_header("X-Repo-Commit", hashlib.sha1(repo.encode()).hexdigest())
        handler.send_header("Content-Length", str(len(data)))
        handler.send_header("Content-Type", "application/octet-stream")
        handler.end_headers()
        if body:
            handler.wfile.write(data)

    @staticmethod
    def _error(handler: BaseHTTPRequestHandler, status: int, code: str) -> None:
        handler.send_response(status)
        handler.send_header("X-Error-Code", code)
        handler.send_header("Content-Length", "0")
        handler.end_headers()
