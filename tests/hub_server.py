"""A loopback stand-in for the Hugging Face hub: the endpoints `snapshot_download` calls.

`HubServer(repos)` serves, on 127.0.0.1 only, each repo `(repo_type, repo_id) -> {path: bytes}`:

    GET  /api/{models|datasets}/{id}/revision/{rev}       repo info: {"id", "sha", "siblings"}
    GET  /api/{models|datasets}/{id}/tree/{rev}?recursive  the file list (one page)
    HEAD /{id}/resolve/{rev}/{path}, /datasets/{id}/...    X-Repo-Commit, ETag, Content-Length
    GET  the same                                          the bytes

`fail` turns a repo into an error: "gated" (403 GatedRepo), "login" (401), or `truncate`
names a file whose body is cut in half (Content-Length still the full size). Unknown repos
answer 404 RepoNotFound, as the hub does. Every request line is recorded in `requests`.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
from urllib.parse import unquote, urlparse

COMMIT = "c0ffee" + "0" * 34


class HubServer:
    def __init__(self, repos: dict, fail: dict | None = None, truncate: str | None = None):
        self.repos = repos
        self.fail = fail or {}
        self.truncate = truncate
        self.requests: list[str] = []
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                hub._serve(self, body=False)

            def do_GET(self):
                hub._serve(self, body=True)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> HubServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # ------------------------------------------------------------------------- routing

    def _route(self, path: str):
        """(repo_type, repo_id, kind, rest) of a request path, or None."""
        parts = [unquote(p) for p in path.strip("/").split("/")]
        if parts[:1] == ["api"] and len(parts) >= 6 and parts[1] in ("models", "datasets"):
            repo_type = parts[1][:-1]
            return repo_type, "/".join(parts[2:4]), parts[4], "/".join(parts[5:])
        repo_type = "model"
        if parts[:1] == ["datasets"]:
            repo_type, parts = "dataset", parts[1:]
        if len(parts) >= 5 and parts[2] == "resolve":
            return repo_type, "/".join(parts[:2]), "resolve", "/".join(parts[4:])
        return None

    def _serve(self, req, body: bool) -> None:
        self.requests.append(f"{req.command} {req.path}")
        route = self._route(urlparse(req.path).path)
        if route is None:
            return self._send(req, 404, b"", {"X-Error-Code": "EntryNotFound"}, body)
        repo_type, repo_id, kind, rest = route
        files = self.repos.get((repo_type, repo_id))
        failure = self.fail.get(repo_id)
        if files is None:
            return self._send(req, 404, b"", {"X-Error-Code": "RepoNotFound"}, body)
        if failure == "gated":
            return self._send(req, 403, b"", {"X-Error-Code": "GatedRepo"}, body)
        if failure == "login":
            return self._send(req, 401, b"", {"X-Error-Code": "RepoNotFound"}, body)
        if kind == "revision":
            info = {
                "id": repo_id,
                "sha": COMMIT,
                "private": False,
                "siblings": [{"rfilename": p} for p in sorted(files)],
            }
            return self._send_json(req, info, body)
        if kind == "tree":
            tree = [
                {"type": "file", "oid": _oid(data), "size": len(data), "path": p}
                for p, data in sorted(files.items())
            ]
            return self._send_json(req, tree, body)
        if kind == "resolve" and rest in files:
            data = files[rest]
            headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{_oid(data)}"'}
            sent = data[: len(data) // 2] if rest == self.truncate else data
            return self._send(req, 200, sent, headers, body, length=len(data))
        return self._send(req, 404, b"", {"X-Error-Code": "EntryNotFound"}, body)

    def _send_json(self, req, obj, body: bool) -> None:
        self._send(req, 200, json.dumps(obj).encode(), {"Content-Type": "application/json"}, body)

    @staticmethod
    def _send(req, status, data: bytes, headers: dict, body: bool, length=None) -> None:
        req.send_response(status)
        for k, v in headers.items():
            req.send_header(k, v)
        req.send_header("Content-Length", str(len(data) if length is None else length))
        req.send_header("Connection", "close")
        req.end_headers()
        if body:
            req.wfile.write(data)
        req.close_connection = True


def _oid(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()
