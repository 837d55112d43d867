"""A local HTTP server speaking the Hugging Face Hub's file protocol, for tests that set ``HF_ENDPOINT`` to it.

What ``huggingface_hub`` asks of the Hub, answered from repos held in memory:

* ``GET /api/models/{org}/{name}/revision/{revision}``: the commit (``sha``) and the file list (``siblings``);
* ``HEAD`` / ``GET /{org}/{name}/resolve/{revision}/{path}``: ``X-Repo-Commit``, ``ETag`` (the sha256 of the
  content, quoted, as the Hub gives for LFS files), ``Content-Length``, and the bytes;
* a gated repo answers 401 with ``X-Error-Code: GatedRepo`` unless ``Authorization: Bearer <token>``;
  unknown repos ``RepoNotFound`` and unknown revisions ``RevisionNotFound``, as the Hub does.

Every request is recorded (method, path, authorization header) so tests can count them.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Repo:
    refs: dict[str, str] = field(default_factory=dict)
    """Branch or tag -> commit."""
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    """Commit -> {path: content}."""
    token: str | None = None
    """A gated repo's accepted token."""

    def add_commit(self, commit: str, files: dict[str, bytes], *refs: str) -> None:
        self.commits[commit] = files
        for ref in refs:
            self.refs[ref] = commit


@dataclass
class Request:
    method: str
    path: str
    authorization: str | None


class HubServer:
    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[Request] = []
        self.slow_files: set[str] = set()
        """Files whose download takes a second, so that concurrent clients overlap."""
        self.lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                hub._handle(self, body=True)

            def do_HEAD(self) -> None:
                hub._handle(self, body=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def gets(self, repo: str) -> list[str]:
        """The files of ``repo`` downloaded (GET of a resolve URL), in order."""
        prefix = f"/{repo}/resolve/"
        with self.lock:
            return [
                r.path[len(prefix) :].split("/", 1)[1]
                for r in self.requests
                if r.method == "GET" and r.path.startswith(prefix)
            ]

    def _handle(self, handler: BaseHTTPRequestHandler, body: bool) -> None:
        path = urllib.parse.unquote(urllib.parse.urlsplit(handler.path).path)
        with self.lock:
            self.requests.append(Request(handler.command, path, handler.headers.get("Authorization")))
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "revision":
            repo_id, revision = "/".join(parts[2:4]), "/".join(parts[5:])
            self._repo_info(handler, repo_id, revision)
        elif len(parts) >= 5 and parts[2] == "resolve":
            repo_id, revision, filename = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
            self._resolve(handler, repo_id, revision, filename, body)
        else:
            self._send(handler, 404, b"{}", {"X-Error-Code": "EntryNotFound"}, body)

    def _commit(
        self, handler: BaseHTTPRequestHandler, repo_id: str, revision: str, body: bool
    ) -> tuple[Repo, str] | None:
        repo = self.repos.get(repo_id)
        if repo is None:
            self._send(handler, 404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"}, body)
            return None
        if repo.token is not None and handler.headers.get("Authorization") != f"Bearer {repo.token}":
            self._send(handler, 401, b'{"error": "gated"}', {"X-Error-Code": "GatedRepo"}, body)
            return None
        commit = repo.refs.get(revision, revision)
        if commit not in repo.commits:
            self._send(handler, 404, b'{"error": "Revision not found"}', {"X-Error-Code": "RevisionNotFound"}, body)
            return None
        return repo, commit

    def _repo_info(self, handler: BaseHTTPRequestHandler, repo_id: str, revision: str) -> None:
        found = self._commit(handler, repo_id, revision, True)
        if found is None:
            return
        repo, commit = found
        info = {
            "id": repo_id,
            "modelId": repo_id,
            "sha": commit,
            "private": False,
            "gated": repo.token is not None,
            "siblings": [{"rfilename": name} for name in sorted(repo.commits[commit])],
        }
        self._send(handler, 200, json.dumps(info).encode(), {"Content-Type": "application/json"}, True)

    def _resolve(self, handler: BaseHTTPRequestHandler, repo_id: str, revision: str, filename: str, body: bool) -> None:
        found = self._commit(handler, repo_id, revision, body)
        if found is None:
            return
        repo, commit = found
        content = repo.commits[commit].get(filename)
        if content is None:
            self._send(handler, 404, b'{"error": "Entry not found"}', {"X-Error-Code": "EntryNotFound"}, body)
            return
        etag = hashlib.sha256(content).hexdigest()
        if body and filename in self.slow_files:
            time.sleep(1.0)
        self._send(
            handler, 200, content, {"X-Repo-Commit": commit, "ETag": f'"{etag}"', "Accept-Ranges": "bytes"}, body
        )

    @staticmethod
    def _send(
        handler: BaseHTTPRequestHandler, status: int, content: bytes, headers: dict[str, str], body: bool
    ) -> None:
        handler.send_response(status)
        for key, value in headers.items():
            handler.send_header(key, value)
        handler.send_header("Content-Length", str(len(content)))
        handler.end_headers()
        if body:
            handler.wfile.write(content)
