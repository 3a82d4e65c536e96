"""A Hugging Face Hub test double on 127.0.0.1, for the real huggingface_hub client (HF_ENDPOINT).

No package on the index serves the Hub's upload API off the shelf: `hf-local-hub` needs a separate
Go binary it does not ship, and `olah` is a read-only mirror of an upstream Hub. So this answers,
by hand, the subset of the API that huggingface_hub 2.x calls with HF_HUB_DISABLE_XET=1 (the LFS
transfer path; the Xet path needs Hugging Face's content-addressed storage service):

  POST /api/repos/create                              create a repo (409 with its url when it exists)
  GET  /api/models/{repo}[/revision/{rev}]            model info: commit sha, siblings (?blobs: size, LFS)
  GET  /api/models/{repo}/tree/{rev}                  the file list snapshot_download caches
  POST /api/models/{repo}/branch/{branch}             create a branch
  POST /api/models/{repo}/preupload/{rev}             upload mode (lfs/regular) and the remote oid per file
  POST /{repo}.git/info/lfs/objects/batch             LFS batch: an upload action only for unknown objects
  PUT  /lfs/{oid}                                     the LFS object itself (checked against its sha256)
  POST /api/models/{repo}/commit/{rev}                NDJSON commit (file, lfsFile, deletedFile; ?create_pr)
  POST /api/validate-yaml                             a README's YAML metadata parses
  HEAD|GET /{repo}/resolve/{rev}/{path}               file bytes with X-Repo-Commit, ETag / X-Linked-Etag
                                                      (the LFS sha256), X-Linked-Size; Range requests

Errors carry the X-Error-Code header the client maps to its exceptions (RepoNotFound, GatedRepo,
RevisionNotFound, EntryNotFound). Everything the server received is kept for the tests to inspect.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pt")


def git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def is_lfs(path: str, size: int) -> bool:
    return path.endswith(LFS_SUFFIXES) or size >= 10 * 1024 * 1024


@dataclass
class Repo:
    private: bool = False
    gated: bool = False
    branches: dict[str, str] = field(default_factory=dict)  # branch or refs/pr/N -> commit
    commits: dict[str, dict[str, str]] = field(default_factory=dict)  # commit -> {path: sha256 of content}
    prs: int = 0


class HubError(Exception):
    def __init__(self, status: int, code: str | None, message: str):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.blobs: dict[str, bytes] = {}  # sha256 -> content
        self.tokens: set[str] = {"hf_test_token"}
        self.requests: list[tuple[str, str]] = []
        self.lfs_puts: list[str] = []  # oids received by PUT
        self.commit_bodies: list[list[dict[str, Any]]] = []
        self.events: list[tuple[float, str, str]] = []  # (time, "get-start"/"get-done", path)
        self.holds: dict[str, threading.Event] = {}
        self.fail_next_commits = 0
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-hub", daemon=True)

    def start(self) -> "FakeHub":
        self._thread.start()
        return self

    def stop(self) -> None:
        for ev in self.holds.values():
            ev.set()
        self._server.shutdown()
        self._server.server_close()

    # -- test helpers -----------------------------------------------------------------------
    def hold(self, path: str) -> threading.Event:
        """GETs of `path` (any repo) wait until the returned event is set (60 s at most)."""
        ev = threading.Event()
        self.holds[path] = ev
        return ev

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        repo = self.repos[repo_id]
        commit = repo.branches.get(revision, revision)
        return {p: self.blobs[h] for p, h in repo.commits[commit].items()}

    # -- model ------------------------------------------------------------------------------
    def repo(self, repo_id: str, token: str | None) -> Repo:
        repo = self.repos.get(repo_id)
        if repo is None or (repo.private and token not in self.tokens):
            raise HubError(401 if token is None else 404, "RepoNotFound", f"Repository {repo_id} not found")
        if repo.gated and token not in self.tokens:
            raise HubError(401, "GatedRepo", f"Access to model {repo_id} is restricted. You must have access to it "
                                             "and be authenticated to access it. Please log in.")
        return repo

    def resolve(self, repo: Repo, rev: str) -> str:
        if rev in repo.branches:
            return repo.branches[rev]
        if rev in repo.commits:
            return rev
        raise HubError(404, "RevisionNotFound", f"Invalid rev id: {rev}")

    def entry(self, path: str, sha: str) -> dict[str, Any]:
        data = self.blobs[sha]
        e: dict[str, Any] = {"size": len(data), "oid": git_oid(data)}
        if is_lfs(path, len(data)):
            e["lfs"] = {"oid": sha, "sha256": sha, "size": len(data), "pointerSize": 134}
        return e

    def commit(self, repo_id: str, repo: Repo, rev: str, lines: list[dict[str, Any]], create_pr: bool) -> dict[str, Any]:
        base = self.resolve(repo, rev) if repo.commits else None
        tree = dict(repo.commits[base]) if base else {}
        for item in lines:
            v = item["value"]
            if item["key"] == "file":
                data = base64.b64decode(v["content"])
                sha = hashlib.sha256(data).hexdigest()
                self.blobs[sha] = data
                tree[v["path"]] = sha
            elif item["key"] == "lfsFile":
                if v["oid"] not in self.blobs:
                    raise HubError(422, None, f"LFS object {v['oid']} for {v['path']} was never uploaded")
                tree[v["path"]] = v["oid"]
            elif item["key"] in ("deletedFile", "deletedFolder"):
                tree = {p: h for p, h in tree.items() if p != v["path"] and not p.startswith(v["path"].rstrip("/") + "/")}
        sha = hashlib.sha1(json.dumps([base, sorted(tree.items()), time.time_ns()]).encode()).hexdigest()
        repo.commits[sha] = tree
        out = {"commitUrl": f"{self.url}/{repo_id}/commit/{sha}", "commitOid": sha}
        if create_pr:
            repo.prs += 1
            repo.branches[f"refs/pr/{repo.prs}"] = sha
            out["pullRequestUrl"] = f"{self.url}/{repo_id}/discussions/{repo.prs}"
        else:
            repo.branches[rev] = sha
        return out


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:  # quiet
            pass

        # -- plumbing ----------------------------------------------------------------------
        def _token(self) -> str | None:
            auth = self.headers.get("Authorization", "")
            return auth[7:] if auth.startswith("Bearer ") else None

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                out = bytearray()
                while True:
                    n = int(self.rfile.readline().split(b";")[0].strip(), 16)
                    if n == 0:
                        self.rfile.readline()
                        return bytes(out)
                    out += self.rfile.read(n)
                    self.rfile.readline()
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None,
                  ctype: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            if "Content-Length" not in (headers or {}):
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _json(self, obj: Any, status: int = 200) -> None:
            self._send(status, json.dumps(obj).encode())

        def _dispatch(self) -> None:
            parts = urlsplit(self.path)
            query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
            with hub._lock:
                hub.requests.append((self.command, parts.path))
            try:
                self._route(parts.path, query)
            except HubError as e:
                hdr = {"X-Error-Code": e.code} if e.code else {}
                hdr["X-Error-Message"] = e.message
                self._send(e.status, json.dumps({"error": e.message}).encode(), hdr)

        do_GET = do_HEAD = do_POST = do_PUT = lambda self: self._dispatch()  # noqa: E731

        # -- routes ------------------------------------------------------------------------
        def _route(self, path: str, q: dict[str, str]) -> None:
            tok = self._token()
            segs = [unquote(s) for s in path.strip("/").split("/")]
            if path == "/api/repos/create" and self.command == "POST":
                body = json.loads(self._body())
                if tok not in hub.tokens:
                    raise HubError(401, None, "Invalid credentials")
                repo_id = f"{body.get('organization') or 'user'}/{body['name']}"
                url = f"{hub.url}/{repo_id}"
                with hub._lock:
                    if repo_id in hub.repos:
                        return self._json({"url": url, "error": "You already created this model repo"}, 409)
                    repo = hub.repos[repo_id] = Repo(private=body.get("visibility") == "private"
                                                     or bool(body.get("private")))
                    # As the Hub does: an initial commit holding .gitattributes (LFS for *.safetensors).
                    hub.commit(repo_id, repo, "main", [{"key": "file", "value": {"path": ".gitattributes", "content":
                               base64.b64encode(b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n").decode()}}],
                               create_pr=False)
                return self._json({"url": url, "name": repo_id})
            if path == "/api/validate-yaml" and self.command == "POST":  # create_commit checks a README's metadata
                import yaml

                text = json.loads(self._body())["content"]
                try:
                    meta = yaml.safe_load(text.split("---")[1]) if text.startswith("---") else {}
                    assert isinstance(meta, dict), "metadata is not a mapping"
                except Exception as e:  # noqa: BLE001  reported to the client as the Hub does
                    return self._json({"errors": [{"message": str(e)}]}, 400)
                return self._json({"warnings": []})
            if segs[:2] == ["api", "models"] and len(segs) >= 4:
                repo_id = f"{segs[2]}/{segs[3]}"
                rest = segs[4:]
                with hub._lock:
                    repo = hub.repo(repo_id, tok)
                    if not rest or rest[0] == "revision":
                        return self._model_info(repo_id, repo, rest[1] if rest else "main", "blobs" in q)
                    if rest[0] == "tree":
                        commit = hub.resolve(repo, rest[1])
                        return self._json([{"type": "file", "path": p, **hub.entry(p, h)}
                                           for p, h in sorted(repo.commits[commit].items())])
                    if tok not in hub.tokens:
                        raise HubError(401, None, "Invalid credentials")
                    if rest[0] == "branch":
                        branch = "/".join(rest[1:])
                        if branch in repo.branches:
                            raise HubError(409, None, f"Branch {branch} already exists")
                        start = json.loads(self._body() or b"{}").get("startingPoint") or "main"
                        repo.branches[branch] = hub.resolve(repo, start)
                        return self._json({})
                    rev = "/".join(rest[1:])
                    if rest[0] == "preupload":
                        return self._preupload(repo, rev, json.loads(self._body()))
                    if rest[0] == "commit":
                        lines = [json.loads(x) for x in self._body().splitlines() if x.strip()]
                        hub.commit_bodies.append(lines)
                        if hub.fail_next_commits:
                            hub.fail_next_commits -= 1
                            raise HubError(400, None, "commit refused (injected failure)")
                        create_pr = q.get("create_pr") == "1"
                        if repo.commits and rev not in repo.branches and rev not in repo.commits:
                            raise HubError(404, "RevisionNotFound", f"Invalid rev id: {rev}")
                        return self._json(hub.commit(repo_id, repo, rev, lines, create_pr))
            if len(segs) >= 5 and segs[1].endswith(".git") and segs[2:] == ["info", "lfs", "objects", "batch"]:
                with hub._lock:
                    hub.repo(f"{segs[0]}/{segs[1][:-4]}", tok)
                    body = json.loads(self._body())
                    objs = []
                    for o in body["objects"]:
                        e: dict[str, Any] = {"oid": o["oid"], "size": o["size"], "authenticated": True}
                        if o["oid"] not in hub.blobs:
                            e["actions"] = {"upload": {"href": f"{hub.url}/lfs/{o['oid']}", "header": {}}}
                        objs.append(e)
                return self._json({"transfer": "basic", "objects": objs})
            if segs[0] == "lfs" and self.command == "PUT":
                data = self._body()
                if hashlib.sha256(data).hexdigest() != segs[1]:
                    raise HubError(400, None, "sha256 mismatch")
                with hub._lock:
                    hub.blobs[segs[1]] = data
                    hub.lfs_puts.append(segs[1])
                return self._send(200)
            if len(segs) >= 5 and segs[2] == "resolve":
                return self._resolve(f"{segs[0]}/{segs[1]}", segs[3], "/".join(segs[4:]), tok)
            raise HubError(404, None, f"no route for {self.command} {path}")

        def _model_info(self, repo_id: str, repo: Repo, rev: str, blobs: bool) -> None:
            if not repo.commits:
                return self._json({"id": repo_id, "modelId": repo_id, "sha": None, "private": repo.private,
                                   "siblings": []})
            commit = hub.resolve(repo, rev)
            sib = []
            for p, h in sorted(repo.commits[commit].items()):
                e = hub.entry(p, h)
                s: dict[str, Any] = {"rfilename": p}
                if blobs:
                    s.update({"size": e["size"], "blobId": e["oid"]})
                    if "lfs" in e:
                        s["lfs"] = {"sha256": h, "size": e["size"], "pointerSize": 134}
                sib.append(s)
            self._json({"id": repo_id, "modelId": repo_id, "sha": commit, "private": repo.private,
                        "gated": "auto" if repo.gated else False, "siblings": sib})

        def _preupload(self, repo: Repo, rev: str, body: dict[str, Any]) -> None:
            tree = repo.commits[hub.resolve(repo, rev)] if repo.commits and rev in repo.branches else {}
            out = []
            for f in body["files"]:
                lfs = is_lfs(f["path"], f["size"])
                oid = None
                if f["path"] in tree:
                    h = tree[f["path"]]
                    oid = h if lfs else git_oid(hub.blobs[h])
                out.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False,
                            "oid": oid})
            self._json({"files": out})

        def _resolve(self, repo_id: str, rev: str, path: str, tok: str | None) -> None:
            with hub._lock:
                repo = hub.repo(repo_id, tok)
                commit = hub.resolve(repo, rev)
                sha = repo.commits[commit].get(path)
                if sha is None:
                    raise HubError(404, "EntryNotFound", f"{path} does not exist on {rev}")
                data = hub.blobs[sha]
                e = hub.entry(path, sha)
            headers = {"X-Repo-Commit": commit, "Accept-Ranges": "bytes"}
            if "lfs" in e:
                headers.update({"ETag": f'"{sha}"', "X-Linked-Etag": f'"{sha}"', "X-Linked-Size": str(len(data))})
            else:
                headers["ETag"] = f'"{e["oid"]}"'
            if self.command == "HEAD":
                headers["Content-Length"] = str(len(data))
                return self._send(200, b"", headers, "application/octet-stream")
            m = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
            ranged = m is not None and m.group(2) != ""  # a header read, not a download
            hub.events.append((time.monotonic(), "range" if ranged else "get-start", path))
            ev = hub.holds.get(path)
            if ev is not None and not ranged:
                ev.wait(8)  # below the client's 10 s read timeout: a test that waits in vain fails on its assertion
            status, body = 200, data
            if m:
                a = int(m.group(1))
                b = min(int(m.group(2)) if m.group(2) else len(data) - 1, len(data) - 1)
                status, body = 206, data[a:b + 1]
                headers["Content-Range"] = f"bytes {a}-{b}/{len(data)}"
            headers["Content-Length"] = str(len(body))
            self._send(status, body, headers, "application/octet-stream")
            if not ranged:
                hub.events.append((time.monotonic(), "get-done", path))

    return Handler
