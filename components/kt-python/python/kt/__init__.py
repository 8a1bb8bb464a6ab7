"""kt: an in-cluster data store for Kubernetes, from Python.

Files and directory trees, tensors and state dicts, under hierarchical
keys::

    import kt

    kt.put("team/dataset/v1", src="./dataset/")            # a tree, into the store
    kt.put("features/batch-1", src="/data/features/", locale="local")  # zero copy, p2p
    kt.get("team/dataset/v1", dest="./copy/")
    kt.get("data_proc_svc/train/", dest=".")                # every key below the prefix
    items = kt.ls("team")
    kt.rm("team/dataset/v1")

    kt.put("checkpoint/epoch-10", src=model.state_dict())   # tensors: lent, not copied
    kt.get("checkpoint/epoch-10", dest=dest_state_dict)     # filled in place

Settings come from the same environment variables as the ``kt`` CLI
(``KT_METADATA_URL``, ``KT_TOKEN`` or ``KT_TOKEN_FILE``, ``KT_AGENT_SOCKET``,
``KT_STREAMS``) or :func:`configure`. Every call releases the GIL while it
waits and stops on Ctrl-C; errors are :class:`KtError` subclasses.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

from . import _kt
from . import _tensors
from ._memory import allocate as _allocate
from .errors import Conflict, InvalidInput, KtError, NotFound, Unauthorized, Unavailable

__all__ = [
    "put", "get", "ls", "rm", "teardown", "drop", "configure", "settings", "empty",
    "BroadcastWindow", "Item", "PutResult", "GetResult", "TensorResult",
    "KtError", "NotFound", "Unauthorized", "Unavailable", "InvalidInput", "Conflict",
]

__version__ = "0.1.0"

PathLike = Union[str, "os.PathLike[str]"]

_LOCALES = ("store", "local")
_LIFESPANS = ("cluster", "resource")


@dataclass
class BroadcastWindow:
    """A broadcast: many getters of one key at once.

    Files (``kt.get(..., broadcast=w)``): getters form a tree as they
    arrive, each fetching from its parent while the parent is still
    downloading. ``group_id`` names the group (unique per run; default the
    key's open group), ``fanout`` its children per node (default: by the payload's size, a
    pipelined chain from 64 MiB on, else 50),
    ``timeout`` how long it accepts joins (seconds). The group's first
    getter fixes them.

    Tensors (``kt.put``/``kt.get`` of tensors with ``broadcast=w``): a
    quorum of putters and getters moves the data in one coordinated
    transfer once it closes: on ``world_size`` members, on every pod of
    ``ips`` having joined, or on ``timeout``, whichever comes first.
    ``pack`` sends a state dict's tensors of one dtype as one buffer;
    ``fanout`` is the host backend's tree (default 2).
    """

    group_id: Optional[str] = None
    world_size: Optional[int] = None
    ips: Sequence[str] = field(default_factory=list)
    timeout: Optional[float] = None
    fanout: Optional[int] = None
    pack: bool = False

    def _check(self) -> None:
        if self.group_id is not None and (not isinstance(self.group_id, str) or not self.group_id):
            raise InvalidInput("broadcast.group_id: a non-empty string", "invalid_request")
        if self.world_size is not None and (not isinstance(self.world_size, int)
                                            or self.world_size < 2):
            raise InvalidInput(f"broadcast.world_size: at least 2, not {self.world_size!r}",
                               "invalid_request")
        if self.timeout is not None and (not isinstance(self.timeout, (int, float))
                                         or self.timeout <= 0):
            raise InvalidInput(f"broadcast.timeout: seconds > 0, not {self.timeout!r}",
                               "invalid_request")
        if self.fanout is not None and (not isinstance(self.fanout, int) or self.fanout < 1):
            raise InvalidInput(f"broadcast.fanout: at least 1, not {self.fanout!r}",
                               "invalid_request")
        if isinstance(self.ips, str) or not all(isinstance(i, str) for i in self.ips):
            raise InvalidInput("broadcast.ips: a list of IP addresses", "invalid_request")

    def _json(self, tensors: bool) -> str:
        self._check()
        if not tensors and (self.world_size is not None or self.ips or self.pack):
            raise InvalidInput(
                "broadcast: world_size, ips and pack are for tensors (a quorum); a file "
                "broadcast's tree forms as getters arrive (group_id, fanout, timeout)",
                "invalid_request")
        window: Dict[str, Any] = {"pack": bool(self.pack), "ips": list(self.ips)}
        if self.group_id is not None:
            window["group_id"] = self.group_id
        if self.world_size is not None:
            window["world_size"] = self.world_size
        if self.timeout is not None:
            window["timeout_secs"] = float(self.timeout)
        if self.fanout is not None:
            window["fanout"] = self.fanout
        elif tensors:
            window["fanout"] = 2
        return json.dumps(window)


@dataclass
class PutResult:
    """What a put of files did."""

    key: str
    files: int
    bytes_sent: int
    bytes_skipped: int
    unchanged: bool
    locale: str
    version: Optional[str]
    seconds: float


@dataclass
class GetResult:
    """What a get of files did; ``group``, ``rank`` and ``parents`` (the
    ranks fetched from, in order) when it was a broadcast."""

    key: str
    dest: str
    files: int
    bytes_sent: int
    bytes_skipped: int
    seconds: float
    group: Optional[str] = None
    rank: Optional[int] = None
    parents: List[int] = field(default_factory=list)


@dataclass
class TensorResult:
    """What a put or get of tensors moved: ``rank`` and ``world`` when a
    broadcast (quorum) moved them."""

    key: str
    tensors: int
    bytes: int
    seconds: float
    backend: Optional[str] = None
    rank: Optional[int] = None
    world: Optional[int] = None
    version: Optional[str] = None


@dataclass
class Item:
    """One name of a listing (:func:`ls`)."""

    name: str
    key: str
    is_directory: bool
    locale: Optional[str] = None
    size: Optional[int] = None
    modified: Optional[datetime.datetime] = None
    record: Optional[Dict[str, Any]] = None


def configure(metadata_url: Optional[str] = None, token: Optional[str] = None,
              token_file: Optional[PathLike] = None, agent_socket: Optional[PathLike] = None,
              streams: Optional[int] = None) -> None:
    """Sets how this process reaches kt. What is left out comes from the
    environment (``KT_METADATA_URL``, ``KT_TOKEN``/``KT_TOKEN_FILE``,
    ``KT_AGENT_SOCKET``, ``KT_STREAMS``), as for the CLI. Calls after this
    one use the new settings; tensors already lent stay lent through the
    old agent connection while this process lives. Without a call, the
    environment is read on first use."""
    if streams is not None and (not isinstance(streams, int) or streams < 1):
        raise InvalidInput(f"streams: at least 1, not {streams!r}", "invalid_request")
    _kt.configure(metadata_url, token,
                  os.fspath(token_file) if token_file is not None else None,
                  os.fspath(agent_socket) if agent_socket is not None else None, streams)


def settings() -> Dict[str, Any]:
    """The settings in use: ``metadata_url``, ``agent_socket``,
    ``streams``, ``shm_dir`` (never the token)."""
    return dict(_kt.settings())


def _is_path(x: Any) -> bool:
    return isinstance(x, (str, os.PathLike))


def _key(key: Any) -> str:
    if not isinstance(key, str):
        raise TypeError(f"key must be a str, not {type(key).__name__}")
    return key


def _ttl(ttl: Any) -> Optional[str]:
    if ttl is None:
        return None
    if isinstance(ttl, bool):
        raise TypeError("ttl must be seconds (a number) or a duration such as '2h'")
    if isinstance(ttl, (int, float)):
        if ttl <= 0:
            raise InvalidInput(f"ttl: must be positive, not {ttl!r}", "invalid_request")
        return f"{max(1, int(round(ttl)))}s"
    if isinstance(ttl, datetime.timedelta):
        return _ttl(ttl.total_seconds())
    if isinstance(ttl, str):
        return ttl
    raise TypeError(f"ttl must be seconds (a number) or a duration such as '2h', "
                    f"not {type(ttl).__name__}")


def _choice(param: str, value: Any, allowed: Sequence[str]) -> str:
    if value not in allowed:
        raise InvalidInput(f"{param}: {value!r} is not one of {', '.join(allowed)}",
                           "invalid_request")
    return value


def _window(param: str, broadcast: Any) -> Optional[BroadcastWindow]:
    if broadcast is None:
        return None
    if not isinstance(broadcast, BroadcastWindow):
        raise TypeError(f"{param} must be a kt.BroadcastWindow, not {type(broadcast).__name__}")
    return broadcast


_held: Dict[str, List[Any]] = {}


def put(key: str, src: Any, *, locale: str = "store", lifespan: str = "cluster",
        ttl: Union[None, int, float, str, datetime.timedelta] = None,
        service: Optional[str] = None, broadcast: Optional[BroadcastWindow] = None,
        verbose: bool = False) -> Union[PutResult, TensorResult]:
    """Publishes ``src`` under ``key``.

    ``src`` is a path (a file or a directory tree), a tensor
    (``numpy.ndarray`` or ``torch.Tensor``) or a state dict (a mapping of
    names to tensors).

    Files: ``locale="store"`` (default) copies them into the store pod;
    ``locale="local"`` leaves them where they are, served peer to peer by
    this pod's agent (``broadcast`` then only checks the window: getters
    form the tree). Only changed files move; the key shows the old tree or
    the new one, never a mix.

    Tensors are lent to this pod's agent, not copied into the store: the key
    lives while this process does (memory from :func:`empty` and CUDA
    tensors are lent as they are; other CPU tensors through one copy into
    shared memory). With ``broadcast`` the call returns when the quorum's
    transfer is over.

    ``lifespan="resource"`` deletes the key when its ``service`` (default:
    the one service the token writes, if it writes exactly one, as a pod's
    does in a cluster; else the key's first segment) is torn down; ``ttl`` (seconds, or ``"2h"``)
    expires it.
    """
    key = _key(key)
    lifespan = _choice("lifespan", lifespan, _LIFESPANS)
    ttl_s = _ttl(ttl)
    if service is not None and not isinstance(service, str):
        raise TypeError(f"service must be a str, not {type(service).__name__}")
    window = _window("broadcast", broadcast)
    started = time.monotonic()
    if _is_path(src):
        locale = _choice("locale", locale, _LOCALES)
        if window is not None:
            window._json(tensors=False)
        r = _kt.put_path(key, os.fspath(src), locale, lifespan, ttl_s, service,
                         _bar(verbose))
        result: Union[PutResult, TensorResult] = PutResult(
            key=r["key"], files=r["files"], bytes_sent=r["bytes_sent"],
            bytes_skipped=r["bytes_skipped"], unchanged=r["unchanged"], locale=r["locale"],
            version=r["version"], seconds=r["seconds"])
    elif _tensors.is_tensor(src) or isinstance(src, Mapping):
        if locale != "store" and locale != "local":
            _choice("locale", locale, _LOCALES)
        lent = _tensors.lend("src", src, for_get=False)
        try:
            r = _kt.put_tensors(key, lent.described, lifespan, ttl_s, service,
                                window._json(tensors=True) if window else None)
        except KtError:
            raise
        except BaseException:
            # Interrupted: the agent may have registered the key all the
            # same, and uses this memory then: keep it with the key's.
            _held[key] = _held.get(key, []) + lent.keep
            raise
        # The agent maps this memory while the key lives: keep it.
        _held[key] = lent.keep
        stats = r.get("stats") or {}
        result = TensorResult(key=r["key"], tensors=r["tensors"],
                              bytes=stats.get("bytes", lent.nbytes),
                              seconds=stats.get("seconds", time.monotonic() - started),
                              backend=stats.get("backend"), rank=stats.get("rank"),
                              world=stats.get("world"), version=r["version"])
    else:
        raise TypeError(f"src must be a path (str or os.PathLike), a tensor (numpy.ndarray "
                        f"or torch.Tensor) or a dict of tensors, not {type(src).__name__}")
    _report(verbose, "put", result)
    return result


def get(key: str, dest: Any, *, broadcast: Optional[BroadcastWindow] = None,
        delete: bool = False, keep_mapped: bool = False, verbose: bool = False
        ) -> Union[GetResult, List[GetResult], TensorResult]:
    """Fetches ``key`` into ``dest``.

    Files: ``dest`` is a path. A directory key makes ``dest`` a directory
    holding the tree: files already there with the same content are kept,
    others replaced one by one (each atomically), files the key does not
    have are left alone unless ``delete=True`` (then ``dest`` becomes exactly
    the key's tree). A ``key`` ending in ``/`` fetches every key below it,
    each into ``dest/<its path below the prefix>``, a few at once (a list of
    results). ``broadcast`` joins a filesystem broadcast tree.

    Tensors: ``dest`` is a tensor or a state dict of the source's names,
    order, dtypes and shapes, filled in place (a destination that does not
    match is refused before anything moves, naming both sides); with
    ``broadcast``, through a quorum. The agent lets go of CUDA destination
    memory when the get ends; ``keep_mapped=True`` keeps it open until this
    process exits, for a loop that gets into the same tensors every step.
    """
    key = _key(key)
    window = _window("broadcast", broadcast)
    if not isinstance(delete, bool):
        raise TypeError("delete must be a bool")
    if not isinstance(keep_mapped, bool):
        raise TypeError("keep_mapped must be a bool")
    if _is_path(dest):
        out = _kt.get_path(key, os.fspath(dest), delete,
                           window._json(tensors=False) if window else None, _bar(verbose))
        if isinstance(out, list):
            results: Union[GetResult, List[GetResult], TensorResult] = [_get_result(r) for r in out]
        else:
            results = _get_result(out)
    elif _tensors.is_tensor(dest) or isinstance(dest, Mapping):
        if delete:
            raise InvalidInput("delete: for files only", "invalid_request")
        lent = _tensors.lend("dest", dest, for_get=True)
        packed = window.pack if window is not None else None
        s = _kt.get_tensors(key, lent.described,
                            window._json(tensors=True) if window else None, packed,
                            keep_mapped)
        for copy in lent.after:
            copy()
        results = TensorResult(key=key, tensors=s["tensors"], bytes=s["bytes"],
                               seconds=s["seconds"], backend=s["backend"], rank=s["rank"],
                               world=s["world"])
    else:
        raise TypeError(f"dest must be a path (str or os.PathLike), a tensor or a dict of "
                        f"tensors, not {type(dest).__name__}")
    _report(verbose, "get", results)
    return results


def _get_result(r: Dict[str, Any]) -> GetResult:
    return GetResult(key=r["key"], dest=r["dest"], files=r["files"], bytes_sent=r["bytes_sent"],
                     bytes_skipped=r["bytes_skipped"], seconds=r["seconds"],
                     group=r.get("group"), rank=r.get("rank"),
                     parents=list(r.get("parents") or []))


def ls(prefix: str = "") -> List[Item]:
    """The names directly below ``prefix``: keys and directories of keys."""
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str, not {type(prefix).__name__}")
    items = []
    for e in _kt.ls(prefix):
        record = json.loads(e["record"]) if e["record"] else None
        item = Item(name=e["name"], key=e["key"], is_directory=bool(e["has_children"]),
                    record=record)
        if record is not None:
            item.locale = record.get("locale")
            item.size = record.get("size")
            ms = record.get("updated_at_ms")
            if ms is not None:
                item.modified = datetime.datetime.fromtimestamp(ms / 1000, datetime.timezone.utc)
            item.is_directory = item.is_directory or bool(record.get("is_dir"))
        items.append(item)
    return items


def rm(key: str, recursive: bool = False) -> List[str]:
    """Deletes ``key`` (with ``recursive``, every key below it too); the keys
    deleted."""
    key = _key(key)
    if not isinstance(recursive, bool):
        raise TypeError("recursive must be a bool")
    deleted = list(_kt.rm(key, recursive))
    _release(deleted)
    return deleted


def _release(keys: List[str]) -> None:
    """Lets go of the memory lent under ``keys``, which are gone (only
    then: the agent may use the memory until its key is deleted)."""
    for k in keys:
        _held.pop(k, None)


def teardown(service: str) -> Dict[str, List[str]]:
    """Tears ``service`` down: deletes its ``lifespan="resource"`` keys and
    stops using its pods as sources. What went: ``deleted`` keys,
    ``evicted`` agents."""
    if not isinstance(service, str):
        raise TypeError(f"service must be a str, not {type(service).__name__}")
    out = dict(_kt.teardown(service))
    _release(out.get("deleted", []))
    return out


def drop(key: str) -> None:
    """Stops lending the tensors this process put under ``key`` (the key
    goes with them)."""
    key = _key(key)
    _kt.drop_tensors(key)
    _held.pop(key, None)


def empty(shape: Union[int, Sequence[int]], dtype: Any = "float32", *,
          framework: str = "numpy") -> Any:
    """A tensor in shared memory the pod's agent maps directly: put and get
    it with no copy. ``framework`` is ``"numpy"`` (an ``ndarray``) or
    ``"torch"`` (a CPU ``torch.Tensor``; ``dtype`` a torch dtype or name).
    Zero-filled."""
    dims = [shape] if isinstance(shape, int) else list(shape)
    if not all(isinstance(d, int) and d >= 0 for d in dims):
        raise InvalidInput(f"shape: non-negative ints, not {shape!r}", "invalid_request")
    count = 1
    for d in dims:
        count *= d
    if framework == "numpy":
        import numpy as np
        try:
            dt = np.dtype(dtype)
        except TypeError:
            if isinstance(dtype, str):
                raise InvalidInput(f"dtype: {dtype!r} is not a numpy dtype",
                                   "invalid_request") from None
            raise
        return _allocate(count * dt.itemsize).view(dt).reshape(dims)
    if framework == "torch":
        import torch
        if isinstance(dtype, torch.dtype):
            dt = dtype
        elif isinstance(dtype, str):
            dt = getattr(torch, dtype.removeprefix("torch."), None)
            if not isinstance(dt, torch.dtype):
                raise InvalidInput(f"dtype: {dtype!r} is not a torch dtype", "invalid_request")
        else:
            raise TypeError(f"dtype must be a torch dtype or its name, not {type(dtype).__name__}")
        size = torch.empty((), dtype=dt).element_size()
        return torch.from_numpy(_allocate(count * size)).view(dt).reshape(dims)
    raise InvalidInput(f"framework: {framework!r} is not numpy or torch", "invalid_request")


def _bar(verbose: bool) -> bool:
    """A progress bar: asked for, and stderr a terminal."""
    return bool(verbose) and sys.stderr.isatty()


def _report(verbose: bool, op: str, result: Any) -> None:
    """With ``verbose``: a line per transfer on stderr (after the bar, on a
    terminal)."""
    if not verbose:
        return
    for r in result if isinstance(result, list) else [result]:
        if isinstance(r, TensorResult):
            line = (f"{op} {r.key}: {r.tensors} tensors, {r.bytes} bytes in {r.seconds:.2f}s"
                    + (f" (rank {r.rank} of {r.world})" if r.rank is not None else ""))
        else:
            moved = r.bytes_sent
            line = f"{op} {r.key}: {r.files} files, {moved} bytes moved in {r.seconds:.2f}s"
            if isinstance(r, GetResult) and r.rank is not None:
                line += f" (broadcast {r.group} rank {r.rank})"
        print(f"kt: {line}", file=sys.stderr)
