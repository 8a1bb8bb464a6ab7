"""Tensors and state dicts from Python: lent to the pod's agent, received
in place, peer to peer and through a quorum across processes; numpy
always, torch (CPU) when it is installed."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from loopback import unique

HOLD = """
import json, sys, numpy as np, kt
{setup}
r = kt.put("{key}", {arg}=src{extra})
print(json.dumps({{"version": r.version, "tensors": r.tensors}}), flush=True)
sys.stdin.readline()   # lent while this process lives
"""


def holder(testbed, run_in, pod, key, setup, extra="", arg="src"):
    """A process of ``pod`` that puts ``src`` under ``key`` (as the argument
    ``arg``) and holds it."""
    p = run_in(testbed, pod, HOLD.format(setup=setup, key=key, extra=extra, arg=arg),
               background=True)
    line = p.stdout.readline()
    if not line:
        raise AssertionError(f"the holder failed: {p.stderr.read()}")
    return p, json.loads(line)


def release(p):
    p.stdin.write("\n")
    p.stdin.flush()
    p.wait(30)


STATE = """
rng = np.random.default_rng(7)
src = {"layer0.weight": rng.standard_normal((64, 32), dtype=np.float32),
       "layer0.bias": np.arange(32, dtype=np.float16),
       "steps": np.array([12345], dtype=np.int64)}
"""


def expected():
    rng = np.random.default_rng(7)
    return {"layer0.weight": rng.standard_normal((64, 32), dtype=np.float32),
            "layer0.bias": np.arange(32, dtype=np.float16),
            "steps": np.array([12345], dtype=np.int64)}


def test_a_state_dict_is_got_in_place_peer_to_peer(testbed, kt_in, run_in):
    key = unique("sd")
    p, put = holder(testbed, run_in, testbed.pod("trainer"), key, STATE)
    try:
        assert put["tensors"] == 3
        kt = kt_in(testbed.pod("worker"))
        want = expected()
        # Ordinary arrays (through one copy) and shared memory (none).
        plain = {k: np.zeros_like(v) for k, v in want.items()}
        r = kt.get(key, dest=plain)
        assert isinstance(r, kt.TensorResult)
        assert r.tensors == 3 and r.bytes == sum(v.nbytes for v in want.values())
        for k in want:
            np.testing.assert_array_equal(plain[k], want[k])
        shm = {k: kt.empty(v.shape, v.dtype) for k, v in want.items()}
        kt.get(key, dest=shm)
        for k in want:
            np.testing.assert_array_equal(shm[k], want[k])
        # One tensor of it is not the state dict's layout: refused, naming both.
        wrong = dict(plain)
        wrong["layer0.weight"] = np.zeros((64, 16), dtype=np.float32)
        with pytest.raises(kt.InvalidInput) as e:
            kt.get(key, dest=wrong)
        assert "f32[64, 32]" in str(e.value) and "f32[64, 16]" in str(e.value)
    finally:
        release(p)


def test_a_single_tensor_and_shared_memory_puts_move_without_copies(testbed, kt_in, run_in,
                                                                   monkeypatch):
    key = unique("one")
    setup = """
