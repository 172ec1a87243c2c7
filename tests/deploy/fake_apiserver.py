"""A stand-in for the Kubernetes API server (none can run on these machines; say so where used).

It speaks just enough HTTP for server-side apply and reads: ``PATCH`` with
``application/apply-patch+yaml`` creates or replaces the object at that URL (keeping its uid and
status, like the real one keeps fields other managers own), ``GET`` returns it or 404. Every
request is recorded so a test can check content types, field managers and paths.
"""

from __future__ import annotations

import json
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import yaml

TOKEN = "test-token"


class FakeApiServer:
    def __init__(self):
        self.objects: dict[str, dict] = {}
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> "FakeApiServer":
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def kubeconfig(self, path: Path) -> Path:
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "tester", "user": {"token": TOKEN}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "tester"}}]}))
        return path

    def set_status(self, path: str, status: dict) -> None:
        with self.lock:
            self.objects[path]["status"] = status

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _record(self, body: bytes | None = None) -> tuple[str, dict]:
                url = urlparse(self.path)
                query = {k: v[0] for k, v in parse_qs(url.query).items()}
                with fake.lock:
                    fake.requests.append({"method": self.command, "path": url.path, "query": query,
                                          "content_type": self.headers.get("Content-Type"),
                                          "authorization": self.headers.get("Authorization")})
                return url.path, query

            def do_GET(self):
                path, _ = self._record()
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    return self._reply(401, {"kind": "Status", "code": 401})
                with fake.lock:
                    obj = fake.objects.get(path)
                if obj is None:
                    return self._reply(404, {"kind": "Status", "code": 404, "reason": "NotFound"})
                self._reply(200, obj)

            def do_PATCH(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                path, query = self._record(body)
                if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    return self._reply(401, {"kind": "Status", "code": 401})
                if self.headers.get("Content-Type") != "application/apply-patch+yaml" or "fieldManager" not in query:
                    return self._reply(415, {"kind": "Status", "code": 415, "message": "not a server-side apply"})
                doc = yaml.safe_load(body)
                if path.rsplit("/", 1)[-1] != doc["metadata"]["name"]:
                    return self._reply(400, {"kind": "Status", "code": 400, "message": "name does not match URL"})
                with fake.lock:
                    old = fake.objects.get(path, {})
                    doc["metadata"]["uid"] = old.get("metadata", {}).get("uid") or str(uuid.uuid4())
                    if "status" in old:
                        doc["status"] = old["status"]
                    if query.get("dryRun") != "All":
                        fake.objects[path] = doc
                self._reply(200 if old else 201, doc)

        return Handler
