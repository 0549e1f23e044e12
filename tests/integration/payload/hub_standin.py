"""A local HTTP stand-in for the Hugging Face Hub endpoints that ``hf_hub_download`` calls.

The real Hub cannot be reached from these machines. ``hf_hub_download`` (with
``local_dir``) sends ``HEAD`` then ``GET`` to
``{endpoint}/{repo_id}/resolve/{revision}/{filename}`` and needs the
``X-Repo-Commit``, ``ETag`` (or ``X-Linked-Etag``) and ``Content-Length``
headers; ranged GETs resume partial downloads. This server implements exactly
that for one repository at one commit, can require a bearer token, and records
every request so tests can assert what was (not) contacted.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote


@dataclass
class HubStandin:
    repo_id: str
    commit: str
    files: dict[str, bytes]
    token: str | None = None
    requests: list[tuple[str, str, str]] = field(default_factory=list)  # (method, path, authorization)
    server: ThreadingHTTPServer | None = None

    @property
    def endpoint(self) -> str:
        assert self.server is not None
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> HubStandin:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # keep test output clean
                pass

            def _fail(self, code: int, error_code: str, message: str) -> None:
                body = message.encode()
                self.send_response(code)
                self.send_header("X-Error-Code", error_code)
                self.send_header("X-Error-Message", message)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _serve(self) -> None:
                hub.requests.append((self.command, self.path, self.headers.get("Authorization", "")))
                path = unquote(self.path.split("?", 1)[0])
                prefix = f"/{hub.repo_id}/resolve/"
                if not path.startswith(prefix):
                    return self._fail(404, "RepoNotFound", "repository not found")
                revision, _, filename = path[len(prefix):].partition("/")
                if hub.token is not None and self.headers.get("Authorization") != f"Bearer {hub.token}":
                    return self._fail(401, "GatedRepo", "invalid credentials")
                if revision != hub.commit:
                    return self._fail(404, "RevisionNotFound", f"revision {revision} not found")
                data = hub.files.get(filename)
                if data is None:
                    return self._fail(404, "EntryNotFound", f"{filename} not found")
                start = 0
                rng = self.headers.get("Range")
                if rng and rng.startswith("bytes="):
                    start = int(rng[6:].split("-", 1)[0] or 0)
                body = data[start:]
                self.send_response(206 if start else 200)
                self.send_header("X-Repo-Commit", hub.commit)
                self.send_header("ETag", '"' + hashlib.sha256(data).hexdigest() + '"')
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Length", str(len(body)))
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.end_headers()
                if self.command == "GET":
                    self.wfile.write(body)

            def do_HEAD(self) -> None:
                self._serve()

            def do_GET(self) -> None:
                self._serve()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()

    def __enter__(self) -> HubStandin:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


if __name__ == "__main__":  # manual use: serve one file until interrupted
    import sys
    import time

    repo, commit, name, path = sys.argv[1:5]
    hub = HubStandin(repo, commit, {name: open(path, "rb").read()}).start()
    print(hub.endpoint, flush=True)
    while True:
        time.sleep(3600)
