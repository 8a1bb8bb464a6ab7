"""Every exception class, bad input refused before anything moves, the GIL
released during transfers, and Ctrl-C."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import textwrap
import threading
import time

import numpy as np
import pytest

from loopback import unique


def test_every_error_has_its_class_code_and_message(testbed, pod_a, kt_in, run_in, tmp_path,
                                                    monkeypatch):
    kt = kt_in(pod_a)
    with pytest.raises(kt.NotFound) as e:
        kt.get(unique("missing"), dest=tmp_path / "x")
    assert e.value.code == "not_found" and "not found" in e.value.message.lower()
    assert isinstance(e.value, LookupError) and isinstance(e.value, kt.KtError)

    with pytest.raises(kt.InvalidInput) as e:
        kt.put("bad/../key", src=tmp_path)
    assert e.value.code in ("invalid_key", "invalid_request") and "key" in str(e.value)
    assert isinstance(e.value, ValueError)

    # Conflict: a key lent by another live process of the same pod.
    key = unique("taken")
    holder = run_in(testbed, pod_a, f"""
        import sys, numpy as np, kt
        kt.put("{key}", src=np.ones(4, np.float32))
        print("held", flush=True)
        sys.stdin.readline()
    """, background=True)
    try:
        assert holder.stdout.readline().strip() == "held", holder.stderr.read()
        with pytest.raises(kt.Conflict) as e:
            kt.put(key, src=np.ones(4, np.float32))
        assert e.value.code == "conflict"
    finally:
        holder.stdin.write("\n")
        holder.stdin.flush()
        holder.wait(30)

    # Unauthorized: a wrong token.
    kt.configure(token="not-the-token")
    with pytest.raises(kt.Unauthorized) as e:
        kt.ls()
    assert e.value.code == "unauthorized"

    # Unavailable: nothing listens at the metadata URL.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    kt.configure(metadata_url=f"http://127.0.0.1:{dead}", token=testbed.token)
    with pytest.raises(kt.Unavailable) as e:
        kt.ls()
    assert e.value.code == "unavailable"
    assert str(dead) in str(e.value)

    # No token at all.
    monkeypatch.delenv("KT_TOKEN", raising=False)
    monkeypatch.delenv("KT_TOKEN_FILE", raising=False)
    with pytest.raises(kt.Unauthorized) as e:
        kt.configure()
    assert "KT_TOKEN" in str(e.value)


def test_bad_input_is_refused_before_anything_is_sent(testbed, pod_a, kt_in, tmp_path):
    kt = kt_in(pod_a)
    key = unique("bad")
    with pytest.raises(TypeError, match="src must be a path"):
        kt.put(key, src=[1, 2, 3])
    with pytest.raises(TypeError, match="key must be a str"):
        kt.put(123, src=tmp_path)  # type: ignore[arg-type]
    with pytest.raises(kt.InvalidInput, match="locale: 'moon'"):
        kt.put(key, src=tmp_path, locale="moon")
    with pytest.raises(kt.InvalidInput, match="lifespan"):
        kt.put(key, src=tmp_path, lifespan="forever")
    with pytest.raises(kt.InvalidInput, match="ttl"):
        kt.put(key, src=tmp_path, ttl=-5)
    with pytest.raises(kt.InvalidInput, match="not contiguous"):
        kt.put(key, src=np.ones((8, 8), np.float32)[:, ::2])
    with pytest.raises(kt.InvalidInput, match="dtype complex64"):
        kt.put(key, src=np.ones(4, np.complex64))
    with pytest.raises(TypeError, match=r"src\['b'\] must be a numpy.ndarray"):
        kt.put(key, src={"a": np.ones(2), "b": [1, 2]})
    with pytest.raises(kt.InvalidInput, match="read-only"):
        ro = np.ones(4, np.float32)
        ro.flags.writeable = False
        kt.get(key, dest=ro)
    with pytest.raises(kt.InvalidInput, match="world_size"):
        kt.get(key, dest=tmp_path / "d", broadcast=kt.BroadcastWindow(world_size=3))
    with pytest.raises(kt.InvalidInput, match="world_size: at least 2"):
        kt.put(key, src=np.ones(2), broadcast=kt.BroadcastWindow(world_size=1))
    with pytest.raises(TypeError, match="broadcast must be a kt.BroadcastWindow"):
        kt.get(key, dest=tmp_path / "d", broadcast={"world_size": 2})
    # Nothing reached the metadata server, nothing landed in a destination.
    assert [i for i in kt.ls("py") if i.name.startswith("bad-")] == []
    assert not (tmp_path / "d").exists()
    # A destination of another layout: refused before anything moves.
    good = unique("layout")
    kt.put(good, src=np.arange(8, dtype=np.float32))
    dest = np.full(4, 7, np.float32)
    with pytest.raises(kt.InvalidInput, match=r"f32\[8\].*f32\[4\]"):
        kt.get(good, dest=dest)
    assert (dest == 7).all(), "left untouched"


def test_the_gil_is_released_while_a_transfer_waits(testbed, pod_a, kt_in, tmp_path,
                                                   monkeypatch):
    kt = kt_in(pod_a)
    key = unique("gil")
    src = tmp_path / "big"
    src.mkdir()
    with open(src / "blob", "wb") as f:
        f.truncate(256 << 20)  # 256 MiB (sparse: fast to make, real to move)
    kt.put(key, src=src)
    spins = [0]
    done = threading.Event()

    def spin():
        while not done.is_set():
            spins[0] += 1
            time.sleep(0.0001)  # gives the GIL back at once when the main thread wants it

    # Counts the other thread's turns while the main thread is inside the
    # native call, and only then: held there, the GIL would stop it.
    during = []
    native = kt._kt.get_path

    def counted(*args):
        before = spins[0]
        try:
            return native(*args)
        finally:
            during.append(spins[0] - before)

    monkeypatch.setattr(kt._kt, "get_path", counted)
    t = threading.Thread(target=spin)
    t.start()
    try:
        kt.get(key, dest=tmp_path / "copy")
    finally:
        done.set()
        t.join()
    assert (tmp_path / "copy/blob").stat().st_size == 256 << 20
    assert len(during) == 1 and during[0] > 10, during


def quorum_members(testbed, group: str) -> list:
    """The members of ``group``'s open round, as the metadata server has
    them (none when it has no open round yet)."""
    import json
    import urllib.error
    import urllib.parse
    import urllib.request

    url = f"{testbed.metadata.url}/api/v1/quorums/{urllib.parse.quote(group, safe='')}"
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {testbed.token}"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return list((json.load(r).get("open") or {}).get("members", []))
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return []
        raise


def wait_until(what: str, check, p, timeout: float = 60) -> None:
    """Polls ``check`` until it is true; fails (with ``p``'s output) if
    ``p`` ends first or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while not check():
        if p.poll() is not None:
            out, err = p.communicate()
            pytest.fail(f"ended before {what}: {out} {err}")
        if time.monotonic() > deadline:
            p.kill()
            out, err = p.communicate()
            pytest.fail(f"not {what} within {timeout}s: {out} {err}")
        time.sleep(0.02)


def written(pid: int) -> int:
    """Bytes process ``pid`` has written so far (``wchar``)."""
    with open(f"/proc/{pid}/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))


def test_ctrl_c_stops_a_quorum_wait_and_leaves_the_destination(testbed, pod_a, run_in):
    """A getter waiting for a quorum that never fills (its window is an
    hour) ends at Ctrl-C with KeyboardInterrupt, its array untouched, its
    join withdrawn from the round while the process lives on (kept, it
    would refuse the process's next join of the group and close a round
    with a member no call waits for), and its next tensor call works."""
    key = unique("interrupt-q")
    group = unique("g").replace("/", "-")
    p = run_in(testbed, pod_a, textwrap.dedent(f"""
        import sys, numpy as np, kt
        dest = np.full(16, 7, np.float32)
        try:
            kt.get("{key}", dest=dest,
                   broadcast=kt.BroadcastWindow(group_id="{group}", world_size=2, timeout=3600))
            print("finished", flush=True)
        except KeyboardInterrupt:
            print("interrupted", "untouched" if (dest == 7).all() else "changed", flush=True)
        # The interrupted call's connection may still owe a reply: the next
        # tensor call goes through another one, at once.
        kt.put("{key}-after", src=np.ones(4, np.float32))
        print("then put", flush=True)
        # Alive until the test has looked at the round.
        sys.stdin.readline()
        sys.exit(7)
    """), background=True)
    # Its join is in the group's open round: the getter is inside kt's
    # native get, waiting for the quorum (however long a busy machine took
    # to get it there).
    wait_until("joined", lambda: quorum_members(testbed, group), p)
    p.send_signal(signal.SIGINT)
    # The process lives on; its join does not (the window is an hour).
    wait_until("withdrawn", lambda: not quorum_members(testbed, group), p)
    try:
        out, err = p.communicate(input="\n", timeout=60)
    except subprocess.TimeoutExpired:
        # Say how far it got (interrupted? the put after?) and what the
        # agent was doing, not just that it took too long.
        p.kill()
        out, err = p.communicate()
        agent_log = pod_a.agent.log.read_text()[-4000:] if pod_a.agent.log.exists() else ""
        pytest.fail(f"not done 60 s after SIGINT; its output: {out!r} {err[-2000:]!r}; "
                    f"the agent's log ends: {agent_log}")
    assert p.returncode == 7, (out, err)
    assert "interrupted untouched" in out and "then put" in out


def test_ctrl_c_withdraws_a_broadcast_puts_quorum_join(testbed, pod_a, run_in):
    """A broadcast put waiting for a quorum that never fills ends at
    Ctrl-C with KeyboardInterrupt and its join leaves the round while the
    process lives on, though the connection that lent its memory stays
    open (the agent is told to withdraw it: WithdrawPut)."""
    key = unique("interrupt-put")
    group = unique("g").replace("/", "-")
    p = run_in(testbed, pod_a, textwrap.dedent(f"""
        import sys, numpy as np, kt
        try:
            kt.put("{key}", src=np.ones(16, np.float32),
                   broadcast=kt.BroadcastWindow(group_id="{group}", world_size=2, timeout=3600))
            print("finished", flush=True)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        kt.put("{key}-after", src=np.ones(4, np.float32))
        print("then put", flush=True)
        sys.stdin.readline()
        sys.exit(7)
    """), background=True)
    wait_until("joined", lambda: quorum_members(testbed, group), p)
    p.send_signal(signal.SIGINT)
    wait_until("withdrawn", lambda: not quorum_members(testbed, group), p)
    out, err = p.communicate(input="\n", timeout=60)
    assert p.returncode == 7, (out, err)
    assert "interrupted" in out and "then put" in out, (out, err)


def written_settles(pid: int, quiet: float = 0.3, timeout: float = 30) -> None:
    """Waits until process ``pid`` has written no data for ``quiet`` seconds
    (what the kernel had buffered from the stopped producer has landed).
    Data is 64 KiB or more: the runtime's own wake-ups write a few bytes."""
    deadline = time.monotonic() + timeout
    last, since = written(pid), time.monotonic()
    while time.monotonic() - since < quiet:
        assert time.monotonic() < deadline, "the getter kept writing"
        time.sleep(0.05)
        now = written(pid)
        if now - last >= 64 << 10:
            last, since = now, time.monotonic()


def test_ctrl_c_stops_a_transfer_and_removes_its_partial_file(testbed, pod_a, run_in,
                                                             tmp_path):
    """A get whose producer stops answering mid-file ends at Ctrl-C; the
    partial file goes with it and nothing half-written is left."""
    key = unique("interrupt")
    producer = testbed.pod("interrupt-producer")
    prep = run_in(testbed, producer, f"""
        import os, kt
        d = {str(tmp_path / 'big')!r}
        os.makedirs(d)
        with open(os.path.join(d, "blob"), "wb") as f:
            f.truncate(1 << 30)
        kt.put("{key}", src=d, locale="local")
    """)
    assert prep.returncode == 0, prep.stderr
    dest = tmp_path / "copy"
    # Only the signal may end the get: its stall timeout (20 s by default)
    # could pass first on a busy machine while the producer is stopped.
    p = run_in(testbed, pod_a, textwrap.dedent(f"""
        import os, sys
        os.environ["KT_STALL_TIMEOUT"] = "10m"
        import kt
        try:
            kt.get("{key}", dest={str(dest)!r})
            print("finished", flush=True)
        except KeyboardInterrupt:
            # Cleaned up by the time the exception is raised.
            print("interrupted", os.listdir({str(dest)!r}), flush=True)
            sys.exit(7)
    """), background=True)

    def partial():
        return [n for n in os.listdir(dest) if n.startswith(".kt-tmp.")] if dest.exists() else []

    # The get has found its source and bytes from it are landing: its
    # partial file is there and it has written 4 MiB more than at its start
    # (on a busy machine that may take a while; nothing is timed).
    started = written(p.pid)
    wait_until("receiving", lambda: p.poll() is not None
               or (partial() and written(p.pid) - started >= 4 << 20), p)
    # The producer's agent stops mid-file: the get waits for bytes that do
    # not come (its stall timeout, 10 min here, is not reached), until the signal.
    os.kill(producer.agent.proc.pid, signal.SIGSTOP)
    try:
        if p.poll() is not None or not partial():
            p.kill()
            out, err = p.communicate(timeout=60)
            pytest.skip(f"the 1 GiB get ended before the producer stopped: {out} {err}")
        written_settles(p.pid)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        os.kill(producer.agent.proc.pid, signal.SIGCONT)
    assert p.returncode == 7, (out, err)
    assert out.strip() == "interrupted []", "the partial file was removed and no blob was cut"
    assert os.listdir(dest) == []
