"""The package as a Python user meets it: imports without numpy, logs to
`logging`, reports progress, honours `timeout=`, raises errors in Python's
words and classes, and checks argument types."""

from __future__ import annotations

import datetime
import logging
import os
import pathlib
import socket
import subprocess
import sys
import textwrap

import pytest

from loopback import unique


def test_import_kt_does_not_import_numpy():
    code = textwrap.dedent("""
        import sys, kt
        kt.BroadcastWindow(timeout=30.0)
        assert "numpy" not in sys.modules, "numpy imported"
        assert "kt._tensors" not in sys.modules and "kt._memory" not in sys.modules
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_files_move_without_numpy(testbed, pod_a, run_in, tmp_path):
    src = tmp_path / "f.txt"
    src.write_text("x")
    key = unique("nonumpy")
    r = run_in(testbed, pod_a, f"""
        import sys, kt
        kt.put({key!r}, src={str(src)!r})
        kt.get({key!r}, dest={str(tmp_path / 'g.txt')!r})
        kt.ls("py")
        assert "numpy" not in sys.modules, "numpy imported"
    """)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "g.txt").read_text() == "x"


def test_the_broadcast_window_checks_types_and_values():
    import kt
    with pytest.raises(TypeError, match="world_size must be an int, not str"):
        kt.BroadcastWindow(world_size="4")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="timeout must be seconds"):
        kt.BroadcastWindow(timeout="30")  # type: ignore[arg-type]
    with pytest.raises(kt.InvalidInput, match="fanout: at least 1, not 0"):
        kt.BroadcastWindow(fanout=0)
    w = kt.BroadcastWindow(group_id="g", timeout=30.0, fanout=50)
    with pytest.raises(AttributeError):
        w.fanout = 2  # type: ignore[misc]


def test_errors_are_python_exceptions_too():
    import kt
    assert issubclass(kt.Forbidden, PermissionError) and issubclass(kt.Forbidden, kt.KtError)
    assert not issubclass(kt.Forbidden, kt.Unauthorized)
    assert not issubclass(kt.Unauthorized, kt.Forbidden)
    assert issubclass(kt.NotFound, LookupError) and issubclass(kt.NotFound, FileNotFoundError)
    assert issubclass(kt.Timeout, TimeoutError) and issubclass(kt.Timeout, kt.Unavailable)
    assert issubclass(kt.FileExists, FileExistsError)
    e = kt.NotFound("key a not found", "not_found")
    assert str(e) == "key a not found" and e.code == "not_found"


def test_messages_speak_python(testbed, pod_a, kt_in, tmp_path):
    kt = kt_in(pod_a)
    prefix = unique("words")
    (tmp_path / "f").write_text("x")
    kt.put(f"{prefix}/a/b", src=tmp_path / "f")
    with pytest.raises(kt.KtError) as e:
        kt.rm(f"{prefix}/a")
    assert "recursive=True" in str(e.value) and "-r)" not in str(e.value)


def test_a_file_in_the_way_is_file_exists(testbed, pod_a, kt_in, tmp_path):
    kt = kt_in(pod_a)
    key = unique("exists")
    (tmp_path / "src/sub").mkdir(parents=True)
    (tmp_path / "src/sub/f").write_text("x")
    kt.put(key, src=tmp_path / "src")
    (tmp_path / "dest").write_text("a file where the key's tree goes")
    with pytest.raises(FileExistsError) as e:
        kt.get(key, dest=tmp_path / "dest")
    assert isinstance(e.value, kt.FileExists) and "dest" in str(e.value)
    assert (tmp_path / "dest").read_text() == "a file where the key's tree goes"


def test_kt_logs_to_the_logger_kt(testbed, pod_a, kt_in, caplog, tmp_path):
    kt = kt_in(pod_a)
    caplog.set_level(logging.WARNING, logger="kt")
    kt.ls("py")
    assert [r for r in caplog.records if r.name.startswith("kt")] == []
    caplog.set_level(logging.DEBUG, logger="kt")
    kt.ls("py")
    done = [r for r in caplog.records if r.name == "kt.python" and "kt.ls" in r.getMessage()]
    assert done and done[0].levelno == logging.DEBUG, caplog.records
    # kt-client's own events, under their component's logger.
    key = unique("logged")
    (tmp_path / "src").mkdir()
    (tmp_path / "src/f").write_text("x")
    kt.put(key, src=tmp_path / "src")
    (tmp_path / "dest").mkdir()
    (tmp_path / "dest/extra").write_text("not the key's")
    kt.get(key, dest=tmp_path / "dest", delete=True)
    pruned = [r for r in caplog.records if r.name == "kt.client.download"
              and "mirror get: pruned" in r.getMessage()]
    assert pruned and "removed=1" in pruned[0].getMessage(), caplog.records


def test_progress_reaches_the_callback(testbed, pod_a, kt_in, tmp_path):
    kt = kt_in(pod_a)
    key = unique("progress")
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        (src / f"f{i}").write_bytes(os.urandom(100_000))
    seen = []
    r = kt.put(key, src=src, progress=seen.append)
    assert seen and all(isinstance(p, kt.Progress) for p in seen)
    last = seen[-1]
    assert last.finished and last.bytes_done == last.bytes_total == r.bytes_sent == 300_000
    assert last.files_total == 3
    got = []
    kt.get(key, dest=tmp_path / "dest", progress=got.append)
    assert got[-1].finished and got[-1].bytes_done == 300_000


def test_a_progress_callback_that_raises_stops_the_transfer(testbed, pod_a, kt_in, tmp_path):
    kt = kt_in(pod_a)
    (tmp_path / "src").mkdir()
    (tmp_path / "src/f").write_bytes(os.urandom(50_000))

    def stop(p):
        raise KeyError("enough")

    with pytest.raises(KeyError, match="enough"):
        kt.put(unique("raises"), src=tmp_path / "src", progress=stop)


def test_verbose_off_a_terminal_prints_plain_progress_lines(testbed, pod_a, run_in, tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src/f").write_bytes(os.urandom(200_000))
    key = unique("verbose")
    r = run_in(testbed, pod_a, f"""
        import kt
        kt.put({key!r}, src={str(tmp_path / 'src')!r}, verbose=True)
    """)
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    assert any("200000 of 200000 bytes (100%), 1 files, done" in ln for ln in lines), lines
    assert any(ln.startswith(f"kt: put {key}: 1 files") for ln in lines), lines


def test_a_call_past_its_timeout_raises_timeout(testbed, kt_in, pod_a, monkeypatch):
    kt = kt_in(pod_a)
    # A server that takes connections and never answers.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    try:
        kt.configure(metadata_url=f"http://127.0.0.1:{silent.getsockname()[1]}",
                     token=testbed.token)
        with pytest.raises(kt.Timeout) as e:
            kt.ls("py", timeout=datetime.timedelta(milliseconds=300))
        assert isinstance(e.value, TimeoutError) and e.value.code == "unavailable"
        assert "ls of py timed out after 300ms" in str(e.value), str(e.value)
        with pytest.raises(kt.InvalidInput, match="timeout: seconds > 0"):
            kt.ls("py", timeout=0)
        with pytest.raises(TypeError, match="timeout must be seconds"):
            kt.ls("py", timeout="1s")  # type: ignore[arg-type]
    finally:
        silent.close()


def test_settings_are_a_record(testbed, pod_a, kt_in, monkeypatch):
    kt = kt_in(pod_a)
    # The agent names its shared-memory directory: KT_SHM_DIR is not needed.
    monkeypatch.setenv("KT_SHM_DIR", "/nonexistent")
    kt.configure(deadline=45)
    s = kt.settings()
    assert isinstance(s, kt.Settings)
    assert s.metadata_url == testbed.metadata.url and s.deadline == 45.0 and not s.kube
    assert s.shm_dir == str(pod_a.shm), "the agent's own directory"


def test_outside_the_cluster_what_needs_an_agent_is_refused(testbed, pod_a, tmp_path,
                                                            monkeypatch):
    import kt
    monkeypatch.setenv("KT_KUBE", "maybe")
    with pytest.raises(kt.InvalidInput, match="KT_KUBE"):
        kt.configure()
    # An API server that is not there: said so, naming kube.
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(textwrap.dedent(f"""
        apiVersion: v1
        kind: Config
        clusters: [{{name: c, cluster: {{server: "http://127.0.0.1:{free_port()}"}}}}]
        users: [{{name: u, user: {{token: t}}}}]
        contexts: [{{name: ctx, context: {{cluster: c, user: u, namespace: kt}}}}]
        current-context: ctx
    """))
    monkeypatch.delenv("KT_TOKEN", raising=False)
    with pytest.raises(kt.Unavailable, match="kube"):
        kt.configure(kube=True, kubeconfig=kubeconfig)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port
