"""``kt.Dataset``: one training rank's share of the files below a prefix,
streamed file by file as each arrives, complete and verified::

    import kt

    ds = kt.Dataset("svc/train/", rank=2, world=8, epoch=3, shuffle=True,
                    budget=4 << 30, format="path")
    for path in ds:                 # a pathlib.Path, valid until the next one
        train_on(path)
        checkpoint["data"] = ds.position

    # Resume where the checkpoint left off:
    ds = kt.Dataset("svc/train/", rank=2, world=8, epoch=3, shuffle=True,
                    start=checkpoint["data"])

The split is by bytes and the same on every rank (no rank talks to another):
together the ranks read every file exactly once. Files are fetched ahead, in
reading order, while the bytes held locally (fetched ahead plus the one in
use) fit ``budget``; a file larger than the budget is fetched alone. A file
is deleted once the iteration moves past it. Sources as for any get: peers
first, then the store, failing over mid-stream.

``format``: ``"path"`` (the local file), ``"bytes"`` (its contents; the file
is gone at once) or ``"arrow"`` (``pyarrow.RecordBatch`` es of Parquet and
Arrow IPC files; needs the ``pyarrow`` package). :func:`to_numpy` and
:func:`to_torch` turn a batch's fixed-width columns into arrays.
"""

from __future__ import annotations

import importlib
import os
import pathlib
from typing import Any, Dict, Iterator, List, Literal, Optional, Tuple, Union

from . import _kt
from .errors import InvalidInput

__all__ = ["Dataset", "Format", "to_numpy", "to_torch", "get_shard"]

Format = Literal["path", "bytes", "arrow"]
"""What :class:`Dataset` yields per file: its local path, its bytes, or its
Arrow record batches."""

DEFAULT_BUDGET = 1 << 30
"""Bytes a :class:`Dataset` holds locally unless told otherwise (1 GiB)."""

_PARQUET_MAGIC = b"PAR1"
_ARROW_FILE_MAGIC = b"ARROW1"
_ARROW_STREAM_CONTINUATION = b"\xff\xff\xff\xff"


def _pyarrow(what: str) -> Any:
    """The ``pyarrow`` module, or an ImportError that names the package."""
    try:
        return importlib.import_module("pyarrow")
    except ImportError as e:
        raise ImportError(
            f"kt: {what} needs the pyarrow package (pip install pyarrow)") from e


def _check_int(name: str, value: Any, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"kt: {name}: an int, not {type(value).__name__}")
    if value < least:
        raise InvalidInput(f"{name}: at least {least}, not {value}")
    return value


class Dataset:
    """Rank ``rank`` of ``world``'s share of the files below ``prefix``,
    streamed (see the module documentation). Iterate it for the files (each
    iteration starts a fresh stream from ``start``); :attr:`position` is the
    index of the next file in the ordered share, for a checkpoint."""

    def __init__(self, prefix: str, *, rank: int = 0, world: int = 1, epoch: int = 0,
                 shuffle: bool = False, budget: int = DEFAULT_BUDGET, start: int = 0,
                 format: Format = "path", ahead: int = 4,
                 dir: Union[str, "os.PathLike[str]", None] = None,
                 timeout: Optional[float] = None) -> None:
        if not isinstance(prefix, str):
            raise TypeError(f"kt: prefix: a str, not {type(prefix).__name__}")
        self.prefix = prefix if prefix.endswith("/") else prefix + "/"
        self.world = _check_int("world", world, 1)
        self.rank = _check_int("rank", rank, 0)
        if self.rank >= self.world:
            raise InvalidInput(f"rank: {rank} is not below the world size {world}")
        self.epoch = _check_int("epoch", epoch, 0)
        if not isinstance(shuffle, bool):
            raise TypeError(f"kt: shuffle: a bool, not {type(shuffle).__name__}")
        self.shuffle = shuffle
        self.budget = _check_int("budget", budget, 1)
        self.start = _check_int("start", start, 0)
        self.ahead = _check_int("ahead", ahead, 1)
        if format not in ("path", "bytes", "arrow"):
            raise InvalidInput(f"format: {format!r} is not one of path, bytes, arrow")
        if format == "arrow":
            _pyarrow('kt.Dataset(format="arrow")')
        self.format: Format = format
        self.dir = None if dir is None else os.fspath(dir)
        self.timeout = timeout
        self._position = self.start
        self._stream: Optional[_kt.ShareStream] = None
        # A stream opened (to list the share) that no iteration used yet.
        self._fresh = False
        self._peak = 0

    def _open(self) -> _kt.ShareStream:
        if self._fresh and self._stream is not None:
            self._fresh = False
            return self._stream
        self.close()
        s = _kt.ShareStream(self.prefix[:-1], self.rank, self.world, self.epoch, self.shuffle,
                            self.budget, self.start, self.ahead, self.dir, self.timeout)
        self._stream = s
        self._position = s.position
        return s

    @property
    def position(self) -> int:
        """The index in the ordered share of the next file: pass it as
        ``start=`` to resume after the files consumed so far."""
        return self._position

    @property
    def files(self) -> List[Tuple[str, int]]:
        """``(path below the prefix, size)`` of this rank's files, in
        reading order (lists the dataset if no iteration did yet)."""
        if self._stream is None:
            self._open()
            self._fresh = True
        assert self._stream is not None
        return self._stream.share

    @property
    def peak_bytes(self) -> int:
        """The most bytes held locally at any moment of the last iteration."""
        if self._stream is not None:
            self._peak = max(self._peak, self._stream.held()[1])
        return self._peak

    def close(self) -> None:
        """Stops the stream and deletes the files it holds."""
        s, self._stream, self._fresh = self._stream, None, False
        if s is not None:
            self._peak = max(self._peak, s.held()[1])
            s.release()

    def __enter__(self) -> "Dataset":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _files(self) -> Iterator[Tuple[str, pathlib.Path, _kt.ShareStream]]:
        s = self._open()
        try:
            while True:
                got = s.next_file()
                if got is None:
                    return
                _, name, local, _ = got
                yield name, pathlib.Path(local), s
        finally:
            self._peak = max(self._peak, s.held()[1])
            s.release()

    def __iter__(self) -> Iterator[Any]:
        # The position counts a file consumed once it is handed out (for
        # "arrow": once its last batch is): a checkpoint taken after the
        # step that used it resumes after it.
        if self.format == "path":
            for _, path, s in self._files():
                self._position = s.position
                yield path
        elif self.format == "bytes":
            for _, path, s in self._files():
                data = path.read_bytes()
                s.release()
                self._position = s.position
                yield data
        else:
            for name, path, s in self._files():
                batches = _batches(name, path)
                batch = next(batches, None)
                while batch is not None:
                    after = next(batches, None)
                    if after is None:
                        self._position = s.position
                    yield batch
                    batch = after