src = kt.empty((256, 256), "float32")
src[:] = np.arange(256 * 256, dtype=np.float32).reshape(256, 256)
"""
    # data=: the reference's name for a put's tensor.
    p, put = holder(testbed, run_in, testbed.pod("trainer"), key, setup, arg="data")
    try:
        kt = kt_in(testbed.pod("worker"))
        dest = kt.empty((256, 256), "float32")
        flat = kt.empty(256 * 256, "float32").reshape(256, 256)
        # Destinations in shared memory are lent as they are: no copy.
        copies = []
        monkeypatch.setattr(kt._memory, "allocate", copies.append)
        r = kt.get(key, dest=dest)
        assert r.tensors == 1 and r.bytes == 256 * 256 * 4
        np.testing.assert_array_equal(dest.ravel(), np.arange(256 * 256, dtype=np.float32))
        # A 1-D view of shared memory: still shared memory.
        kt.get(key, dest=flat)
        assert flat[255, 255] == 256 * 256 - 1
        assert copies == []
    finally:
        release(p)


def test_lent_memory_is_kept_until_its_key_is_deleted(testbed, run_in):
    """kt holds what it lent until rm or a teardown deleted the key (a
    failed rm keeps it), and a forked child makes its own connections."""
    service = unique("held").replace("/", "-")
    p = run_in(testbed, testbed.pod("held"), f"""
        import os, numpy as np, kt
        a, b = "{service}/a", "{service}/b"
        kt.put(a, src=np.ones(8, np.float32), lifespan="resource")
        kt.put(b, src=np.ones(8, np.float32), lifespan="resource")
        assert set(kt._held) == {{a, b}}
        kt.configure(token="not-the-token")
        try:
            kt.rm(a)
            raise AssertionError("rm with a wrong token")
        except kt.Unauthorized:
            pass
        assert set(kt._held) == {{a, b}}, "a failed rm lets go of nothing"
        kt.configure()
        assert kt.rm(a) == [a] and set(kt._held) == {{b}}
        pid = os.fork()
        if pid == 0:
            # The child's first call makes its own runtime and connections.
            names = [i.name for i in kt.ls("{service}")]
            dest = np.zeros(8, np.float32)
            kt.get(b, dest=dest)
            os._exit(0 if names == ["b"] and (dest == 1).all() else 3)
        assert os.waitpid(pid, 0)[1] == 0
        assert kt.teardown("{service}").deleted == [b]
        assert kt._held == {{}}
        print("ok")
    """)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "ok"


def test_a_quorum_across_processes_broadcasts_one_state_dict(testbed, run_in):
    """One putter and three getters in four pods, closed by world_size."""
    key = unique("quorum")
    group = unique("g").replace("/", "-")
    window = f'kt.BroadcastWindow(group_id="{group}", world_size=4, timeout=60, pack=True)'
    putter = run_in(testbed, testbed.pod("q-put"), "import json, numpy as np, kt\n" + STATE
                    + f"r = kt.put('{key}', src=src, broadcast={window})\n"
                    + "print(json.dumps({'rank': r.rank, 'world': r.world}))\n",
                    background=True)
    getters = []
    for i in range(3):
        getters.append(run_in(testbed, testbed.pod(f"q-get-{i}"), f"""
            import json, numpy as np, kt
            dest = {{"layer0.weight": np.zeros((64, 32), np.float32),
                     "layer0.bias": np.zeros(32, np.float16),
                     "steps": np.zeros(1, np.int64)}}
            r = kt.get("{key}", dest=dest, broadcast={window})
            rng = np.random.default_rng(7)
            assert (dest["layer0.weight"] == rng.standard_normal((64, 32), dtype=np.float32)).all()
            assert (dest["steps"] == 12345).all()
            print(json.dumps({{"rank": r.rank, "world": r.world, "bytes": r.bytes}}))
        """, background=True))
    ranks = []
    for p in [putter, *getters]:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        r = json.loads(out)
        assert r["world"] == 4
        ranks.append(r["rank"])
    assert sorted(ranks) == [0, 1, 2, 3]
    assert ranks[0] == 0  # putters rank first


def test_torch_cpu_tensors_when_torch_is_installed(testbed, kt_in, run_in):
    torch = pytest.importorskip("torch")
    key = unique("torch")
    setup = """
