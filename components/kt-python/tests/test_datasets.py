"""kt.datasets against the in-memory Kubernetes API server
(``kt-test-apiserver``, kt-kube's ``apiserver``): apply, get, ls, wait, rm,
and their errors. The controller does not run here: the tests write the
status a controller would, through the status subresource."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import threading
import urllib.request
from typing import Any, Dict, Iterator, Tuple

import pytest

import kt
from kt.errors import InvalidInput, KtError, NotFound, Timeout

BIN = pathlib.Path(os.environ.get("KT_BIN_DIR") or
                   pathlib.Path(__file__).resolve().parents[3] / "target" / "debug")
NS = "team"


@pytest.fixture()
def api(tmp_path: pathlib.Path) -> Iterator[Tuple[str, str]]:
    """(kubeconfig path, API server URL)."""
    exe = BIN / "kt-test-apiserver"
    if not exe.exists():
        pytest.fail(f"{exe} is missing: cargo build -p kt-tests --bins (or set KT_BIN_DIR)")
    kubeconfig = tmp_path / "kubeconfig"
    proc = subprocess.Popen([str(exe), str(kubeconfig)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("ready "), line
    yield str(kubeconfig), line.split()[1]
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(timeout=10)


def set_status(url: str, name: str, status: Dict[str, Any]) -> None:
    """What the controller does: a merge patch of the status subresource."""
    req = urllib.request.Request(
        f"{url}/apis/kt.dev/v1alpha1/namespaces/{NS}/datasets/{name}/status",
        data=json.dumps({"status": status}).encode(), method="PATCH",
        headers={"Content-Type": "application/merge-patch+json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200


def test_apply_get_ls_rm(api: Tuple[str, str]) -> None:
    kc, url = api
    [ds] = kt.datasets.apply("imagenet", key="team/imagenet", replicas=8,
                             node_selector={"gpu": "a100"}, kubeconfig=kc, namespace=NS)
    assert (ds.name, ds.namespace, ds.phase, ds.generation) == ("imagenet", NS, "Pending", 1)
    assert ds.spec["source"] == {"key": "team/imagenet"}
    assert ds.spec["placement"] == {"replicas": 8, "nodeSelector": {"gpu": "a100"}}
    kt.datasets.apply(manifest="""
apiVersion: kt.dev/v1alpha1
kind: Dataset
metadata: {name: shards}
spec:
  source: {s3: {bucket: b, prefix: train/, endpoint: "http://minio:9000"}}
""", kubeconfig=kc, namespace=NS)
    set_status(url, "imagenet", {"phase": "Seeding", "version": "v3", "readyNodes": 5,
                                 "nodes": [{"name": "node-1", "state": "Ready", "bytes": 10}],
                                 "observedGeneration": 1})
    got = kt.datasets.get("imagenet", kubeconfig=kc, namespace=NS)
    assert (got.phase, got.version, got.ready_nodes) == ("Seeding", "v3", 5)
    assert got.nodes == [kt.datasets.NodeCopy(name="node-1", state="Ready", bytes=10)]
    assert [d.name for d in kt.datasets.ls(kubeconfig=kc, namespace=NS)] == ["imagenet", "shards"]
    assert kt.datasets.rm("imagenet", kubeconfig=kc, namespace=NS) is True
    assert kt.datasets.rm("imagenet", kubeconfig=kc, namespace=NS) is False
    with pytest.raises(NotFound):
        kt.datasets.get("imagenet", kubeconfig=kc, namespace=NS)


def test_wait_returns_on_ready_and_raises_the_failure(api: Tuple[str, str]) -> None:
    kc, url = api
    kt.datasets.apply("imagenet", key="team/imagenet", kubeconfig=kc, namespace=NS)

    def controller() -> None:
        set_status(url, "imagenet", {"phase": "Seeding", "observedGeneration": 1})
        set_status(url, "imagenet", {"phase": "Ready", "observedGeneration": 1,
                                     "readyNodes": 1, "version": "v1"})

    t = threading.Thread(target=controller)
    t.start()
    ds = kt.datasets.wait("imagenet", "Ready", timeout=60, kubeconfig=kc, namespace=NS)
    t.join()
    assert (ds.phase, ds.version) == ("Ready", "v1")

    set_status(url, "imagenet", {"phase": "Failed", "reason": "KeyNotFound",
                                 "observedGeneration": 1})
    with pytest.raises(KtError, match="KeyNotFound"):
        kt.datasets.wait("imagenet", timeout=60, kubeconfig=kc, namespace=NS)
    set_status(url, "imagenet", {"phase": "Seeding", "observedGeneration": 1})
    with pytest.raises(Timeout):
        kt.datasets.wait("imagenet", timeout=0.5, kubeconfig=kc, namespace=NS)
    with pytest.raises(NotFound):
        kt.datasets.wait("absent", timeout=30, kubeconfig=kc, namespace=NS)


def test_bad_input_says_why(api: Tuple[str, str]) -> None:
    kc, _ = api
    for kwargs, want in [
        ({}, "needs a source"),
        ({"key": "a/b", "s3": "s3://b"}, "one source"),
        ({"key": "../x"}, "key"),
        ({"key": "a/b", "replicas": 0}, "at least 1"),
        ({"key": "a/b", "replicas": "8"}, "not an int"),
        ({"key": "a/b", "wait": "Done"}, "not a phase"),
        ({"key": "a/b", "timeout": -1}, "positive"),
    ]:
        with pytest.raises(InvalidInput, match=want):
            kt.datasets.apply("x", kubeconfig=kc, namespace=NS, **kwargs)
    with pytest.raises(InvalidInput, match="not a kt.dev/v1alpha1 Dataset"):
        kt.datasets.apply(manifest="apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n",
                          kubeconfig=kc, namespace=NS)
    with pytest.raises(InvalidInput, match="drop name"):
        kt.datasets.apply("x", manifest="kind: Dataset", kubeconfig=kc, namespace=NS)
    assert kt.datasets.ls(kubeconfig=kc, namespace=NS) == []
