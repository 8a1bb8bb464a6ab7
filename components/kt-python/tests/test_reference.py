"""The reference guide's examples (``examples.py``), each pod's part run in
one of the loopback testbed's pods from its own working directory: the
quick start, quick file transfers, point to point (``locale="local"``
shards and a prefix get into ``.``), scalable file broadcast and
state dicts."""

from __future__ import annotations

import os
import pathlib
import subprocess
from typing import Any, List

from loopback import Pod, Testbed, in_pod


def run(testbed: Testbed, pod: Pod, call: str, cwd: pathlib.Path) -> str:
    """Runs ``examples.<call>`` in ``pod`` from ``cwd``; its stdout."""
    cwd.mkdir(parents=True, exist_ok=True)
    r = in_pod(testbed, pod, f"import examples\nprint(repr(examples.{call}))", cwd=cwd)
    assert r.returncode == 0, f"{call} in {pod.name}: {r.stderr}"
    return str(r.stdout)


def start(testbed: Testbed, pod: Pod, call: str, cwd: pathlib.Path) -> "subprocess.Popen[str]":
    """Starts ``examples.<call>`` in ``pod``, in the background."""
    cwd.mkdir(parents=True, exist_ok=True)
    p: subprocess.Popen[str] = in_pod(testbed, pod,
                                      f"import examples\nprint(repr(examples.{call}))",
                                      cwd=cwd, background=True)
    return p


def finish(p: "subprocess.Popen[str]", what: str) -> str:
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, f"{what}: {err}"
    return out