import torch
src = {"w": torch.arange(1024, dtype=torch.bfloat16).reshape(32, 32), "b": torch.ones(7)}
"""
    p, _ = holder(testbed, run_in, testbed.pod("trainer"), key, setup)
    try:
        kt = kt_in(testbed.pod("worker"))
        dest = {"w": torch.zeros(32, 32, dtype=torch.bfloat16), "b": torch.zeros(7)}
        kt.get(key, dest=dest)
        assert torch.equal(dest["w"], torch.arange(1024, dtype=torch.bfloat16).reshape(32, 32))
        assert torch.equal(dest["b"], torch.ones(7))
        zero_copy = {"w": kt.empty((32, 32), torch.bfloat16, framework="torch"),
                     "b": kt.empty(7, "float32", framework="torch")}
        kt.get(key, dest=zero_copy)
        assert torch.equal(zero_copy["b"], torch.ones(7))
    finally:
        release(p)


CUDA_STATE = """
import torch
src = {"w": torch.arange(4096, dtype=torch.float32, device="cuda").reshape(64, 64),
       "b": torch.ones(7, dtype=torch.bfloat16, device="cuda")}
"""


def cuda_torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device (torch.cuda.is_available() is False)")
    return torch


def test_torch_cuda_tensors_through_ipc_handles_on_a_gpu(testbed, kt_in, run_in):
    """CUDA tensors are lent by IPC handle and received in place on the
    device (GPU runners: .github/workflows/gpu.yml makes this run)."""
    torch = cuda_torch()
    key = unique("cuda")
    p, put = holder(testbed, run_in, testbed.pod("trainer"), key, CUDA_STATE)
    try:
        assert put["tensors"] == 2
        kt = kt_in(testbed.pod("worker"))
        dest = {"w": torch.zeros(64, 64, device="cuda"),
                "b": torch.zeros(7, dtype=torch.bfloat16, device="cuda")}
        kt.get(key, dest=dest)
        torch.cuda.synchronize()
        assert torch.equal(dest["w"].cpu(), torch.arange(4096, dtype=torch.float32).reshape(64, 64))
        assert torch.equal(dest["b"].cpu(), torch.ones(7, dtype=torch.bfloat16))
        # A training loop's gets into the same memory: the agent keeps it
        # opened between them (keep_mapped), and they stay correct.
        for _ in range(2):
            dest["w"].zero_()
            torch.cuda.synchronize()
            r = kt.get(key, dest=dest, keep_mapped=True)
            torch.cuda.synchronize()
            assert r.tensors == 2
            assert torch.equal(dest["w"].cpu(),
                               torch.arange(4096, dtype=torch.float32).reshape(64, 64))
    finally:
        release(p)


def test_put_takes_src_or_data_as_the_reference_names_it():
    import kt
    with pytest.raises(TypeError, match="not both"):
        kt.put("k", src="/tmp", data={})
    with pytest.raises(TypeError, match="needs src"):
        kt.put("k")
    with pytest.raises(TypeError, match="a path goes in src"):
        kt.put("k", data="/tmp")


def test_keep_mapped_must_be_a_bool():
    import kt
    with pytest.raises(TypeError, match="keep_mapped"):
        kt.get("k", dest={}, keep_mapped="yes")


def test_a_cuda_quorum_across_processes_on_a_gpu(testbed, run_in):
    """One putter and two getters of CUDA tensors in one quorum (NCCL)."""
    cuda_torch()
    key = unique("cuda-quorum")
    group = unique("g").replace("/", "-")
    window = f'kt.BroadcastWindow(group_id="{group}", world_size=3, timeout=120)'
    putter = run_in(testbed, testbed.pod("cq-put"), "import json, kt\n" + CUDA_STATE
                    + f"r = kt.put('{key}', src=src, broadcast={window})\n"
                    + "print(json.dumps({'rank': r.rank, 'backend': r.backend}))\n",
                    background=True)
    getters = [run_in(testbed, testbed.pod(f"cq-get-{i}"), f"""
            import json, torch, kt
            dest = {{"w": torch.zeros(64, 64, device="cuda"),
                     "b": torch.zeros(7, dtype=torch.bfloat16, device="cuda")}}
            r = kt.get("{key}", dest=dest, broadcast={window})
            torch.cuda.synchronize()
            assert torch.equal(dest["w"].cpu(), torch.arange(4096.).reshape(64, 64))
            print(json.dumps({{"rank": r.rank, "backend": r.backend}}))
        """, background=True) for i in range(2)]
    ranks = []
    for p in [putter, *getters]:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
        ranks.append(json.loads(out)["rank"])
    assert sorted(ranks) == [0, 1, 2]


def test_two_pods_of_four_processes_put_one_key_and_getters_take_all_or_a_sum(testbed, run_in):
    """The reference's multi-party broadcast: 8 putters of one key (2 pods x
    4 processes, each its own rank) and getters in a third pod asking for
    every putter's tensor (a list, in putter-rank order; a dict by rank) or
    their sum, in one quorum. Each putter's tensor is its pid plus 0..15."""
    key = unique("gradients")
    group = unique("sync").replace("/", "-")
    window = f'kt.BroadcastWindow(group_id="{group}", world_size=11, timeout=60)'
    putters = []
    for pod in ("mp-a", "mp-b"):
        for _ in range(4):
            putters.append(run_in(testbed, testbed.pod(pod), f"""
                import json, os, numpy as np, kt
                src = np.arange(16, dtype=np.float64) + os.getpid()
                r = kt.put("{key}", src=src, broadcast={window})
                print(json.dumps({{"pid": os.getpid(), "rank": r.rank, "world": r.world}}))
            """, background=True))
    gets = {
        "all": "dest = [np.zeros(16) for _ in range(8)]\n"
               f"r = kt.get('{key}', dest=dest, broadcast={window})\n"
               "out = [float(d[0]) for d in dest]",
        "some": "dest = {1: np.zeros(16), 6: np.zeros(16)}\n"
                f"r = kt.get('{key}', dest=dest, broadcast={window})\n"
                "out = {str(k): float(v[0]) for k, v in dest.items()}",
        "sum": "dest = np.zeros(16)\n"
               f"r = kt.get('{key}', dest=dest, broadcast={window}, reduce='sum')\n"
               "out = [float(x) for x in dest]",
    }
    getters = {name: run_in(testbed, testbed.pod("mp-get"),
                            "import json, numpy as np, kt\n" + body
                            + "\nprint(json.dumps({'out': out, 'world': r.world}))\n",
                            background=True)
               for name, body in gets.items()}
    pids = {}
    for p in putters:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        r = json.loads(out)
        assert r["world"] == 11
        pids[r["rank"]] = r["pid"]
    assert sorted(pids) == list(range(8))
    got = {}
    for name, p in getters.items():
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        got[name] = json.loads(out)["out"]
    assert got["all"] == [float(pids[r]) for r in range(8)]
    assert got["some"] == {"1": float(pids[1]), "6": float(pids[6])}
    assert got["sum"] == [float(i * 8 + sum(pids.values())) for i in range(16)]


def test_a_region_freed_while_its_lock_is_held_does_not_deadlock(tmp_path):
    # A garbage collection can run a region's finalizer in the thread that
    # holds kt._memory's lock (inside locate or allocate): the finalizer
    # must not wait for that lock (it would wait for itself forever).
    import threading

    import kt._memory as m

    path = tmp_path / "region"
    path.write_bytes(b"x")
    start = 1 << 40
    with m._lock:
        m._regions[start] = (1, str(path))

    def in_a_thread_holding_the_lock() -> None:
        with m._lock:
            m._forget(start, str(path), os.getpid())

    t = threading.Thread(target=in_a_thread_holding_the_lock, daemon=True)
    t.start()
    t.join(timeout=30)
    assert not t.is_alive(), "_forget waited for the lock its own thread holds"
    assert not path.exists()
    # The region is dropped by the next look-up, not left behind.
    assert m.locate(start, 1) is None
    assert start not in m._regions
