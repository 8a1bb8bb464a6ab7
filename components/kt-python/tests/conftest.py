"""Fixtures of the Python package's tests: one loopback testbed
(:mod:`loopback`) per session, pods, and code run as a pod's process."""

from __future__ import annotations

import pytest

from loopback import Pod, Testbed, in_pod


@pytest.fixture(scope="session")
def testbed(tmp_path_factory) -> Testbed:
    tb = Testbed(tmp_path_factory.mktemp("kt"))
    yield tb
    tb.stop()


@pytest.fixture()
def pod_a(testbed):
    return testbed.pod("pod-a")


@pytest.fixture()
def kt_in(testbed, monkeypatch):
    """Configures this process's kt as a process of the given pod."""
    import kt

    def configure(pod: Pod):
        for k, v in testbed.env(pod).items():
            monkeypatch.setenv(k, v)
        kt.configure()
        return kt

    return configure


@pytest.fixture()
def run_in():
    return in_pod


