"""Arrow Flight interop: a node agent started with ``--flight-addr`` answers
``DoGet`` for a ticket naming (prefix, rank, world, epoch, shuffle), and a
plain ``pyarrow.flight`` client — a child process that never imports kt —
streams its rank's share of 64 Parquet shards as record batches.

What rank 2 of 4 should get is computed here independently of kt (a
re-implementation of kt_types::shard's byte-balanced split and its
SplitMix64 shuffle) from the files as written, and compared row for row.
The servers run with a tokens file: the caller's token decides what is
read, and tokens of another service, of nobody, or of a role that may not
read are refused.
"""

from __future__ import annotations

import json
import os
import pathlib
import secrets
import subprocess
import sys
import textwrap
from typing import Dict, List, Tuple

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from loopback import BIN, Testbed, _listening, _wait_for

TRAIN = "train-" + secrets.token_hex(12)
OTHER = "other-" + secrets.token_hex(12)
METRICS = "metrics-" + secrets.token_hex(12)
WORLD = 4
RANK = 2


@pytest.fixture(scope="module")
def flight(tmp_path_factory):
    """A testbed whose servers know a ``train`` and an ``other`` workload
    token, one pod whose agent serves Flight, and the dataset: 32
    single-file keys and a directory key of 32 files (and a ``_SUCCESS``)."""
    root = tmp_path_factory.mktemp("flight")
    tb = Testbed(root / "tb", grants=[
        {"token": TRAIN, "role": "workload", "services": ["train"], "reads": []},
        {"token": OTHER, "role": "workload", "services": ["other"], "reads": []},
        {"token": METRICS, "role": "metrics"},
    ])
    try:
        # A pod's agent names its Flight scratch (it refuses a default in a
        # pod: its state directory is too small there).
        scratch = tb.root / "pods" / "flight-pod" / ".kt-agent" / "flight"
        pod = tb.pod("flight-pod", service="train", args=["--flight-addr", "127.0.0.1:0",
                                                          "--flight-budget", "64KiB",
                                                          "--flight-dir", str(scratch)])
        addr = _wait_for("the agent's Flight server",
                         lambda: _listening(pod.dir / "agent.log", "flight listening"))
        url = addr.replace("http://", "grpc://")
        prefix = f"train/flight-{secrets.token_hex(4)}"
        data = root / "data"
        files = write_shards(data)
        kt = [str(BIN / "kt")]
        env = {**os.environ, "KT_METADATA_URL": tb.metadata.url, "KT_TOKEN": TRAIN,
               "KT_AGENT_AUTOSTART": "0"}
        env.pop("KT_POD_IP", None)
        for name in sorted(os.listdir(data)):
            if name.startswith("shard-"):
                subprocess.run([*kt, "put", f"{prefix}/{name}", "--src", str(data / name)],
                               env=env, check=True, capture_output=True, timeout=60)
        subprocess.run([*kt, "put", f"{prefix}/part-b", "--src", str(data / "part-b")],
                       env=env, check=True, capture_output=True, timeout=60)
        yield tb, url, prefix, files, data
    finally:
        tb.stop()


def write_shards(data: pathlib.Path) -> List[Tuple[str, int]]:
    """64 Parquet files of uneven sizes (several row groups each), half as
    single files, half in ``part-b/`` with a ``_SUCCESS`` marker; each row
    says which shard it came from. Returns (path below the prefix, size)."""
    (data / "part-b").mkdir(parents=True)
    for i in range(64):
        rows = 50 + (i * 997) % 1500
        table = pa.table({
            "shard": pa.array([i] * rows, pa.int32()),
            "row": pa.array(range(rows), pa.int64()),
            "value": pa.array([(i * 31 + r) / 7 for r in range(rows)], pa.float64()),
            "label": pa.array([f"s{i}-r{r}" for r in range(rows)], pa.string()),
        })
        name = f"shard-{i:02}.parquet" if i < 32 else f"part-b/shard-{i:02}.parquet"
        pq.write_table(table, data / name, row_group_size=400)
    (data / "part-b" / "_SUCCESS").write_bytes(b"")
    files = [(str(p.relative_to(data)), p.stat().st_size)
             for p in data.rglob("*") if p.is_file()]
    return sorted(files)


# kt_types::shard, re-implemented: largest file first to the rank with the
# fewest bytes (ties: lower rank; equal sizes by path), each share by path;
# with shuffle, a SplitMix64 Fisher-Yates per (epoch, rank).
M64 = (1 << 64) - 1


def assign(files: List[Tuple[str, int]], world: int) -> List[List[int]]:
    order = sorted(range(len(files)), key=lambda i: (-files[i][1], files[i][0], i))
    loads = [0] * world
    ranks: List[List[int]] = [[] for _ in range(world)]
    for i in order:
        r = min(range(world), key=lambda r: (loads[r], r))
        loads[r] += files[i][1]
        ranks[r].append(i)
    for share in ranks:
        share.sort(key=lambda i: (files[i][0], i))
    return ranks


def share(files: List[Tuple[str, int]], rank: int, world: int, epoch: int = 0,
          shuffle: bool = False) -> List[str]:
    mine = assign(files, world)[rank]
    if shuffle:
        rotl = lambda x, k: ((x << k) | (x >> (64 - k))) & M64  # noqa: E731
        state = (rotl((epoch * 0x9E3779B97F4A7C15) & M64, 17)
                 ^ ((rank * 0xD1B54A32D192ED03) & M64) ^ 0x6A09E667F3BCC908)
        for i in range(len(mine) - 1, 0, -1):
            state = (state + 0x9E3779B97F4A7C15) & M64
            z = state
            z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
            z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
            z ^= z >> 31
            j = (z * (i + 1)) >> 64
            mine[i], mine[j] = mine[j], mine[i]
    return [files[i][0] for i in mine]


