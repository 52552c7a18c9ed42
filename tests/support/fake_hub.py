"""A small stand-in for the Hugging Face Hub on 127.0.0.1, for the real `huggingface_hub` client.

It implements the endpoints the client calls to create a repo and a branch, upload a folder
(preupload + the NDJSON commit; every file is "regular", so the client sends it base64 in the
commit whether or not hf_xet is installed), read repo info and download files (``resolve``), and
keeps what arrives in memory. Every request must carry ``Authorization: Bearer <token>``.

    >>> with FakeHub(token="hf_test") as hub:
    ...     os.environ["HF_ENDPOINT"] = hub.url
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit


class FakeHub:
    def __init__(self, token: str, commit_delay: float = 0.0) -> None:
        self.token = token
        self.commit_delay = commit_delay
        self.repos: dict[str, dict[str, Any]] = {}
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.bodies: list[bytes] = []
        self.lock = threading.Lock()
        hub = self

        class Handler(_Handler):
            pass

        Handler.hub = hub
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()

    def files(self, repo_id: str, branch: str = "main") -> dict[str, bytes]:
        return dict(self.repos[repo_id]["branches"][branch]["files"])

    def commits(self, repo_id: str) -> list[dict[str, Any]]:
        return list(self.repos[repo_id]["commits"])


class _Handler(BaseHTTPRequestHandler):
    hub: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:  # keep test output clean
        pass

    # --- plumbing ----------------------------------------------------------------------------------

    def _send(
        self,
        status: int,
        body: Any = None,
        headers: dict[str, str] | None = None,
        raw: bytes | None = None,
        head: bool = False,
    ) -> None:
        data = raw if raw is not None else json.dumps(body if body is not None else {}).encode()
        self.send_response(status)
        self.send_header(
            "Content-Type", "application/json" if raw is None else "application/octet-stream"
        )
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if not head:
            self.wfile.write(data)

    def _body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        data = self.rfile.read(length) if length else b""
        self.hub.bodies.append(data)
        return data

    def _authorized(self) -> bool:
        self.hub.requests.append((self.command, self.path, dict(self.headers)))
        if self.headers.get("Authorization") == f"Bearer {self.hub.token}":
            return True
        self._send(
            401,
            {"error": "Invalid credentials in Authorization header"},
            headers={"X-Error-Message": "Invalid credentials in Authorization header"},
        )
        return False

    def _repo(self, repo_id: str) -> dict[str, Any] | None:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            self._send(
                404, {"error": "Repository not found"}, headers={"X-Error-Code": "RepoNotFound"}
            )
        return repo

    # --- routes ---------------------------------------------------------------------------------------

    def do_GET(self) -> None:
        self._route("GET")

    def do_HEAD(self) -> None:
        self._route("HEAD")

    def do_POST(self) -> None:
        self._route("POST")

    def _route(self, method: str) -> None:
        path = urlsplit(self.path).path
        body = self._body() if method == "POST" else b""
        if not self._authorized():
            return
        routes = [
            ("POST", r"/api/repos/create", self.create_repo),
            ("GET", r"/api/whoami-v2", self.whoami),
            ("GET", r"/api/agent-harnesses", self.agent_harnesses),
            ("POST", r"/api/validate-yaml", self.validate_yaml),
            (
                "POST",
                r"/api/models/(?P<repo>[^/]+/[^/]+)/branch/(?P<branch>[^/]+)",
                self.create_branch,
            ),
            ("POST", r"/api/models/(?P<repo>[^/]+/[^/]+)/preupload/(?P<rev>[^/]+)", self.preupload),
            ("POST", r"/api/models/(?P<repo>[^/]+/[^/]+)/commit/(?P<rev>[^/]+)", self.commit),
            (
                "GET",
                r"/api/models/(?P<repo>[^/]+/[^/]+)(/revision/(?P<rev>[^/]+))?",
                self.repo_info,
            ),
            ("GET", r"/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)", self.resolve),
            ("HEAD", r"/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)", self.resolve),
        ]
        for verb, pattern, handler in routes:
            match = re.fullmatch(pattern, path)
            if verb == method and match:
                with self.hub.lock:
                    return handler(
                        body,
                        **{k: unquote(v) for k, v in match.groupdict().items() if v is not None},
                    )
        self._send(404, {"error": f"fake hub: no route for {method} {path}"})

    def whoami(self, body: bytes) -> None:
        self._send(
            200, {"type": "user", "name": "tester", "auth": {"accessToken": {"role": "write"}}}
        )

    def agent_harnesses(self, body: bytes) -> None:
        self._send(200, {"standardEnvVars": [], "harnesses": {}})

    def validate_yaml(self, body: bytes) -> None:
        import yaml

        content = json.loads(body)["content"]
        try:
            meta = yaml.safe_load(content.split("---")[1]) if content.startswith("---") else {}
        except (yaml.YAMLError, IndexError) as exc:
            self._send(400, {"errors": [{"message": f"invalid YAML: {exc}"}]})
            return
        self._send(200 if isinstance(meta, dict) else 400, {"errors": [], "warnings": []})

    def create_repo(self, body: bytes) -> None:
        payload = json.loads(body or b"{}")
        repo_id = f"{payload.get('organization') or 'tester'}/{payload['name']}"
        if repo_id in self.hub.repos:
            self._send(
                409,
                {
                    "error": "You already created this model repo",
                    "url": f"{self.hub.url}/{repo_id}",
                },
            )
            return
        private = payload.get("private", payload.get("visibility") == "private")
        self.hub.repos[repo_id] = {
            "private": bool(private),
            "commits": [],
            "branches": {"main": {"files": {}, "sha": _sha("init" + repo_id)}},
        }
        self._send(200, {"url": f"{self.hub.url}/{repo_id}", "name": repo_id})

    def create_branch(self, body: bytes, repo: str, branch: str) -> None:
        r = self._repo(repo)
        if r is None:
            return
        if branch in r["branches"]:
            self._send(409, {"error": "Reference already exists"})
            return
        r["branches"][branch] = {
            "files": dict(r["branches"]["main"]["files"]),
            "sha": r["branches"]["main"]["sha"],
        }
        self._send(200, {})

    def preupload(self, body: bytes, repo: str, rev: str) -> None:
        if self._repo(repo) is None:
            return
        files = json.loads(body)["files"]
        self._send(
            200,
            {
                "files": [
                    {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False, "oid": None}
                    for f in files
                ],
                "commitOid": None,
            },
        )

    def commit(self, body: bytes, repo: str, rev: str) -> None:
        r = self._repo(repo)
        if r is None:
            return
        if rev not in r["branches"]:
            self._send(
                404,
                {"error": f"Invalid rev id: {rev}"},
                headers={"X-Error-Code": "RevisionNotFound"},
            )
            return
        time.sleep(self.hub.commit_delay)
        branch = r["branches"][rev]
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        header = next(item["value"] for item in lines if item["key"] == "header")
        paths = []
        for item in lines:
            value = item["value"]
            if item["key"] == "file":
                branch["files"][value["path"]] = base64.b64decode(value["content"])
                paths.append(value["path"])
            elif item["key"] == "deletedFile":
                branch["files"].pop(value["path"], None)
        branch["sha"] = _sha(json.dumps(header) + str(len(r["commits"])) + repo)
        r["commits"].append(
            {"summary": header["summary"], "branch": rev, "paths": paths, "sha": branch["sha"]}
        )
        self._send(
            200,
            {
                "commitUrl": f"{self.hub.url}/{repo}/commit/{branch['sha']}",
                "commitOid": branch["sha"],
                "pullRequestUrl": None,
            },
        )

    def repo_info(self, body: bytes, repo: str, rev: str = "main") -> None:
        r = self._repo(repo)
        if r is None:
            return
        branch = r["branches"].get(rev) or r["branches"]["main"]
        self._send(
            200,
            {
                "id": repo,
                "modelId": repo,
                "sha": branch["sha"],
                "private": r["private"],
                "siblings": [{"rfilename": p} for p in sorted(branch["files"])],
                "tags": [],
            },
        )

    def resolve(self, body: bytes, repo: str, rev: str, file: str) -> None:
        r = self.hub.repos.get(repo)
        branch = r["branches"].get(rev) if r else None
        if branch is None or file not in branch["files"]:
            self._send(404, {"error": "Entry not found"}, headers={"X-Error-Code": "EntryNotFound"})
            return
        data = branch["files"][file]
        etag = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        self._send(
            200,
            raw=data,
            head=self.command == "HEAD",
            headers={"X-Repo-Commit": branch["sha"], "ETag": f'"{etag}"'},
        )


def _sha(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()
