"""Local HTTP stand-ins for the Hugging Face Hub: downloads (HubStandin) and publishing (WritableHubStandin).

HubStandin serves the endpoints that ``hf_hub_download`` calls.

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
import os
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
                revision, _sep, filename = path[len(prefix):].partition("/")
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


class WritableHubStandin:
    """A local stand-in for the Hub endpoints that publishing calls, plus downloads of what was published.

    It keeps one model repository as commits (each a full tree of ``path ->
    LFS object``) and branches, and an LFS object store keyed by SHA-256. The
    calls ``huggingface_hub`` makes, and what this answers:

    * ``GET /api/models/{repo}/refs`` (``list_repo_refs``): branches and their commits;
    * ``POST /api/models/{repo}/branch/{name}`` (``create_branch``): a branch at main's head;
    * ``POST /api/models/{repo}/preupload/{rev}`` (``create_commit``): every file is uploaded as LFS, with the
      object's current SHA-256 as ``oid`` when the revision already has that path;
    * ``POST /{repo}.git/info/lfs/objects/batch`` (LFS batch API, ``basic`` transfer): an upload and a verify
      action for objects not stored yet, none for stored ones;
    * ``PUT /lfs-objects/{oid}``: the bytes, refused unless they hash to ``oid`` (as an LFS server does);
    * ``POST /lfs-verify``: the object is stored with that size;
    * ``POST /api/models/{repo}/commit/{rev}`` (NDJSON): a new commit on the branch; every ``lfsFile`` must name
      a stored object of that size, and a ``parentCommit`` must be the branch head;
    * ``POST /api/models/{repo}/paths-info/{rev}`` (``get_paths_info``): size, blob id and LFS SHA-256 per path;
    * ``GET /api/models/{repo}/revision/{rev}`` (``repo_info``): the commit a revision resolves to;
    * ``GET /api/models/{repo}/tree/{rev}`` (``list_repo_tree``, as ``snapshot_download`` lists files): every file;
    * ``HEAD``/``GET /{repo}/resolve/{rev}/{path}`` (``hf_hub_download``): the file at a branch or commit.

    Uploads go through the legacy LFS protocol: run clients with ``HF_HUB_DISABLE_XET=1``
    (the Xet storage protocol is not implemented). With ``token`` set every
    request needs it; ``refuse_uploads`` answers the LFS batch with 403 (a
    token without write access). Every request is recorded as (method, path,
    whether it carried the right token) - never the token itself.
    """

    def __init__(self, repo_id: str, *, token: str | None = None, refuse_uploads: bool = False) -> None:
        self.repo_id = repo_id
        self.token = token
        self.refuse_uploads = refuse_uploads
        self.requests: list[tuple[str, str, bool]] = []
        self.uploaded: list[str] = []  # LFS oids received, in order
        self.commit_calls = 0
        self.objects: dict[str, bytes] = {}
        self._signatures: dict[str, str] = {}
        attributes = b"*.pack filter=lfs diff=lfs merge=lfs -text\n"
        first = self._commit_id(None, {".gitattributes": attributes.hex()}, "initial commit")
        self.commits: dict[str, dict] = {first: {"parent": None, "files": {".gitattributes": {"data": attributes}}}}
        self.branches: dict[str, str] = {"main": first}
        self._lock = threading.Lock()
        self.server: ThreadingHTTPServer | None = None

    # ----------------------------------------------------------------- state
    @property
    def endpoint(self) -> str:
        assert self.server is not None
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    @staticmethod
    def _commit_id(parent: str | None, summary: dict, message: str) -> str:
        import json as _json

        doc = _json.dumps({"parent": parent, "files": summary, "message": message, "nonce": os.urandom(8).hex()},
                          sort_keys=True)
        return hashlib.sha1(doc.encode()).hexdigest()

    def resolve(self, revision: str) -> str | None:
        """The commit a branch name or commit id names, or None."""
        if revision in self.branches:
            return self.branches[revision]
        return revision if revision in self.commits else None

    def file_at(self, revision: str, path: str) -> bytes | None:
        commit = self.resolve(revision)
        if commit is None:
            return None
        entry = self.commits[commit]["files"].get(path)
        if entry is None:
            return None
        return entry["data"] if "data" in entry else self.objects[entry["lfs"]]

    def path_info(self, path: str, entry: dict) -> dict:
        """A file as the Hub's paths-info and tree listings describe it (git blob id, LFS pointer)."""
        data = entry["data"] if "data" in entry else self.objects[entry["lfs"]]
        info = {"type": "file", "path": path, "size": len(data),
                "oid": hashlib.sha1(b"blob %d\x00" % len(data) + data).hexdigest()}
        if "lfs" in entry:
            info["lfs"] = {"oid": entry["lfs"], "size": len(data), "pointerSize": 134}
        return info

    # ----------------------------------------------------------------- server
    def start(self) -> WritableHubStandin:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = bytearray()
                    while True:
                        size = int(self.rfile.readline().split(b";", 1)[0].strip() or b"0", 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return bytes(out)
                        out += self.rfile.read(size)
                        self.rfile.readline()
                length = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(length) if length else b""

            def _send(self, code: int, body: bytes = b"", headers: dict | None = None,
                      ctype: str = "application/json") -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if body and self.command != "HEAD":
                    self.wfile.write(body)

            def _json(self, code: int, doc: object, headers: dict | None = None) -> None:
                import json as _json

                self._send(code, _json.dumps(doc).encode(), headers)

            def _fail(self, code: int, error_code: str, message: str) -> None:
                self._json(code, {"error": message}, {"X-Error-Code": error_code, "X-Error-Message": message})

            def _route(self) -> None:
                import json as _json
                from urllib.parse import parse_qs

                raw_path, _q, query = self.path.partition("?")
                path = unquote(raw_path)
                authed = hub.token is None or self.headers.get("Authorization") == f"Bearer {hub.token}"
                if self.command == "PUT" and path.startswith("/lfs-objects/"):
                    # Object storage URLs are pre-signed (as on the Hub): the signature, not the token, admits.
                    authed = parse_qs(query).get("sig", [""])[0] == hub._signatures.get(path[len("/lfs-objects/"):])
                hub.requests.append((self.command, path, authed))
                body = self._body() if self.command in ("POST", "PUT") else b""
                if not authed:
                    return self._fail(401, "RepoNotFound", "invalid credentials")
                api = f"/api/models/{hub.repo_id}/"
                with hub._lock:
                    if self.command == "GET" and path == api + "refs":
                        return self._json(200, {"branches": [
                            {"name": n, "ref": f"refs/heads/{n}", "targetCommit": c} for n, c in hub.branches.items()],
                            "tags": [], "converts": []})
                    if self.command == "POST" and path.startswith(api + "branch/"):
                        name = path[len(api + "branch/"):]
                        if name in hub.branches:
                            return self._fail(409, "BranchExists", f"branch {name} already exists")
                        hub.branches[name] = hub.branches["main"]
                        return self._json(200, {})
                    if self.command == "POST" and path.startswith(api + "preupload/"):
                        rev = path[len(api + "preupload/"):]
                        commit = hub.resolve(rev)
                        files = (commit and hub.commits[commit]["files"]) or {}
                        out = []
                        for f in _json.loads(body)["files"]:
                            have = files.get(f["path"], {})
                            out.append({"path": f["path"], "uploadMode": "lfs", "shouldIgnore": False,
                                        "oid": have.get("lfs")})
                        return self._json(200, {"files": out, "commitOid": commit})
                    if self.command == "POST" and path == f"/{hub.repo_id}.git/info/lfs/objects/batch":
                        if hub.refuse_uploads:
                            return self._fail(403, "Forbidden", "this token cannot write to the repository")
                        objs = []
                        for o in _json.loads(body)["objects"]:
                            entry = {"oid": o["oid"], "size": o["size"]}
                            if o["oid"] not in hub.objects:
                                sig = hub._signatures.setdefault(o["oid"], os.urandom(16).hex())
                                entry["actions"] = {
                                    "upload": {"href": f"{hub.endpoint}/lfs-objects/{o['oid']}?sig={sig}",
                                               "header": {}},
                                    "verify": {"href": f"{hub.endpoint}/lfs-verify", "header": {}}}
                            objs.append(entry)
                        return self._json(200, {"transfer": "basic", "objects": objs})
                    if self.command == "PUT" and path.startswith("/lfs-objects/"):
                        oid = path[len("/lfs-objects/"):]
                        if hashlib.sha256(body).hexdigest() != oid:
                            return self._fail(400, "BadContent", "content does not hash to the object id")
                        hub.objects[oid] = body
                        hub.uploaded.append(oid)
                        return self._send(200)
                    if self.command == "POST" and path == "/lfs-verify":
                        o = _json.loads(body)
                        if len(hub.objects.get(o["oid"], b"")) != o["size"] or o["oid"] not in hub.objects:
                            return self._fail(404, "EntryNotFound", "object not stored")
                        return self._json(200, {})
                    if self.command == "POST" and path.startswith(api + "commit/"):
                        return self._commit(path[len(api + "commit/"):], body)
                    if self.command == "POST" and path.startswith(api + "paths-info/"):
                        commit = hub.resolve(path[len(api + "paths-info/"):])
                        if commit is None:
                            return self._fail(404, "RevisionNotFound", "revision not found")
                        form = parse_qs(body.decode())
                        files = hub.commits[commit]["files"]
                        return self._json(200, [hub.path_info(p, files[p]) for p in form.get("paths", [])
                                                if p in files])
                    if self.command == "GET" and path.startswith(api + "tree/"):
                        commit = hub.resolve(path[len(api + "tree/"):].split("/", 1)[0])
                        if commit is None:
                            return self._fail(404, "RevisionNotFound", "revision not found")
                        return self._json(200, [hub.path_info(p, e)
                                                for p, e in sorted(hub.commits[commit]["files"].items())])
                    if self.command == "GET" and path.startswith(api + "revision/"):
                        commit = hub.resolve(path[len(api + "revision/"):])
                        if commit is None:
                            return self._fail(404, "RevisionNotFound", "revision not found")
                        return self._json(200, {"id": hub.repo_id, "modelId": hub.repo_id, "sha": commit,
                                                "private": False, "siblings": [
                                                    {"rfilename": p} for p in hub.commits[commit]["files"]]})
                    prefix = f"/{hub.repo_id}/resolve/"
                    if self.command in ("GET", "HEAD") and path.startswith(prefix):
                        rev, _sep, name = path[len(prefix):].partition("/")
                        commit = hub.resolve(rev)
                        if commit is None:
                            return self._fail(404, "RevisionNotFound", f"revision {rev} not found")
                        data = hub.file_at(commit, name)
                        if data is None:
                            return self._fail(404, "EntryNotFound", f"{name} not found")
                        start = 0
                        rng = self.headers.get("Range")
                        if rng and rng.startswith("bytes="):
                            start = int(rng[6:].split("-", 1)[0] or 0)
                        headers = {"X-Repo-Commit": commit, "ETag": '"' + hashlib.sha256(data).hexdigest() + '"',
                                   "Accept-Ranges": "bytes"}
                        if start:
                            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
                        return self._send(206 if start else 200, data[start:], headers,
                                          ctype="application/octet-stream")
                return self._fail(404, "EntryNotFound", f"{self.command} {path} is not served by this stand-in")

            def _commit(self, rev: str, body: bytes) -> None:
                import json as _json

                hub.commit_calls += 1
                if rev not in hub.branches:
                    return self._fail(404, "RevisionNotFound", f"branch {rev} not found")
                head = hub.branches[rev]
                lines = [_json.loads(ln) for ln in body.splitlines() if ln.strip()]
                header = lines[0]["value"] if lines and lines[0]["key"] == "header" else {}
                if header.get("parentCommit") and header["parentCommit"] != head:
                    return self._fail(412, "PreconditionFailed", "the branch moved since parentCommit")
                files = dict(hub.commits[head]["files"])
                for ln in lines[1:]:
                    v = ln["value"]
                    if ln["key"] == "lfsFile":
                        if v["oid"] not in hub.objects or len(hub.objects[v["oid"]]) != v.get("size", -1):
                            return self._fail(422, "LfsObjectMissing", f"LFS object {v['oid']} was not uploaded")
                        files[v["path"]] = {"lfs": v["oid"]}
                    elif ln["key"] == "file":
                        import base64

                        files[v["path"]] = {"data": base64.b64decode(v["content"])}
                    elif ln["key"] in ("deletedFile", "deletedFolder"):
                        files.pop(v["path"], None)
                summary = {p: e.get("lfs") or e["data"].hex() for p, e in files.items()}
                commit = hub._commit_id(head, summary, header.get("summary", ""))
                hub.commits[commit] = {"parent": head, "files": files}
                hub.branches[rev] = commit
                return self._json(200, {"commitUrl": f"{hub.endpoint}/{hub.repo_id}/commit/{commit}",
                                        "commitOid": commit, "pullRequestUrl": None})

            do_GET = do_HEAD = do_POST = do_PUT = _route

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()

    def __enter__(self) -> WritableHubStandin:
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
