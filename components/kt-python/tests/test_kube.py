"""`kt.configure(kube=True)` and `KT_KUBE=1`: kt from outside the cluster,
through a scripted Kubernetes API (``kubeapi.py``) whose port-forwards reach
the loopback testbed, as `kt --kube` reaches a cluster."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kubeapi import KubeApi, first, port_of
from loopback import unique


@pytest.fixture()
def kube(testbed, tmp_path, monkeypatch):
    api = KubeApi(testbed.token, port_of(testbed.metadata.url))
    api.kubeconfig(tmp_path / "kubeconfig")
    # A laptop: no token, no metadata URL, no agent.
    for var in ("KT_TOKEN", "KT_TOKEN_FILE", "KT_METADATA_URL", "KT_AGENT_SOCKET",
                "KT_KUBE", "KT_KUBE_CONTEXT", "KT_NAMESPACE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "kubeconfig"))
    yield api
    api.stop()


def test_put_get_ls_rm_through_the_api_servers_port_forward(kube, tmp_path):
    import kt
    kt.configure(kube=True, context="loopback")
    s = kt.settings()
    assert s.kube and s.metadata_url.startswith("http://127.0.0.1:")
    assert first(kube.requests, "GET /api/v1/namespaces/kt/secrets/kt-token"), kube.requests
    key = unique("kube")
    (tmp_path / "model").mkdir()
    (tmp_path / "model/w.bin").write_bytes(os.urandom(150_000))
    r = kt.put(key, src=tmp_path / "model")
    assert r.bytes_sent == 150_000
    got = kt.get(key, dest=tmp_path / "copy")
    assert (tmp_path / "copy/w.bin").read_bytes() == (tmp_path / "model/w.bin").read_bytes()
    assert got.bytes_sent == 150_000
    assert [i.key for i in kt.ls(key.rsplit("/", 1)[0]) if i.key == key] == [key]
    assert kt.rm(key) == [key]
    # The metadata server through its Service, the store by its pod's IP.
    assert first(kube.requests, "GET /api/v1/namespaces/kt/services/kt-metadata")
    assert first(kube.requests, "GET /api/v1/namespaces/kt/pods?&fieldSelector=status.podIP")
    assert kube.forwards >= 2


def test_kt_kube_and_kt_namespace_from_the_environment(kube, tmp_path, monkeypatch):
    import kt
    # The current context's namespace is "elsewhere": KT_NAMESPACE wins.
    monkeypatch.setenv("KT_KUBE", "1")
    monkeypatch.setenv("KT_NAMESPACE", "kt")
    kt.configure()
    assert kt.settings().kube
    assert kt.ls("py") is not None
    # What needs a pod's agent is refused, as kt --kube refuses it.
    (tmp_path / "f").write_text("x")
    with pytest.raises(kt.InvalidInput, match="kube=True"):
        kt.put(unique("local"), src=tmp_path / "f", locale="local")
    with pytest.raises(kt.InvalidInput, match="kube=True"):
        kt.get(unique("bc"), dest=tmp_path / "d",
               broadcast=kt.BroadcastWindow(group_id="g", timeout=5.0))
    with pytest.raises(kt.InvalidInput, match="kube=True"):
        kt.put(unique("tensor"), src=np.ones(4, np.float32))
    # kube=False turns KT_KUBE off again.
    monkeypatch.setenv("KT_TOKEN", kube.token)
    kt.configure(kube=False, metadata_url=kube.url)
    assert not kt.settings().kube


def test_the_wrong_namespace_says_what_it_tried(kube):
    import kt
    with pytest.raises(kt.Unavailable, match="kube: .*elsewhere"):
        kt.configure(kube=True)