def expected(data: pathlib.Path, paths: List[str]) -> pa.Table:
    """The share's rows as pyarrow reads its files, data files only."""
    tables = [pq.read_table(data / p) for p in paths
              if not any(s.startswith(("_", ".")) for s in p.split("/"))]
    return pa.concat_tables(tables).replace_schema_metadata(None)


# The Flight client: a child process with pyarrow alone. Each request is
# (token, ticket bytes); each answer the table it read (an IPC file) and its
# batch count, or the error's pyarrow class and message.
CLIENT = textwrap.dedent("""
    import json, sys
    import pyarrow as pa
    import pyarrow.flight as fl

    url, requests, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    client = fl.FlightClient(url)
    answers = []
    for n, (token, ticket) in enumerate(requests):
        headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
        try:
            reader = client.do_get(fl.Ticket(ticket.encode()),
                                   fl.FlightCallOptions(headers=headers, timeout=120))
            batches = [chunk.data for chunk in reader]
            table = pa.Table.from_batches(batches, schema=reader.schema)
            path = f"{out}/{n}.arrow"
            with pa.OSFile(path, "wb") as f, pa.ipc.new_file(f, table.schema) as w:
                w.write_table(table)
            answers.append({"table": path, "batches": len(batches)})
        except Exception as e:
            answers.append({"error": type(e).__name__, "message": str(e)})
    assert "kt" not in sys.modules, "the Flight client imported kt"
    print(json.dumps(answers))
""")


def do_get(url: str, out: pathlib.Path, requests: List[Tuple[str, str]]) -> List[Dict]:
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KT_")}
    r = subprocess.run([sys.executable, "-c", CLIENT, url, json.dumps(requests), str(out)],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr
    answers: List[Dict] = json.loads(r.stdout)
    for a in answers:
        if "table" in a:
            with pa.OSFile(a["table"], "rb") as f:
                a["table"] = pa.ipc.open_file(f).read_all()
    return answers


def ticket(prefix: str, rank: int, world: int = WORLD, **more) -> str:
    return json.dumps({"prefix": prefix, "rank": rank, "world": world, **more})


def test_a_plain_pyarrow_flight_client_reads_exactly_its_share(flight, tmp_path):
    tb, url, prefix, files, data = flight
    assert len([f for f in files if f[0].endswith(".parquet")]) == 64
    requests = [(TRAIN, ticket(prefix + "/", r)) for r in range(WORLD)]
    requests.append((TRAIN, ticket(prefix, RANK, epoch=3, shuffle=True)))
    answers = do_get(url, tmp_path / "out", requests)
    for a in answers:
        assert "error" not in a, a
    got = answers[RANK]["table"]
    want = expected(data, share(files, RANK, WORLD))
    assert got.schema == want.schema, (got.schema, want.schema)
    assert not got.schema.metadata
    assert got.equals(want), "rank 2 of 4 got other rows than its share"
    assert answers[RANK]["batches"] >= len(set(got.column("shard").to_pylist()))
    # The shares are disjoint, balanced by bytes, and together the dataset.
    seen = [sorted(set(a["table"].column("shard").to_pylist())) for a in answers[:WORLD]]
    assert sorted(s for ranks in seen for s in ranks) == list(range(64))
    for rank in range(WORLD):
        assert answers[rank]["table"].equals(expected(data, share(files, rank, WORLD)))
    # Shuffled for epoch 3: the same rows, in that epoch's order of files.
    shuffled = answers[WORLD]["table"]
    order = share(files, RANK, WORLD, epoch=3, shuffle=True)
    assert order != share(files, RANK, WORLD)
    assert shuffled.equals(expected(data, order))


def test_tickets_and_tokens_are_checked(flight, tmp_path):
    tb, url, prefix, files, data = flight
    answers = do_get(url, tmp_path / "out", [
        (TRAIN, ticket(prefix, 4)),                      # rank out of range
        (TRAIN, '{"prefix": "' + prefix + '", "rank": 1}'),  # no world
        (TRAIN, "rank 2 of 4"),
        (TRAIN, ticket("train/../x", 0)),
        (OTHER, ticket(prefix, RANK)),                   # another service's token
        ("not-a-token-anyone-knows", ticket(prefix, RANK)),
        ("", ticket(prefix, RANK)),                      # no token at all
        (METRICS, ticket(prefix, RANK)),                 # a role that may not read
        (TRAIN, ticket(prefix + "-missing", RANK)),
    ])
    invalid = answers[:4]
    for a, says in zip(invalid, ["rank 4 is not below the world size 4", "world",
                                 "is not JSON", "relative segments"]):
        assert a.get("error") == "ArrowInvalid" and says in a["message"], a
    # Another service's keys are not listed for its token: the share is
    # not found, as for `kt get PREFIX/`, and nothing is read.
    other = answers[4]
    assert other.get("error") == "ArrowKeyError" and "no keys below" in other["message"], other
    for a in answers[5:7]:
        assert a.get("error") == "FlightUnauthenticatedError", a
    assert "send the header `authorization: Bearer <token>`" in answers[6]["message"], answers[6]
    assert answers[7].get("error") == "FlightUnauthorizedError", answers[7]
    assert answers[8].get("error") == "ArrowKeyError", answers[8]
    # Every call's temporary files are gone.
    scratch = tb.pods["flight-pod"].dir / ".kt-agent" / "flight"
    assert scratch.is_dir() and not any(scratch.iterdir())
