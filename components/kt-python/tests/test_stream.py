"""kt.Dataset: 4 ranks stream disjoint shares of 64 Parquet shards the test
makes, as paths, bytes and Arrow record batches; resuming from a position;
kt.get_shard; to_numpy; the errors."""

from __future__ import annotations

import pathlib

import pytest

from loopback import unique

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

ROWS = 100


def shards(kt, tmp_path: pathlib.Path, n: int = 64) -> tuple:
    """`n` Parquet shards below a fresh prefix, of different sizes; returns
    the prefix and each shard's ids by its name."""
    prefix = unique("shards")
    src = tmp_path / "src"
    src.mkdir()
    ids = {}
    for i in range(n):
        rows = ROWS + 37 * (i % 5)
        first = i * 1000
        table = pa.table({
            "id": pa.array(range(first, first + rows), pa.int64()),
            "x": pa.array([float(v) / 3 for v in range(rows)], pa.float32()),
            "name": pa.array([f"row-{v}" for v in range(rows)]),
        })
        name = f"part-{i:03}.parquet"
        pq.write_table(table, src / name, row_group_size=64)
        kt.put(f"{prefix}/{name}", src=src / name)
        ids[name] = list(range(first, first + rows))
    return prefix, ids, src


def test_four_ranks_read_disjoint_shares_whose_union_is_the_dataset(pod_a, kt_in, tmp_path):
    kt = kt_in(pod_a)
    prefix, ids, src = shards(kt, tmp_path)
    seen: dict = {}
    rows = []
    for rank in range(4):
        ds = kt.Dataset(prefix + "/", rank=rank, world=4, budget=64 << 10, format="path")
        names = [name for name, _ in ds.files]
        got = []
        for path in ds:
            assert path.read_bytes() == (src / path.name).read_bytes()
            got.append(path.name)
        assert got == names
        assert ds.position == len(names)
        assert ds.peak_bytes <= 64 << 10
        for name in got:
            seen[name] = seen.get(name, 0) + 1
        for batch in kt.Dataset(prefix, rank=rank, world=4, format="arrow"):
            assert isinstance(batch, pa.RecordBatch)
            rows.extend(batch.column("id").to_pylist())
    assert set(seen) == set(ids) and set(seen.values()) == {1}
    assert sorted(rows) == sorted(v for vs in ids.values() for v in vs)


def test_bytes_resume_and_get_shard(pod_a, kt_in, tmp_path):
    kt = kt_in(pod_a)
    prefix, ids, src = shards(kt, tmp_path, n=12)
    ds = kt.Dataset(prefix, rank=1, world=2, epoch=5, shuffle=True, format="bytes")
    order = [name for name, _ in ds.files]
    it = iter(ds)
    first = [next(it), next(it), next(it)]
    assert ds.position == 3
    assert first == [(src / n).read_bytes() for n in order[:3]]
    ds.close()
    rest = list(kt.Dataset(prefix, rank=1, world=2, epoch=5, shuffle=True, format="bytes",
                           start=3))
    assert first + rest == [(src / n).read_bytes() for n in order]
    got = kt.get_shard(prefix + "/", tmp_path / "dest", rank=1, world=2, epoch=5, shuffle=True)
    assert [p for p, _, _ in got] == order
    for path, local, size in got:
        assert pathlib.Path(local).read_bytes() == (src / path).read_bytes()
        assert size == (src / path).stat().st_size


def test_to_numpy_takes_fixed_width_columns_and_names_the_others(pod_a, kt_in, tmp_path):
    kt = kt_in(pod_a)
    prefix, ids, _ = shards(kt, tmp_path, n=2)
    batch = next(iter(kt.Dataset(prefix, format="arrow")))
    cols = kt.to_numpy(batch.select(["id", "x"]))
    assert list(cols["id"]) == ids["part-000.parquet"][: len(cols["id"])]
    assert cols["x"].dtype.name == "float32"
    with pytest.raises(kt.InvalidInput, match="name"):
        kt.to_numpy(batch)


def test_bad_arguments_are_refused_clearly(pod_a, kt_in, tmp_path):
    kt = kt_in(pod_a)
    with pytest.raises(kt.InvalidInput, match="not below the world size"):
        kt.Dataset("a/b/", rank=4, world=4)
    with pytest.raises(kt.InvalidInput, match="format"):
        kt.Dataset("a/b/", format="csv")  # type: ignore[arg-type]
    with pytest.raises(kt.NotFound):
        list(kt.Dataset(unique("nothing") + "/"))
    # A file that is not Parquet nor Arrow, read as arrow: named.
    prefix = unique("text")
    (tmp_path / "t.txt").write_text("just some text, not arrow")
    kt.put(f"{prefix}/t.txt", src=tmp_path / "t.txt")
    with pytest.raises(kt.InvalidInput, match="t.txt"):
        list(kt.Dataset(prefix, format="arrow"))
