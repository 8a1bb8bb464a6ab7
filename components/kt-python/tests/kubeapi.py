"""A scripted Kubernetes API server for the Python package's `kube=True`
tests, over plain HTTP on loopback: what `kt --kube` (kt-client's
`external`, kt-kube's `portforward`) asks of a cluster, answered for the
loopback testbed.

- Secret ``kt-token`` (key ``token``): the testbed's token.
- Service ``kt-metadata`` (port 8081): a Ready pod ``kt-metadata-0`` whose
  container port is the loopback metadata server's.
- Pods by IP (``status.podIP=127.0.0.1``): ``loopback-0``, Running.
- A pod's port-forward (the WebSocket upgrade ``v4.channel.k8s.io``): port
  P of any pod is 127.0.0.1:P.

Every request is recorded (``requests``) as ``METHOD path?query``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import socket
import struct
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, List, Optional, Tuple

NAMESPACE = "kt"
WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


def _pod(name: str, port: int, ip: str = "127.0.0.1") -> Dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE, "resourceVersion": "1",
                     "labels": {"app": name.rsplit("-", 1)[0]}},
        "spec": {"containers": [{"name": "server",
                                 "ports": [{"name": "http", "containerPort": port}]}]},
        "status": {"phase": "Running", "podIP": ip,
                   "conditions": [{"type": "Ready", "status": "True"}]},
    }


class _WebSocket:
    """The server's end of one port-forward: frames in, frames out."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()

    def send(self, opcode: int, payload: bytes) -> None:
        n = len(payload)
        if n < 126:
            head = struct.pack("!BB", 0x80 | opcode, n)
        elif n < 1 << 16:
            head = struct.pack("!BBH", 0x80 | opcode, 126, n)
        else:
            head = struct.pack("!BBQ", 0x80 | opcode, 127, n)
        with self.lock:
            self.sock.sendall(head + payload)

    def _exactly(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            got = self.sock.recv(n - len(buf))
            if not got:
                raise EOFError
            buf += got
        return buf

    def receive(self) -> Tuple[int, bytes]:
        b0, b1 = self._exactly(2)
        n = b1 & 0x7F
        if n == 126:
            (n,) = struct.unpack("!H", self._exactly(2))
        elif n == 127:
            (n,) = struct.unpack("!Q", self._exactly(8))
        mask = self._exactly(4) if b1 & 0x80 else b"\0\0\0\0"
        data = self._exactly(n)
        return b0 & 0x0F, bytes(b ^ mask[i % 4] for i, b in enumerate(data))


class KubeApi:
    """The scripted API server; ``kubeconfig(path)`` writes a kubeconfig
    that reaches it."""

    def __init__(self, token: str, metadata_port: int) -> None:
        self.token = token
        self.metadata_port = metadata_port
        self.requests: List[str] = []
        self.forwards = 0
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                api.requests.append(f"GET {self.path}")
                url = urllib.parse.urlsplit(self.path)
                if url.path.endswith("/portforward"):
                    api._forward(self, url)
                    return
                status, body = api._answer(url.path, urllib.parse.parse_qs(url.query))
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def kubeconfig(self, path: Any) -> None:
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "loopback", "cluster": {"server": self.url}}],
            "users": [{"name": "operator", "user": {"token": "operator-token"}}],
            "contexts": [{"name": "loopback",
                          "context": {"cluster": "loopback", "user": "operator",
                                      "namespace": NAMESPACE}},
                         {"name": "elsewhere",
                          "context": {"cluster": "loopback", "user": "operator",
                                      "namespace": "elsewhere"}}],
            "current-context": "elsewhere",
        }))

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _answer(self, path: str, query: Dict[str, List[str]]) -> Tuple[int, Any]:
        base = f"/api/v1/namespaces/{NAMESPACE}/"
        if not path.startswith(base):
            return 404, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                         "reason": "NotFound", "code": 404, "message": f"{path} not found"}
        what = path[len(base):]
        if what == "secrets/kt-token":
            token = base64.b64encode(self.token.encode()).decode()
            return 200, {"apiVersion": "v1", "kind": "Secret",
                         "metadata": {"name": "kt-token", "namespace": NAMESPACE},
                         "data": {"token": token}}
        if what == "services/kt-metadata":
            return 200, {"apiVersion": "v1", "kind": "Service",
                         "metadata": {"name": "kt-metadata", "namespace": NAMESPACE,
                                      "resourceVersion": "1"},
                         "spec": {"selector": {"app": "kt-metadata"},
                                  "ports": [{"name": "http", "port": 8081,
                                             "targetPort": self.metadata_port}]}}
        if what == "pods":
            items: List[Dict[str, Any]] = []
            labels = query.get("labelSelector", [""])[0]
            fields = query.get("fieldSelector", [""])[0]
            if labels == "app=kt-metadata":
                items = [_pod("kt-metadata-0", self.metadata_port)]
            elif fields == "status.podIP=127.0.0.1":
                items = [_pod("loopback-0", 0)]
            return 200, {"apiVersion": "v1", "kind": "PodList",
                         "metadata": {"resourceVersion": "1"}, "items": items}
        return 404, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                     "reason": "NotFound", "code": 404, "message": f"{what} not found"}

    def _forward(self, h: BaseHTTPRequestHandler, url: urllib.parse.SplitResult) -> None:
        port = int(urllib.parse.parse_qs(url.query)["ports"][0].split(",")[0])
        key = h.headers["Sec-WebSocket-Key"]
        accept = base64.b64encode(hashlib.sha1((key + WS_GUID).encode()).digest()).decode()
        h.send_response(101, "Switching Protocols")
        h.send_header("Upgrade", "websocket")
        h.send_header("Connection", "Upgrade")
        h.send_header("Sec-WebSocket-Accept", accept)
        h.send_header("Sec-WebSocket-Protocol", "v4.channel.k8s.io")
        h.end_headers()
        h.wfile.flush()
        self.forwards += 1
        ws = _WebSocket(h.connection)
        upstream = socket.create_connection(("127.0.0.1", port))
        # Each channel first names its port (data 0, error 1).
        for ch in (0, 1):
            ws.send(0x2, bytes([ch]) + struct.pack("<H", port))

        def from_pod() -> None:
            try:
                while True:
                    data = upstream.recv(65536)
                    if not data:
                        break
                    ws.send(0x2, b"\0" + data)
            except OSError:
                pass
            try:
                ws.send(0x8, b"")
            except OSError:
                pass

        t = threading.Thread(target=from_pod, daemon=True)
        t.start()
        try:
            while True:
                opcode, payload = ws.receive()
                if opcode == 0x8:
                    break
                if opcode == 0x9:
                    ws.send(0xA, payload)
                elif opcode == 0x2 and payload and payload[0] == 0:
                    upstream.sendall(payload[1:])
        except (EOFError, OSError):
            pass
        try:
            upstream.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        t.join(timeout=10)
        upstream.close()
        h.close_connection = True


def port_of(url: str) -> int:
    """The port of ``http://host:port``."""
    return int(url.rsplit(":", 1)[1])


def first(items: List[str], prefix: str) -> Optional[str]:
    return next((i for i in items if i.startswith(prefix)), None)
