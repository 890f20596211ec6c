"""A Hugging Face Hub endpoint for tests: a real HTTP server on 127.0.0.1, port 0.

It speaks the part of the Hub protocol huggingface_hub 2.4 uses to resolve and download files:

- ``HEAD``/``GET /{org}/{name}/resolve/{rev}/{path}``: ``X-Repo-Commit``, ``ETag``,
  ``Content-Length``, ``Accept-Ranges``; ``Range: bytes=a-b`` gets a 206.
- ``GET /api/models/{org}/{name}[/revision/{rev}]``: ``{"id", "sha", "private", "siblings"}``.
- ``GET /api/models/{org}/{name}/tree/{rev}[/{path}]?recursive=...``: files and folders.
- Errors as the Hub sends them: 404 with ``X-Error-Code: RepoNotFound | RevisionNotFound |
  EntryNotFound``; a private repo answers 401 ``RepoNotFound`` without a token and 401 "Invalid
  credentials in Authorization header" with a wrong one.

Tests publish repos into it: each :meth:`HubServer.publish` makes a commit (a full snapshot of the
given files) and moves a branch to it. Every request is recorded in :attr:`HubServer.requests`.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote

_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


@dataclass(frozen=True)
class HubRequest:
    """One request the server answered."""

    method: str
    path: str  # as sent, still percent-encoded, without the query
    authorization: str | None
    range: str | None
    status: int


@dataclass
class _Repo:
    token: str | None  # a private repo needs "Authorization: Bearer <token>"
    refs: dict[str, str] = field(default_factory=dict)  # branch/tag/refs/pr/N -> commit sha
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # sha -> path -> bytes


class _HubError(Exception):
    def __init__(self, status: int, code: str | None, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


class HubServer:
    """The test Hub. Use as a context manager, or call :meth:`start` and :meth:`stop`."""

    def __init__(self) -> None:
        self._repos: dict[str, _Repo] = {}
        self._lock = threading.Lock()
        self._commits = 0
        self.requests: list[HubRequest] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> HubServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- publishing -------------------------------------------------------------------------
    def publish(
        self,
        repo_id: str,
        files: Mapping[str, bytes] | Path,
        *,
        branch: str = "main",
        token: str | None = None,
        subfolder: str = "",
    ) -> str:
        """Commit ``files`` (a directory's files, or path -> bytes) to ``branch``; returns the sha.

        The commit holds exactly these files (under ``subfolder`` if given). ``token`` makes the
        repo private (set on the first publish).
        """
        if isinstance(files, Path):
            files = {p.name: p.read_bytes() for p in sorted(files.iterdir()) if p.is_file()}
        prefix = f"{subfolder}/" if subfolder else ""
        snapshot = {prefix + name: data for name, data in files.items()}
        with self._lock:
            repo = self._repos.setdefault(repo_id, _Repo(token=token))
            self._commits += 1
            digest = hashlib.sha1(f"{repo_id}\0{branch}\0{self._commits}".encode())
            for name in sorted(snapshot):
                digest.update(name.encode() + b"\0" + hashlib.sha256(snapshot[name]).digest())
            sha = digest.hexdigest()
            repo.commits[sha] = snapshot
            repo.refs[branch] = sha
        return sha

    def add_ref(self, repo_id: str, ref: str, sha: str) -> None:
        """Point a tag or ``refs/pr/N`` at an existing commit."""
        with self._lock:
            self._repos[repo_id].refs[ref] = sha

    def requests_for(self, fragment: str) -> list[HubRequest]:
        """Recorded requests whose path contains ``fragment``."""
        with self._lock:
            return [r for r in self.requests if fragment in r.path]

    # -- serving ----------------------------------------------------------------------------
    def _record(self, request: HubRequest) -> None:
        with self._lock:
            self.requests.append(request)

    def _lookup(
        self, repo_id: str, revision: str, authorization: str | None
    ) -> tuple[str, dict[str, bytes], _Repo]:
        with self._lock:
            repo = self._repos.get(repo_id)
            if repo is None:
                raise _HubError(404, "RepoNotFound", "Repository not found")
            if repo.token is not None:
                if authorization is None:
                    raise _HubError(401, "RepoNotFound", "Invalid username or password.")
                if authorization != f"Bearer {repo.token}":
                    raise _HubError(401, None, "Invalid credentials in Authorization header")
            sha = repo.refs.get(revision, revision)
            if sha not in repo.commits:
                raise _HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}")
            return sha, repo.commits[sha], repo

    def _info(self, repo_id: str, revision: str, authorization: str | None) -> Any:
        sha, files, repo = self._lookup(repo_id, revision, authorization)
        return {
            "_id": hashlib.sha1(repo_id.encode()).hexdigest()[:24],
            "id": repo_id,
            "modelId": repo_id,
            "sha": sha,
            "private": repo.token is not None,
            "siblings": [{"rfilename": name} for name in sorted(files)],
        }

    def _tree(
        self, repo_id: str, revision: str, folder: str, recursive: bool, authorization: str | None
    ) -> Any:
        _, files, _ = self._lookup(repo_id, revision, authorization)
        prefix = f"{folder}/" if folder else ""
        under = {name: data for name, data in files.items() if name.startswith(prefix)}
        if folder and not under:
            raise _HubError(404, "EntryNotFound", f"{folder} does not exist on {revision}")
        entries: list[dict[str, Any]] = []
        folders: set[str] = set()
        for name in sorted(under):
            rest = name[len(prefix) :]
            if "/" in rest and not recursive:
                folders.add(prefix + rest.split("/", 1)[0])
                continue
            if recursive:
                parts = rest.split("/")[:-1]
                folders.update(prefix + "/".join(parts[: i + 1]) for i in range(len(parts)))
            data = under[name]
            blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
            entries.append({"type": "file", "oid": blob, "size": len(data), "path": name})
        entries.extend(
            {"type": "directory", "oid": hashlib.sha1(f.encode()).hexdigest(), "size": 0, "path": f}
            for f in sorted(folders)
        )
        return entries

    def _file(
        self, repo_id: str, revision: str, path: str, authorization: str | None
    ) -> tuple[str, bytes]:
        sha, files, _ = self._lookup(repo_id, revision, authorization)
        if path not in files:
            raise _HubError(404, "EntryNotFound", f"{path} does not exist on {revision}")
        return sha, files[path]


def _handler_for(hub: HubServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_HEAD(self) -> None:
            self._serve()

        def do_GET(self) -> None:
            self._serve()

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _serve(self) -> None:
            raw_path, _, query = self.path.partition("?")
            auth = self.headers.get("Authorization")
            try:
                self._route(raw_path, parse_qs(query), auth)
            except _HubError as err:
                headers = {"X-Error-Message": err.message}
                if err.code:
                    headers["X-Error-Code"] = err.code
                self._send(err.status, json.dumps({"error": err.message}).encode(), headers)

        def _route(self, raw_path: str, query: dict[str, list[str]], auth: str | None) -> int:
            parts = raw_path.strip("/").split("/")
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                repo_id = f"{unquote(parts[2])}/{unquote(parts[3])}"
                rest = parts[4:]
                if not rest:
                    return self._json(hub._info(repo_id, "main", auth))
                if rest[0] == "revision" and len(rest) >= 2:
                    return self._json(hub._info(repo_id, unquote("/".join(rest[1:])), auth))
                if rest[0] == "tree" and len(rest) >= 2:
                    recursive = query.get("recursive", ["false"])[0].lower() in ("true", "1")
                    folder = unquote("/".join(rest[2:]))
                    tree = hub._tree(repo_id, unquote(rest[1]), folder, recursive, auth)
                    return self._json(tree)
            if len(parts) >= 5 and parts[2] == "resolve":
                repo_id = f"{unquote(parts[0])}/{unquote(parts[1])}"
                path = unquote("/".join(parts[4:]))
                sha, data = hub._file(repo_id, unquote(parts[3]), path, auth)
                return self._content(sha, data)
            raise _HubError(404, None, f"no route for {raw_path}")

        def _json(self, payload: Any) -> int:
            self._send(200, json.dumps(payload).encode(), {"Content-Type": "application/json"})
            return 200

        def _content(self, sha: str, data: bytes) -> int:
            headers = {
                "X-Repo-Commit": sha,
                "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                "Accept-Ranges": "bytes",
                "Content-Type": "application/octet-stream",
            }
            wanted = self.headers.get("Range")
            if wanted is None:
                self._send(200, data, headers)
                return 200
            match = _RANGE.match(wanted.strip())
            start, end = (match.group(1), match.group(2)) if match else ("", "")
            if match is None or (not start and not end):
                raise _HubError(416, None, f"bad range {wanted!r}")
            if start:
                first, last = int(start), min(int(end) if end else len(data) - 1, len(data) - 1)
            else:  # a suffix: the last N bytes
                first, last = max(len(data) - int(end), 0), len(data) - 1
            if first >= len(data) or first > last:
                headers = {"Content-Range": f"bytes */{len(data)}"}
                self._send(416, b"", headers)
                return 416
            headers["Content-Range"] = f"bytes {first}-{last}/{len(data)}"
            self._send(206, data[first : last + 1], headers)
            return 206

        def _send(self, status: int, body: bytes, headers: Mapping[str, str]) -> None:
            # Recorded before the response leaves, so a client that got it sees it recorded.
            raw_path = self.path.partition("?")[0]
            hub._record(
                HubRequest(
                    self.command,
                    raw_path,
                    self.headers.get("Authorization"),
                    self.headers.get("Range"),
                    status,
                )
            )
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

    return Handler