def write(path: pathlib.Path, body: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(body)


def test_quick_start(testbed: Testbed, tmp_path: pathlib.Path) -> None:
    laptop = testbed.pod("laptop")
    model = os.urandom(100_000)
    write(tmp_path / "laptop/trained_model/model.bin", model)
    write(tmp_path / "laptop/trained_model/config.json", b"{}")
    write(tmp_path / "old/ckpt.bin", b"old")
    run(testbed, laptop, f"kt.put('my-service/old-checkpoint/step-1', "
                         f"src={str(tmp_path / 'old')!r})", tmp_path / "laptop")
    out = run(testbed, laptop, "quick_start()", tmp_path / "laptop")
    assert (tmp_path / "laptop/local_model/model.bin").read_bytes() == model
    assert "name='weights'" in out and "name='old-checkpoint'" in out
    assert run(testbed, laptop, "kt.ls('my-service')", tmp_path / "laptop").count("Item(") == 1


def test_quick_file_transfers(testbed: Testbed, tmp_path: pathlib.Path) -> None:
    pod = testbed.pod("train-0")
    write(tmp_path / "laptop/dataset.csv", b"a,b\n1,2\n")
    run(testbed, pod, "kt.put('/my_train_svc/my_toy_dataset', src='dataset.csv')",
        tmp_path / "laptop")
    write(tmp_path / "train/training.profile", b"profile")
    run(testbed, pod, "quick_file_transfers()", tmp_path / "train")
    assert (tmp_path / "train/dataset.csv").read_bytes() == b"a,b\n1,2\n"
    run(testbed, pod, "kt.get('/my_train_svc/train_profile', dest='back.profile')",
        tmp_path / "train")
    assert (tmp_path / "train/back.profile").read_bytes() == b"profile"


def test_point_to_point_shards_and_a_prefix_get(testbed: Testbed) -> None:
    shards: List[bytes] = []
    for rank in range(3):
        pod = testbed.pod(f"data-proc-{rank}")
        shards.append(os.urandom(10_000 + rank))
        write(pod.dir / "work/data_out.parquet", shards[rank])
        run(testbed, pod, f"publish_shard({rank})", pod.dir / "work")
    trainer = testbed.pod("trainer-p2p")
    run(testbed, trainer, "fetch_shards()", trainer.dir / "work")
    for rank in range(3):
        got = trainer.dir / f"work/data_shard_{rank}"
        assert got.read_bytes() == shards[rank], rank

    producer = testbed.pod("features-producer")
    write(producer.dir / "data/features/f.bin", b"f" * 5000)
    run(testbed, producer, f"publish_features({str(producer.dir / 'data/features')!r})",
        producer.dir)
    consumer = testbed.pod("features-consumer")
    out = run(testbed, consumer,
              f"consume_features({str(consumer.dir / 'local/features')!r})", consumer.dir)
    assert "bytes_sent=5000" in out
    assert (consumer.dir / "local/features/f.bin").read_bytes() == b"f" * 5000


def test_scalable_file_broadcast(testbed: Testbed) -> None:
    producer = testbed.pod("shard-producer")
    payload = os.urandom(300_000)
    write(producer.dir / "data/shard/part-0", payload)
    run(testbed, producer, f"broadcast_producer({str(producer.dir / 'data/shard')!r})",
        producer.dir)
    consumers = [testbed.pod(f"shard-consumer-{i}") for i in range(3)]
    procs = [start(testbed, c, f"broadcast_consumer({str(c.dir / 'local/shard')!r})",
                   c.dir) for c in consumers]
    for c, p in zip(consumers, procs):
        finish(p, c.name)
        assert (c.dir / "local/shard/part-0").read_bytes() == payload

    origin = testbed.pod("weights-producer")
    write(origin.dir / "checkpoints/w.bin", payload[:1000])
    run(testbed, origin, f"weights_producer({str(origin.dir / 'checkpoints')!r})", origin.dir)
    getters = [testbed.pod(f"weights-consumer-{i}") for i in range(2)]
    outs = [finish(start(testbed, g, f"weights_consumer({str(g.dir / 'local/model')!r})",
                         g.dir), g.name) for g in getters]
    assert all("group='weight-distribution'" in o for o in outs), outs
    for g in getters:
        assert (g.dir / "local/model/w.bin").read_bytes() == payload[:1000]


def test_state_dicts_and_tensors(testbed: Testbed) -> None:
    trainer = testbed.pod("sd-trainer")
    producers: List[Any] = []
    try:
        for call in ("checkpoint_trainer()", "tensor_producer()"):
            p = start(testbed, trainer, call, trainer.dir)
            producers.append(p)
            assert p.stdout is not None and p.stderr is not None
            line = p.stdout.readline()
            assert line == "put\n", (line, p.stderr.read() if p.poll() is not None else "")
        inference = testbed.pod("sd-inference")
        run(testbed, inference, "checkpoint_inference()", inference.dir)
        run(testbed, inference, "tensor_consumer()", inference.dir)
    finally:
        for p in producers:
            if p.poll() is None:
                p.communicate("done\n", timeout=60)


def test_coordinated_multi_party_broadcast(testbed: Testbed) -> None:
    """5. As written: eight pods' processes join group "training-sync"
    (world_size=8): one putter pod, seven getter processes on two pods (a
    pod's processes each take their own rank). Several putters of one key
    is the README's extension (getters then ask for all of them or a
    reduction): test_tensors.py runs it."""
    code = ("import examples, numpy as np\n"
            "src = np.arange(4096, dtype=np.float32)\n")
    putter = in_pod(testbed, testbed.pod("mp-putter"),
                    code + "r = examples.multi_party_putter(src)\nprint(r.world)",
                    background=True)
    getter_code = (code + "dest = np.zeros(4096, dtype=np.float32)\n"
                   "r = examples.multi_party_getter(dest)\n"
                   "assert (dest == src).all()\nprint(r.world)")
    getters = [in_pod(testbed, testbed.pod(f"mp-getter-{i % 2}"), getter_code, background=True)
               for i in range(7)]
    outs = [finish(p, f"getter {i}") for i, p in enumerate(getters)]
    outs.append(finish(putter, "putter"))
    assert [o.strip() for o in outs] == ["8"] * 8, outs


def test_lifespans_delete_what_the_reference_deletes(testbed: Testbed,
                                                     tmp_path: pathlib.Path) -> None:
    """Lifespan management: tearing my-service down deletes its base path
    (`my-service/temp`, resource; `my-service/keep`, no lifespan given) and
    its pod's zero-copy key, and keeps `models/final` (cluster)."""
    pod = testbed.pod("my-service-0", service="my-service")
    work = tmp_path / "my-service"
    write(work / "checkpoint.pt", b"weights")
    write(work / "logs/train.log", b"step 1")
    run(testbed, pod, "lifespans()", work)
    run(testbed, pod, "kt.put(key='my-service/keep', src='./logs/')", work)
    run(testbed, pod, "kt.put(key='features/my-service-cache', src='./logs/', locale='local')",
        work)
    laptop = testbed.pod("laptop")
    out = run(testbed, laptop, "kt.teardown('my-service')", tmp_path / "laptop")
    for gone in ("my-service/temp", "my-service/keep", "features/my-service-cache"):
        assert repr(gone) in out, (gone, out)
    assert "models/final" not in out, out
    listed = run(testbed, laptop, "kt.ls('models')", tmp_path / "laptop")
    assert "name='final'" in listed, listed
    for key in ("my-service/keep", "features/my-service-cache"):
        r = in_pod(testbed, laptop, f"import kt\ntry:\n    kt.get({key!r}, dest='x')\n"
                                    "except kt.NotFound as e:\n    print('gone', e)",
                   cwd=tmp_path / "laptop")
        assert r.returncode == 0 and r.stdout.startswith("gone"), (key, r.stdout, r.stderr)