def _batches(name: str, path: pathlib.Path) -> Iterator[Any]:
    """The record batches of a Parquet or Arrow IPC (file or stream) file,
    read incrementally."""
    pa = _pyarrow('kt.Dataset(format="arrow")')
    with open(path, "rb") as f:
        head = f.read(8)
    if head[:4] == _PARQUET_MAGIC:
        pq = importlib.import_module("pyarrow.parquet")
        yield from pq.ParquetFile(str(path)).iter_batches()
    elif head[:6] == _ARROW_FILE_MAGIC:
        with pa.memory_map(str(path)) as src:
            reader = pa.ipc.open_file(src)
            for i in range(reader.num_record_batches):
                yield reader.get_batch(i)
    elif head[:4] == _ARROW_STREAM_CONTINUATION or len(head) >= 8:
        # An IPC stream (older writers leave out the continuation marker).
        try:
            with pa.OSFile(str(path), "rb") as src:
                yield from pa.ipc.open_stream(src)
        except pa.ArrowInvalid as e:
            raise InvalidInput(
                f"{name}: neither Parquet nor Arrow IPC, format=\"arrow\" cannot read it: {e}"
            ) from e
    else:
        raise InvalidInput(f"{name}: empty or too short for Parquet or Arrow IPC")


def _fixed_width(batch: Any) -> Dict[str, Any]:
    pa = _pyarrow("kt.to_numpy")
    out: Dict[str, Any] = {}
    bad = []
    for name, col in zip(batch.schema.names, batch.columns):
        t = col.type
        if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t) \
                or pa.types.is_temporal(t):
            out[name] = col.to_numpy(zero_copy_only=False)
        else:
            bad.append(f"{name} ({t})")
    if bad:
        raise InvalidInput("not fixed-width columns (select the others first): "
                           + ", ".join(bad))
    return out


def to_numpy(batch: Any) -> Dict[str, Any]:
    """A ``pyarrow.RecordBatch``'s columns as numpy arrays, by name (without
    a copy where a column has no nulls). Every column must be fixed-width
    (integers, floats, booleans, times); others are refused, named."""
    return _fixed_width(batch)


def to_torch(batch: Any) -> Dict[str, Any]:
    """:func:`to_numpy`, as ``torch.Tensor`` s (sharing the arrays' memory
    where numpy's is writable; copied otherwise)."""
    try:
        torch = importlib.import_module("torch")
    except ImportError as e:
        raise ImportError("kt: to_torch needs the torch package") from e
    out: Dict[str, Any] = {}
    for name, a in _fixed_width(batch).items():
        out[name] = torch.from_numpy(a if a.flags.writeable else a.copy())
    return out


def get_shard(prefix: str, dest: Union[str, "os.PathLike[str]"], *, rank: int, world: int,
              epoch: int = 0, shuffle: bool = False,
              timeout: Optional[float] = None) -> List[Tuple[str, str, int]]:
    """Fetches rank ``rank`` of ``world``'s share of the files below
    ``prefix`` into ``dest/<path below the prefix>`` at once (as ``kt get
    PREFIX/ --shard RANK/WORLD``): ``(path below the prefix, local path,
    size)`` per file, in reading order."""
    if not isinstance(prefix, str):
        raise TypeError(f"kt: prefix: a str, not {type(prefix).__name__}")
    _check_int("world", world, 1)
    _check_int("rank", rank, 0)
    _check_int("epoch", epoch, 0)
    return _kt.get_share(prefix.rstrip("/"), os.fspath(dest), rank, world, epoch, shuffle,
                         timeout)
