"""Files and trees from Python: put, get, ls, rm, teardown, prefix gets,
mirror gets, zero-copy local puts served peer to peer."""

from __future__ import annotations

import datetime
import os
import pathlib

import pytest

from loopback import unique


def write(root: pathlib.Path, files: dict) -> pathlib.Path:
    for rel, body in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(body if isinstance(body, bytes) else body.encode())
    return root


def listing(root: pathlib.Path) -> list:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_a_tree_round_trips_and_an_unchanged_put_moves_nothing(testbed, pod_a, kt_in, tmp_path):
    kt = kt_in(pod_a)
    key = unique("tree")
    src = write(tmp_path / "src", {"a.txt": "alpha", "d/b.bin": os.urandom(300_000), "e": ""})
    r = kt.put(key, src=src)
    assert isinstance(r, kt.PutResult)
    assert (r.key, r.files, r.locale, r.unchanged) == (key, 3, "store", False)
    assert r.bytes_sent == 5 + 300_000
    again = kt.put(key, src=str(src))
    assert again.unchanged and again.bytes_sent == 0
    got = kt.get(key, dest=tmp_path / "dest")
    assert isinstance(got, kt.GetResult)
    assert got.files == 3 and got.bytes_sent == 5 + 300_000
    assert listing(tmp_path / "dest") == listing(src)
    assert (tmp_path / "dest/d/b.bin").read_bytes() == (src / "d/b.bin").read_bytes()


def test_a_single_file_lands_under_its_path_or_its_name(testbed, pod_a, kt_in, tmp_path):
    kt = kt_in(pod_a)
    key = unique("file")
    f = tmp_path / "config.json"
    f.write_text('{"a": 1}')
    kt.put(key, src=f, ttl=3600)
    kt.get(key, dest=tmp_path / "copy.json")
    assert (tmp_path / "copy.json").read_text() == '{"a": 1}'
    (tmp_path / "into").mkdir()
    kt.get(key, dest=str(tmp_path / "into"))
    assert (tmp_path / "into/config.json").read_text() == '{"a": 1}'


def test_ls_items_say_what_they_are(testbed, pod_a, kt_in, tmp_path):
    kt = kt_in(pod_a)
    prefix = unique("ls")
    write(tmp_path / "t", {"x": "12345"})
    kt.put(f"{prefix}/models/v1", src=tmp_path / "t")
    kt.put(f"{prefix}/weights", src=tmp_path / "t/x", lifespan="resource", service="tests")
    items = {i.name: i for i in kt.ls(prefix)}
    assert set(items) == {"models", "weights"}
    assert items["models"].is_directory and items["models"].locale is None
    w = items["weights"]
    assert (w.key, w.locale, w.size, w.is_directory) == (f"{prefix}/weights", "store", 5, False)
    assert isinstance(w.modified, datetime.datetime)
    assert w.modified.tzinfo is not None
    assert (w.is_key, w.lifespan, w.service, w.holder, w.files) == (True, "resource", "tests",
                                                                     "store", 1)
    assert w.created is not None and w.created <= w.modified and w.expires is None
    assert not w.tensors and w.version
    v1 = kt.ls(f"{prefix}/models")
    assert [(i.name, i.is_directory) for i in v1] == [("v1", True)]


def test_rm_and_teardown(testbed, pod_a, kt_in, tmp_path):
    kt = kt_in(pod_a)
    prefix = unique("rm")
    write(tmp_path / "t", {"x": "1"})
    kt.put(f"{prefix}/a", src=tmp_path / "t")
    kt.put(f"{prefix}/b/c", src=tmp_path / "t")
    assert kt.rm(f"{prefix}/a") == [f"{prefix}/a"]
    with pytest.raises(TypeError):
        kt.rm(f"{prefix}/b", recursive="yes")  # type: ignore[arg-type]
    assert kt.rm(f"{prefix}", recursive=True) == [f"{prefix}/b/c"]
    assert kt.ls(prefix) == []
    service = unique("svc").replace("/", "-")
    kt.put(f"{prefix}/tmp", src=tmp_path / "t", lifespan="resource", service=service)
    gone = kt.teardown(service)
    assert isinstance(gone, kt.TeardownResult)
    assert gone.deleted == [f"{prefix}/tmp"]
    with pytest.raises(kt.NotFound):
        kt.get(f"{prefix}/tmp", dest=tmp_path / "none")


