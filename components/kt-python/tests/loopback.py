"""A kt testbed on loopback for the Python package's tests and benchmark: the real
metadata server, store and node agents (the workspace's binaries,
``KT_BIN_DIR`` or ``target/debug``), each on 127.0.0.x:0, their addresses
read from their own logs. Every "pod" is an agent with its own loopback
address, control socket and shared-memory directory; code that acts as a
pod runs in a child process with that pod's environment (:func:`in_pod`).
"""

from __future__ import annotations

import json
import os
import pathlib
import secrets
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, TypeVar

T = TypeVar("T")

REPO = pathlib.Path(__file__).resolve().parents[3]
BIN = pathlib.Path(os.environ.get("KT_BIN_DIR") or REPO / "target" / "debug")
READY_TIMEOUT = 30.0


def _wait_for(what: str, check: Callable[[], Optional[T]], timeout: float = READY_TIMEOUT) -> T:
    """Polls ``check`` until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not within {timeout}s")
        time.sleep(0.02)


@dataclass
class Server:
    proc: "subprocess.Popen[bytes]"
    log: pathlib.Path
    url: str = ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _listening(log: pathlib.Path, message: str) -> Optional[str]:
    """The address a server logged with ``message`` (JSON logs)."""
    if not log.exists():
        return None
    for line in log.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("message") == message and rec.get("addr"):
            return f"http://{rec['addr']}"
    return None


def _start(binary: str, args: List[str], env: Dict[str, str], log: pathlib.Path) -> Server:
    path = BIN / binary
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: build the workspace first "
                                "(cargo build --workspace --bins) or set KT_BIN_DIR")
    out = log.open("w")
    proc = subprocess.Popen([str(path), *args], stdin=subprocess.DEVNULL, stdout=out,
                            stderr=subprocess.STDOUT,
                            env={**os.environ, **env, "KT_LOG_FORMAT": "json"})
    return Server(proc, log)


@dataclass
class Pod:
    """A pod of the testbed: its node agent and what a process in it sees."""

    name: str
    ip: str
    dir: pathlib.Path
    shm: pathlib.Path
    agent: Server

    @property
    def socket(self) -> pathlib.Path:
        return self.dir / "agent.sock"


class Testbed:
    """``shm_root``: where pods' shared-memory directories go (default: in
    each pod's directory; a benchmark puts them on tmpfs, as /dev/shm is in
    a real pod). ``grants``: tokens the metadata server and the store accept
    besides the testbed's own (admin), as a tokens file lists them
    (``{"token": .., "role": "workload", "services": [..], "reads": [..]}``)."""

    __test__ = False  # not a test class of pytest's

    def __init__(self, root: pathlib.Path, shm_root: Optional[pathlib.Path] = None,
                 grants: Sequence[Dict[str, Any]] = ()) -> None:
        self.root = root
        self.shm_root = shm_root
        root.mkdir(parents=True, exist_ok=True)
        self.token = secrets.token_hex(16)
        env = {"KT_TOKEN": self.token}
        auth: List[str] = []
        if grants:
            tokens = root / "tokens.json"
            tokens.write_text(json.dumps(
                {"tokens": [{"token": self.token, "role": "admin"}, *grants]}))
            auth = ["--auth-file", str(tokens)]
        self.metadata = _start("kt-metadata",
                               ["--listen", "127.0.0.1:0", "--state-dir", str(root / "metadata"),
                                "--heartbeat-interval", "200ms", "--agent-ttl", "5s", *auth],
                               env, root / "metadata.log")
        self.metadata.url = _wait_for("the metadata server",
                                      lambda: _listening(self.metadata.log,
                                                         "metadata server listening"))
        self.store = _start("kt-store",
                            ["--listen", "127.0.0.1:0", "--data-dir", str(root / "store"),
                             "--metadata-url", self.metadata.url, *auth],
                            env, root / "store.log")
        self.store.url = _wait_for("the store",
                                   lambda: _listening(self.store.log, "store listening"))
        self.pods: Dict[str, Pod] = {}
        # The store registers itself: wait until the metadata server knows it.
        import urllib.request

        def store_known() -> Optional[bool]:
            req = urllib.request.Request(f"{self.metadata.url}/api/v1/store",
                                         headers={"Authorization": f"Bearer {self.token}"})
            try:
                with urllib.request.urlopen(req, timeout=2) as r:
                    return bool(r.status == 200)
            except OSError:
                return False

        _wait_for("the store's registration", store_known)

    def pod(self, name: str, service: str = "tests", args: Sequence[str] = ()) -> Pod:
        """The pod ``name`` of ``service``, its agent started on first use
        (with ``args`` besides the testbed's)."""
        if name in self.pods:
            return self.pods[name]
        ip = f"127.0.0.{len(self.pods) + 2}"
        d = self.root / "pods" / name
        shm = (self.shm_root / name) if self.shm_root else d / "shm"
        d.mkdir(parents=True)
        shm.mkdir(parents=True)
        agent = _start("kt-agent",
                       ["--listen", f"{ip}:0", "--id", name, "--metadata-url", self.metadata.url,
                        "--socket", str(d / "agent.sock"), "--state-dir", str(d / ".kt-agent"),
                        "--shm-dir", str(shm), "--tensor-port", "0",
                        "--service", service, *args],
                       # A host of its own to NCCL, as on the scenario targets:
                       # NCCL refuses two ranks of one communicator on one GPU
                       # of one host, and these pods share the machine's GPUs.
                       {"KT_TOKEN": self.token, "KT_POD_IP": ip,
                        "NCCL_HOSTID": f"kt-pytest-{os.getpid()}-{name}"}, d / "agent.log")
        pod = Pod(name, ip, d, shm, agent)
        _wait_for(f"the agent of {name}", lambda: pod.socket.exists())
        self.pods[name] = pod
        return pod

    def env(self, pod: Pod) -> Dict[str, str]:
        """What a process in ``pod`` sees."""
        return {"KT_METADATA_URL": self.metadata.url, "KT_TOKEN": self.token,
                "KT_AGENT_SOCKET": str(pod.socket), "KT_SHM_DIR": str(pod.shm),
                "KT_POD_IP": pod.ip, "KT_AGENT_AUTOSTART": "0"}

    def stop(self) -> None:
        for p in self.pods.values():
            p.agent.stop()
        self.store.stop()
        self.metadata.stop()


def in_pod(testbed: Testbed, pod: Pod, code: str, *, timeout: float = 120,
           background: bool = False, cwd: Optional[pathlib.Path] = None) -> Any:
    """Runs Python ``code`` in a child process of ``pod`` (from ``cwd``,
    default this process's; this directory's modules importable). With
    ``background`` the process is returned running (it reads lines from
    stdin to carry on), else waited for and its completed result returned."""
    here = str(pathlib.Path(__file__).resolve().parent)
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, **testbed.env(pod), "PYTHONPATH": path}
    argv = [sys.executable, "-c", textwrap.dedent(code)]
    if background:
        return subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=cwd)
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=cwd)


def unique(name: str) -> str:
    """A key prefix no other test uses."""
    return f"py/{name}-{secrets.token_hex(4)}"