def test_a_prefix_get_fetches_shards_of_four_producers(testbed, kt_in, run_in, tmp_path):
    prefix = unique("train")
    for i in range(4):
        pod = testbed.pod(f"proc-{i}")
        r = run_in(testbed, pod, f"""
            import pathlib, kt
            d = pathlib.Path({str(pod.dir)!r}) / "shard-{i}"
            d.mkdir()
            (d / "data.parquet").write_bytes(bytes([{i}]) * 1000)
            r = kt.put("{prefix}/shard-{i}", src=d, locale="local")
            assert r.locale == "local" and r.bytes_sent == 0, r
        """)
        assert r.returncode == 0, r.stderr
    kt = kt_in(testbed.pod("trainer"))
    got = kt.get(f"/{prefix}/", dest=tmp_path / "train")
    assert isinstance(got, kt.GetResult)
    assert [g.key for g in got.gets] == [f"{prefix}/shard-{i}" for i in range(4)]
    assert got.files == 4 and got.bytes_sent == sum(g.bytes_sent for g in got.gets) == 4000
    assert got.gets[2].dest == str(tmp_path / "train/shard-2")
    for i in range(4):
        assert (tmp_path / f"train/shard-{i}/data.parquet").read_bytes() == bytes([i]) * 1000
    with pytest.raises(kt.NotFound):
        kt.get(f"{prefix}/nothing/", dest=tmp_path / "none")


def test_a_mirror_get_makes_the_destination_exactly_the_key(testbed, pod_a, kt_in, tmp_path):
    kt = kt_in(pod_a)
    key = unique("mirror")
    src = write(tmp_path / "src", {"keep.txt": "k", "old/gone.txt": "g"})
    kt.put(key, src=src)
    dest = tmp_path / "dest"
    kt.get(key, dest=dest)
    (src / "old/gone.txt").unlink()
    (src / "old").rmdir()
    (src / "new.txt").write_text("n")
    kt.put(key, src=src)
    (dest / "mine.txt").write_text("local")
    kt.get(key, dest=dest)
    assert listing(dest) == ["keep.txt", "mine.txt", "new.txt", "old", "old/gone.txt"]
    kt.get(key, dest=dest, delete=True)
    assert listing(dest) == ["keep.txt", "new.txt"]


def test_a_local_put_is_served_peer_to_peer_to_another_pod(testbed, kt_in, run_in, tmp_path):
    producer = testbed.pod("producer")
    key = unique("p2p")
    r = run_in(testbed, producer, f"""
        import pathlib, kt
        d = pathlib.Path({str(producer.dir)!r}) / "features"
        (d / "sub").mkdir(parents=True)
        (d / "sub/f.bin").write_bytes(b"x" * 70000)
        print(kt.put("{key}", src=d, locale="local").version)
    """)
    assert r.returncode == 0, r.stderr
    kt = kt_in(testbed.pod("consumer"))
    got = kt.get(key, dest=tmp_path / "features")
    assert got.bytes_sent == 70000
    assert (tmp_path / "features/sub/f.bin").read_bytes() == b"x" * 70000
    rec = [i for i in kt.ls(key.rsplit("/", 1)[0]) if i.key == key][0]
    assert rec.locale == rec.holder == "producer"  # the pod, as the reference's ls says


def test_a_file_broadcast_places_every_getter_in_one_tree(testbed, kt_in, run_in, tmp_path):
    key = unique("bcast")
    kt = kt_in(testbed.pod("bc-producer"))
    write(tmp_path / "src", {"w.bin": os.urandom(200_000)})
    kt.put(key, src=tmp_path / "src")
    group = unique("group").replace("/", "-")
    procs = []
    for i in range(3):
        pod = testbed.pod(f"bc-{i}")
        procs.append(run_in(testbed, pod, f"""
            import kt
            w = kt.BroadcastWindow(group_id="{group}", timeout=30, fanout=1)
            r = kt.get("{key}", dest={str(pod.dir / 'w')!r}, broadcast=w)
            print(r.rank, r.parents[0])
        """, background=True))
    seen = set()
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        rank, parent = map(int, out.split())
        assert parent == rank - 1  # fanout 1: a chain below the origin
        seen.add(rank)
    assert seen == {1, 2, 3}
    for i in range(3):
        got = (testbed.pod(f"bc-{i}").dir / "w/w.bin").read_bytes()
        assert got == (tmp_path / "src/w.bin").read_bytes()
