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
``KT_STREAMS``, ``KT_DEADLINE``, ``KT_KUBE``) or :func:`configure`; from a
laptop or CI, ``kt.configure(kube=True)`` (or ``KT_KUBE=1``) reaches kt
through the Kubernetes API as ``kt --kube`` does. Every call releases the
GIL while it waits, stops on Ctrl-C and after its ``timeout=``; errors are
:class:`KtError` subclasses. kt logs to the logger ``kt`` (retries,
failovers, sources chosen; timings at debug level).

numpy is imported only by the calls that move tensors and by :func:`empty`.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from dataclasses import dataclass, field
from typing import (TYPE_CHECKING, Any, Callable, Dict, List, Literal, Mapping, Optional,
                    Protocol, Sequence, Tuple, Union, overload)

from . import _kt, datasets
from .stream import Dataset, get_shard, to_numpy, to_torch
from .errors import (Conflict, FileExists, Forbidden, InvalidInput, KtError, NotFound, Timeout,
                     Unauthorized, Unavailable)

if TYPE_CHECKING:
    from ._tensors import Lent

__all__ = [
    "put", "get", "ls", "rm", "teardown", "drop", "configure", "settings", "empty", "datasets",
    "BroadcastWindow", "Item", "PutResult", "GetResult", "TensorResult", "TeardownResult",
    "Progress", "Settings", "Locale", "Lifespan", "PathLike", "TensorLike", "Seconds",
    "KtError", "NotFound", "Unauthorized", "Forbidden", "Unavailable", "Timeout",
    "InvalidInput", "Conflict", "FileExists",
    "Dataset", "get_shard", "to_numpy", "to_torch",
]

__version__ = "0.1.0"

PathLike = Union[str, "os.PathLike[str]"]
"""A path: a ``str`` or an ``os.PathLike`` such as ``pathlib.Path``."""

Locale = Literal["store", "local"]
"""Where a put's files live: copied into the store pod, or left in this pod
(served peer to peer by its node agent)."""

Lifespan = Literal["cluster", "resource"]
"""How long a key lives: until deleted, or until its service is torn down."""

Seconds = Union[int, float, datetime.timedelta]
"""A duration: seconds, or a ``datetime.timedelta``."""


class TensorLike(Protocol):
    """A tensor: a ``numpy.ndarray`` or a ``torch.Tensor`` (anything with a
    ``shape`` and a ``dtype``; kt checks the type when it is called)."""

    @property
    def shape(self) -> Any: ...

    @property
    def dtype(self) -> Any: ...


StateDict = Mapping[str, TensorLike]
"""A state dict: tensors by name, in the mapping's order."""

_LOCALES = ("store", "local")
_LIFESPANS = ("cluster", "resource")


def _type_error(param: str, want: str, value: Any) -> TypeError:
    return TypeError(f"{param} must be {want}, not {type(value).__name__}")


def _invalid(message: str) -> InvalidInput:
    return InvalidInput(message, "invalid_request")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class BroadcastWindow:
    """A broadcast: many getters of one key at once.

    Files (``kt.get(..., broadcast=w)``): getters form a tree as they
    arrive, each fetching from its parent while the parent is still
    downloading. ``group_id`` names the group (unique per run; default the
    key's open group), ``fanout`` its children per node (default: by the
    payload's size, a pipelined chain from 64 MiB on, else 50), ``timeout``
    how long it accepts joins (seconds). The group's first getter fixes
    them. A ``locale="local"`` put with a window only checks it.

    Tensors (``kt.put``/``kt.get`` of tensors with ``broadcast=w``): a
    quorum of putters and getters moves the data in one coordinated
    transfer once it closes: on ``world_size`` members, on every pod of
    ``ips`` having joined, or on ``timeout``, whichever comes first.
    ``pack`` sends a state dict's tensors of one dtype as one buffer;
    ``fanout`` is the host backend's tree (default 2).

    Wrong types raise ``TypeError`` and bad values :class:`InvalidInput`
    when the window is made.
    """

    group_id: Optional[str] = None
    world_size: Optional[int] = None
    ips: Sequence[str] = field(default_factory=list)
    timeout: Optional[float] = None
    fanout: Optional[int] = None
    pack: bool = False

    def __post_init__(self) -> None:
        if self.group_id is not None:
            if not isinstance(self.group_id, str):
                raise _type_error("group_id", "a str", self.group_id)
            if not self.group_id:
                raise _invalid("broadcast.group_id: a non-empty string")
        if self.world_size is not None:
            if not _is_int(self.world_size):
                raise _type_error("world_size", "an int", self.world_size)
            if self.world_size < 2:
                raise _invalid(f"broadcast.world_size: at least 2, not {self.world_size}")
        if self.timeout is not None:
            if not _is_number(self.timeout):
                raise _type_error("timeout", "seconds (an int or a float)", self.timeout)
            if self.timeout <= 0:
                raise _invalid(f"broadcast.timeout: seconds > 0, not {self.timeout}")
        if self.fanout is not None:
            if not _is_int(self.fanout):
                raise _type_error("fanout", "an int", self.fanout)
            if self.fanout < 1:
                raise _invalid(f"broadcast.fanout: at least 1, not {self.fanout}")
        if isinstance(self.ips, str) or not all(isinstance(i, str) for i in self.ips):
            raise TypeError("ips must be a list of IP addresses (str)")
        if not isinstance(self.pack, bool):
            raise _type_error("pack", "a bool", self.pack)

    def _for_files(self) -> None:
        if self.world_size is not None or self.ips or self.pack:
            raise _invalid(
                "broadcast: world_size, ips and pack are for tensors (a quorum); a file "
                "broadcast's tree forms as getters arrive (group_id, fanout, timeout)")

    def _json(self, tensors: bool) -> str:
        """The window as the tensor calls take it."""
        import json
        if not tensors:
            self._for_files()
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


@dataclass(frozen=True)
class PutResult:
    """What a put of files did: ``bytes_sent`` moved, ``bytes_skipped``
    already there; ``unchanged`` when the key already held this tree."""

    key: str
    files: int
    bytes_sent: int
    bytes_skipped: int
    unchanged: bool
    locale: Locale
    version: Optional[str]
    seconds: float


@dataclass(frozen=True)
class GetResult:
    """What a get of files did.

    A broadcast get has its ``group``, ``rank``, ``parents`` (the ranks
    fetched from, in order) and ``relayed`` (bytes it served to its
    children). A get of a prefix (a key ending in ``/``) sums the gets of
    every key below it, which are in ``gets`` (one ``GetResult`` each, its
    ``dest`` where that key landed); ``gets`` is empty for a single key.
    """

    key: str
    dest: str
    files: int
    bytes_sent: int
    bytes_skipped: int
    seconds: float
    group: Optional[str] = None
    rank: Optional[int] = None
    parents: Tuple[int, ...] = ()
    relayed: Optional[int] = None
    gets: Tuple[GetResult, ...] = ()


@dataclass(frozen=True)
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


@dataclass(frozen=True)
class Item:
    """One name of a listing (:func:`ls`): a key, a directory of keys, or
    both. The fields after ``is_directory`` describe the key, and are
    ``None`` for a name that is only a directory."""

    name: str
    key: str
    is_directory: bool
    is_key: bool = False
    #: ``"store"``, or the pod (its agent) holding a ``locale="local"`` key,
    #: as the reference's ``ls`` says it.
    locale: Optional[str] = None
    #: ``"store"``, or the pod (its agent) holding a ``locale="local"`` key.
    holder: Optional[str] = None
    size: Optional[int] = None
    files: Optional[int] = None
    version: Optional[str] = None
    lifespan: Optional[Lifespan] = None
    service: Optional[str] = None
    created: Optional[datetime.datetime] = None
    modified: Optional[datetime.datetime] = None
    expires: Optional[datetime.datetime] = None
    #: The key holds tensors (lent by a process), not files.
    tensors: bool = False


@dataclass(frozen=True)
class TeardownResult:
    """What a teardown removed: the ``deleted`` keys and the ``evicted``
    agents (pods no longer used as sources)."""

    deleted: List[str]
    evicted: List[str]


@dataclass(frozen=True)
class Progress:
    """A transfer's progress, as a ``progress=`` callable receives it:
    ``bytes_done`` of ``bytes_total`` (the bytes that move: files already
    at the destination do not count) in a transfer of ``files_total``
    files; ``finished`` on the last call."""

    bytes_done: int
    bytes_total: int
    files_total: int
    finished: bool


ProgressCallback = Callable[[Progress], Any]
"""What ``progress=`` takes: called with a :class:`Progress` when the
transfer's size is known, at most ten times a second while it moves, and
once at the end, on one of kt's threads. One that raises stops the
transfer, and the call raises its exception."""


@dataclass(frozen=True)
class Settings:
    """The settings in use (never the token). With ``kube``, ``metadata_url``
    is the local end of the port-forward."""

    metadata_url: str
    agent_socket: str
    streams: int
    #: How long a transfer keeps trying while its sources fail (seconds).
    deadline: float
    kube: bool
    shm_dir: str


def _seconds(param: str, value: Any) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, datetime.timedelta):
        value = value.total_seconds()
    elif not _is_number(value):
        raise _type_error(param, "seconds (a number) or a datetime.timedelta", value)
    if value <= 0:
        raise _invalid(f"{param}: seconds > 0, not {value}")
    return float(value)


def configure(metadata_url: Optional[str] = None, token: Optional[str] = None,
              token_file: Optional[PathLike] = None, agent_socket: Optional[PathLike] = None,
              streams: Optional[int] = None, *, deadline: Optional[Seconds] = None,
              kube: Optional[bool] = None, kubeconfig: Optional[PathLike] = None,
              context: Optional[str] = None, namespace: Optional[str] = None) -> None:
    """Sets how this process reaches kt. What is left out comes from the
    environment, as for the CLI: ``KT_METADATA_URL``,
    ``KT_TOKEN``/``KT_TOKEN_FILE``, ``KT_AGENT_SOCKET``, ``KT_STREAMS``,
    ``KT_DEADLINE`` (how long a transfer keeps trying while its sources
    fail, as ``kt --deadline``), ``KT_KUBE``, ``KT_KUBE_CONTEXT``,
    ``KT_NAMESPACE``.

    ``kube=True`` reaches kt from outside the cluster (a laptop, CI)
    through the Kubernetes API's port-forward, exactly as ``kt --kube``:
    the kubeconfig's ``context`` (default: its current one; ``kubeconfig``
    default ``$KUBECONFIG``, then ``~/.kube/config``), kt installed in
    ``namespace`` (default: the context's), the token from the cluster
    (Secret ``kt-token``) unless one is given. What needs a pod's node
    agent (``locale="local"`` puts, broadcast gets, tensors) is refused
    then.

    Calls after this one use the new settings; tensors already lent stay
    lent through the old agent connection while this process lives.
    Without a call, the environment is read on first use."""
    if streams is not None and (not _is_int(streams) or streams < 1):
        raise _invalid(f"streams: at least 1, not {streams!r}")
    if kube is not None and not isinstance(kube, bool):
        raise _type_error("kube", "a bool", kube)
    for param, value in (("metadata_url", metadata_url), ("token", token),
                         ("context", context), ("namespace", namespace)):
        if value is not None and not isinstance(value, str):
            raise _type_error(param, "a str", value)
    _kt.configure(metadata_url, token, _path(token_file), _path(agent_socket), streams,
                  _seconds("deadline", deadline), kube, _path(kubeconfig), context, namespace)


def _path(p: Optional[PathLike]) -> Optional[str]:
    return os.fspath(p) if p is not None else None


def settings() -> Settings:
    """The settings in use (never the token)."""
    return Settings(*_kt.settings())


def _key(key: Any) -> str:
    if not isinstance(key, str):
        raise _type_error("key", "a str", key)
    return key


def _ttl(ttl: Any) -> Optional[str]:
    if ttl is None:
        return None
    if isinstance(ttl, bool):
        raise TypeError("ttl must be seconds (a number) or a duration such as '2h'")
    if isinstance(ttl, (int, float)):
        if ttl <= 0:
            raise _invalid(f"ttl: must be positive, not {ttl!r}")
        return f"{max(1, int(round(ttl)))}s"
    if isinstance(ttl, datetime.timedelta):
        return _ttl(ttl.total_seconds())
    if isinstance(ttl, str):
        return ttl
    raise TypeError(f"ttl must be seconds (a number) or a duration such as '2h', "
                    f"not {type(ttl).__name__}")


def _choice(param: str, value: Any, allowed: Sequence[str]) -> str:
    if value not in allowed:
        raise _invalid(f"{param}: {value!r} is not one of {', '.join(allowed)}")
    return str(value)


def _window(param: str, broadcast: Any) -> Optional[BroadcastWindow]:
    if broadcast is None:
        return None
    if not isinstance(broadcast, BroadcastWindow):
        raise _type_error(param, "a kt.BroadcastWindow", broadcast)
    return broadcast


def _maybe_tensor(x: Any) -> bool:
    """Whether ``x`` is a numpy array or a torch tensor, without importing
    either: a caller holding one has imported its module."""
    np = sys.modules.get("numpy")
    if np is not None and isinstance(x, np.ndarray):
        return True
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _tensors_module() -> Any:
    from . import _tensors
    return _tensors


def _outside(what: str) -> None:
    """Refuses ``what`` (which needs this pod's agent) with ``kube=True``."""
    if _kt.outside():
        raise _invalid(f"{what} needs this pod's node agent: run it in a pod, not through "
                       "kube=True")


def _progress(op: str, key: str, verbose: bool,
              progress: Optional[ProgressCallback]) -> Tuple[bool, Optional[Callable[..., None]]]:
    """The terminal bar (verbose, stderr a terminal) and the callable the
    native half calls: the caller's ``progress``, and with ``verbose`` off
    a terminal, a plain line on stderr per tenth of the transfer."""
    if progress is not None and not callable(progress):
        raise _type_error("progress", "a callable", progress)
    if not isinstance(verbose, bool):
        raise _type_error("verbose", "a bool", verbose)
    # The native call made next on this thread says its trace id.
    _kt.announce_trace(verbose)
    tty = verbose and sys.stderr.isatty()
    lines = verbose and not tty
    if progress is None and not lines:
        return tty, None
    shown = [-1]

    def report(done: int, total: int, files: int, finished: bool) -> None:
        p = Progress(done, total, files, finished)
        if lines:
            step = 10 if total == 0 else min(10, done * 10 // total)
            if finished or step > shown[0]:
                shown[0] = step
                pct = 100 if total == 0 else done * 100 // total
                print(f"kt: {op} {key}: {done} of {total} bytes ({pct}%), {files} files"
                      + (", done" if finished else ""), file=sys.stderr, flush=True)
        if progress is not None:
            progress(p)

    return False, report


_held: Dict[str, List[Any]] = {}


@overload
def put(key: str, src: PathLike, *, locale: Locale = "store",
        lifespan: Optional[Lifespan] = None,
        ttl: Union[None, int, float, str, datetime.timedelta] = None,
        service: Optional[str] = None, broadcast: Optional[BroadcastWindow] = None,
        verbose: bool = False, progress: Optional[ProgressCallback] = None,
        timeout: Optional[Seconds] = None) -> PutResult: ...


@overload
def put(key: str, src: Union[TensorLike, StateDict], *, locale: Locale = "store",
        lifespan: Optional[Lifespan] = None,
        ttl: Union[None, int, float, str, datetime.timedelta] = None,
        service: Optional[str] = None, broadcast: Optional[BroadcastWindow] = None,
        verbose: bool = False, progress: Optional[ProgressCallback] = None,
        timeout: Optional[Seconds] = None) -> TensorResult: ...


@overload
def put(key: str, src: None = None, *, data: Union[TensorLike, StateDict],
        locale: Locale = "store",
        lifespan: Optional[Lifespan] = None,
        ttl: Union[None, int, float, str, datetime.timedelta] = None,
        service: Optional[str] = None, broadcast: Optional[BroadcastWindow] = None,
        verbose: bool = False, progress: Optional[ProgressCallback] = None,
        timeout: Optional[Seconds] = None) -> TensorResult: ...


def put(key: str, src: Union[PathLike, TensorLike, StateDict, None] = None, *,
        data: Union[TensorLike, StateDict, None] = None,
        locale: Locale = "store",
        lifespan: Optional[Lifespan] = None,
        ttl: Union[None, int, float, str, datetime.timedelta] = None,
        service: Optional[str] = None, broadcast: Optional[BroadcastWindow] = None,
        verbose: bool = False, progress: Optional[ProgressCallback] = None,
        timeout: Optional[Seconds] = None) -> Union[PutResult, TensorResult]:
    """Publishes ``src`` under ``key``; a path gives a :class:`PutResult`,
    a tensor or a state dict a :class:`TensorResult`.

    ``src`` is a path (a file or a directory tree), a tensor
    (``numpy.ndarray`` or ``torch.Tensor``) or a state dict (a mapping of
    names to tensors). ``data=`` takes a tensor or a state dict, as the
    reference's ``put(key, data=tensor)`` does (give ``src`` or ``data``).

    Files: ``locale="store"`` (default) copies them into the store pod;
    ``locale="local"`` leaves them where they are, served peer to peer by
    this pod's agent (``broadcast`` then only checks the window: getters
    form the tree). Only changed files move; the key shows the old tree or
    the new one, never a mix. ``progress`` is called as the files move
    (:class:`Progress`); ``verbose`` shows a bar on a terminal, else a line
    per tenth on stderr.

    Tensors are lent to this pod's agent, not copied into the store: the key
    lives while this process does (memory from :func:`empty` and CUDA
    tensors are lent as they are; other CPU tensors through one copy into
    shared memory). With ``broadcast`` the call returns when the quorum's
    transfer is over.

    ``lifespan``: ``"cluster"`` keeps the key until it is deleted,
    ``"resource"`` deletes it when its ``service`` (default: the one service
    the token writes, if it writes exactly one, as a pod's does in a
    cluster; else the key's first segment) is torn down; left out, the
    metadata server decides (``"resource"`` under a service's own keys and
    for tensors, else ``"cluster"``). ``ttl`` (seconds, ``"2h"``, a
    timedelta) expires it. ``timeout`` (seconds or a timedelta) stops the
    call and raises :class:`Timeout` once it passes.
    """
    if data is not None:
        if src is not None:
            raise TypeError("put() takes src or data, not both (data= is a tensor or a state dict)")
        if isinstance(data, (str, os.PathLike)):
            raise TypeError("put(data=...) takes a tensor or a state dict; a path goes in src=")
        src = data
    if src is None:
        raise TypeError("put() needs src: a path, a tensor or a state dict (or data=, a tensor "
                        "or a state dict)")
    key = _key(key)
    life = None if lifespan is None else _choice("lifespan", lifespan, _LIFESPANS)
    ttl_s = _ttl(ttl)
    if service is not None and not isinstance(service, str):
        raise _type_error("service", "a str", service)
    window = _window("broadcast", broadcast)
    limit = _seconds("timeout", timeout)
    started = time.monotonic()
    result: Union[PutResult, TensorResult]
    if isinstance(src, (str, os.PathLike)):
        where = _choice("locale", locale, _LOCALES)
        if window is not None:
            window._for_files()
        bar, report = _progress("put", key, verbose, progress)
        r = _kt.put_path(key, os.fspath(src), where, life, ttl_s, service, bar, report, limit)
        result = PutResult(*r)
    elif _maybe_tensor(src) or isinstance(src, Mapping):
        _choice("locale", locale, _LOCALES)
        _outside("a put of tensors")
        tensors = _tensors_module()
        lent = tensors.lend("src", src, for_get=False)
        try:
            t = _kt.put_tensors(key, lent.described, life, ttl_s, service,
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
        stats = t.get("stats") or {}
        result = TensorResult(key=t["key"], tensors=t["tensors"],
                              bytes=stats.get("bytes", lent.nbytes),
                              seconds=stats.get("seconds", time.monotonic() - started),
                              backend=stats.get("backend"), rank=stats.get("rank"),
                              world=stats.get("world"), version=t["version"])
    else:
        raise TypeError(f"src must be a path (str or os.PathLike), a tensor (numpy.ndarray "
                        f"or torch.Tensor) or a dict of tensors, not {type(src).__name__}")
    _report(verbose, "put", result)
    return result


@overload
def get(key: str, dest: PathLike, *, broadcast: Optional[BroadcastWindow] = None,
        delete: bool = False, verbose: bool = False,
        progress: Optional[ProgressCallback] = None,
        timeout: Optional[Seconds] = None) -> GetResult: ...


@overload
def get(key: str, dest: Union[TensorLike, StateDict, Sequence[TensorLike],
                              Mapping[int, TensorLike]], *,
        broadcast: Optional[BroadcastWindow] = None, keep_mapped: bool = False,
        reduce: Optional[Literal["sum", "mean"]] = None, verbose: bool = False,
        timeout: Optional[Seconds] = None) -> TensorResult: ...


def get(key: str, dest: Any, *, broadcast: Optional[BroadcastWindow] = None,
        delete: bool = False, keep_mapped: bool = False,
        reduce: Optional[Literal["sum", "mean"]] = None, verbose: bool = False,
        progress: Optional[ProgressCallback] = None,
        timeout: Optional[Seconds] = None) -> Union[GetResult, TensorResult]:
    """Fetches ``key`` into ``dest``; a path gives a :class:`GetResult`,
    tensors a :class:`TensorResult`.

    Files: ``dest`` is a path. A directory key makes ``dest`` a directory
    holding the tree: files already there with the same content are kept,
    others replaced one by one (each atomically), files the key does not
    have are left alone unless ``delete=True`` (then ``dest`` becomes exactly
    the key's tree). A ``key`` ending in ``/`` fetches every key below it,
    each into ``dest/<its path below the prefix>``, a few at once: the
    result sums them, each key's own in its ``gets``. ``broadcast`` joins a
    filesystem broadcast tree. ``progress`` and ``verbose`` as for
    :func:`put` (not for a prefix).

    Tensors: ``dest`` is a tensor or a state dict of the source's names,
    order, dtypes and shapes, filled in place (a destination that does not
    match is refused before anything moves, naming both sides); with
    ``broadcast``, through a quorum. With several putters of the key,
    ``dest`` may be a list of tensors (one per putter, by rank) or a dict
    of ranks to tensors, or one tensor with ``reduce="sum"`` or ``"mean"``
    over the putters. The agent lets go of CUDA destination memory when
    the get ends; ``keep_mapped=True`` keeps it open until this process
    exits, for a loop that gets into the same tensors every step.

    ``timeout`` (seconds or a timedelta) stops the call and raises
    :class:`Timeout` once it passes.
    """
    key = _key(key)
    window = _window("broadcast", broadcast)
    if not isinstance(delete, bool):
        raise _type_error("delete", "a bool", delete)
    if not isinstance(keep_mapped, bool):
        raise _type_error("keep_mapped", "a bool", keep_mapped)
    if reduce is not None and reduce not in ("sum", "mean"):
        raise _invalid(f"reduce: {reduce!r} is not one of sum, mean")
    limit = _seconds("timeout", timeout)
    results: Union[GetResult, TensorResult]
    if isinstance(dest, (str, os.PathLike)):
        if reduce is not None:
            raise _invalid("reduce: for tensors only")
        results = _get_files(key, os.fspath(dest), window, delete, verbose, progress, limit)
    elif _maybe_tensor(dest) or isinstance(dest, (Mapping, list, tuple)):
        if delete:
            raise _invalid("delete: for files only")
        if progress is not None:
            raise _invalid("progress: for files only")
        _outside("a get of tensors")
        tensors = _tensors_module()
        many: Optional[str] = None
        if isinstance(dest, (list, tuple)):
            many = "list"
        elif isinstance(dest, Mapping) and dest and all(_is_int(k) for k in dest):
            many = "by_rank"
        lent: Lent = (tensors.lend_many("dest", dest) if many is not None
                      else tensors.lend("dest", dest, for_get=True))
        packed = window.pack if window is not None else None
        s = _kt.get_tensors(key, lent.described,
                            window._json(tensors=True) if window else None, packed,
                            keep_mapped, reduce, many)
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


def _get_files(key: str, dest: str, window: Optional[BroadcastWindow], delete: bool,
               verbose: bool, progress: Optional[ProgressCallback],
               limit: Optional[float]) -> GetResult:
    bar, report = _progress("get", key, verbose, progress)
    stripped = key.strip()
    if stripped.endswith("/") and stripped.strip("/"):
        if window is not None:
            raise _invalid(f"broadcast: a broadcast gets one key, not every key below {key}")
        if report is not None:
            raise _invalid("progress: for one key, not every key below a prefix")
        started = time.monotonic()
        parts = tuple(_get_result(t) for t in _kt.get_prefix(key, dest, delete, limit))
        return GetResult(key=key, dest=dest, files=sum(p.files for p in parts),
                         bytes_sent=sum(p.bytes_sent for p in parts),
                         bytes_skipped=sum(p.bytes_skipped for p in parts),
                         seconds=time.monotonic() - started, gets=parts)
    if window is None:
        return _get_result(_kt.get_path(key, dest, delete, bar, report, limit))
    window._for_files()
    return _get_result(_kt.get_path(key, dest, delete, bar, report, limit, True,
                                    window.group_id, window.timeout, window.fanout))


def _get_result(t: Tuple[str, str, int, int, int, float, Optional[str], Optional[int],
                         List[int], Optional[int]]) -> GetResult:
    key, dest, files, sent, skipped, seconds, group, rank, parents, relayed = t
    return GetResult(key=key, dest=dest, files=files, bytes_sent=sent, bytes_skipped=skipped,
                     seconds=seconds, group=group, rank=rank, parents=tuple(parents),
                     relayed=relayed)


def _when(ms: Optional[int]) -> Optional[datetime.datetime]:
    if ms is None:
        return None
    return datetime.datetime.fromtimestamp(ms / 1000, datetime.timezone.utc)


def ls(prefix: str = "", *, timeout: Optional[Seconds] = None) -> List[Item]:
    """The names directly below ``prefix``: keys and directories of keys."""
    if not isinstance(prefix, str):
        raise _type_error("prefix", "a str", prefix)
    items = []
    for name, key, has_children, record in _kt.ls(prefix, _seconds("timeout", timeout)):
        if record is None:
            items.append(Item(name=name, key=key, is_directory=has_children))
            continue
        (locale, holder, is_dir, size, files, version, lifespan, service, created_ms,
         updated_ms, expires_ms, tensors) = record
        items.append(Item(name=name, key=key, is_directory=has_children or is_dir, is_key=True,
                          locale=locale, holder=holder, size=size, files=files,
                          version=version, lifespan=lifespan, service=service,
                          created=_when(created_ms), modified=_when(updated_ms),
                          expires=_when(expires_ms), tensors=tensors))
    return items


def rm(key: str, recursive: bool = False, *, timeout: Optional[Seconds] = None) -> List[str]:
    """Deletes ``key`` (with ``recursive``, every key below it too); the keys
    deleted."""
    key = _key(key)
    if not isinstance(recursive, bool):
        raise _type_error("recursive", "a bool", recursive)
    deleted = list(_kt.rm(key, recursive, _seconds("timeout", timeout)))
    _release(deleted)
    return deleted


def _release(keys: List[str]) -> None:
    """Lets go of the memory lent under ``keys``, which are gone (only
    then: the agent may use the memory until its key is deleted)."""
    for k in keys:
        _held.pop(k, None)


def teardown(service: str, *, timeout: Optional[Seconds] = None) -> TeardownResult:
    """Tears ``service`` down: deletes every key under its base path
    (``service/...``) except those put with ``lifespan="cluster"``, its
    other ``lifespan="resource"`` keys and its pods' zero-copy keys, and
    stops using its pods as sources."""
    if not isinstance(service, str):
        raise _type_error("service", "a str", service)
    deleted, evicted = _kt.teardown(service, _seconds("timeout", timeout))
    _release(deleted)
    return TeardownResult(deleted=list(deleted), evicted=list(evicted))


def drop(key: str) -> None:
    """Stops lending the tensors this process put under ``key`` (the key
    goes with them)."""
    key = _key(key)
    _kt.drop_tensors(key)
    _held.pop(key, None)


def empty(shape: Union[int, Sequence[int]], dtype: Any = "float32", *,
          framework: Literal["numpy", "torch"] = "numpy") -> Any:
    """A tensor in shared memory the pod's agent maps directly: put and get
    it with no copy. ``framework`` is ``"numpy"`` (an ``ndarray``) or
    ``"torch"`` (a CPU ``torch.Tensor``; ``dtype`` a torch dtype or name).
    Zero-filled."""
    dims = [shape] if isinstance(shape, int) else list(shape)
    if not all(_is_int(d) and d >= 0 for d in dims):
        raise _invalid(f"shape: non-negative ints, not {shape!r}")
    count = 1
    for d in dims:
        count *= d
    from ._memory import allocate
    if framework == "numpy":
        import numpy as np
        try:
            dt = np.dtype(dtype)
        except TypeError:
            if isinstance(dtype, str):
                raise _invalid(f"dtype: {dtype!r} is not a numpy dtype") from None
            raise
        return allocate(count * dt.itemsize).view(dt).reshape(dims)
    if framework == "torch":
        import torch  # type: ignore[import-not-found, unused-ignore]
        tdt: Any
        if isinstance(dtype, torch.dtype):
            tdt = dtype
        elif isinstance(dtype, str):
            tdt = getattr(torch, dtype.removeprefix("torch."), None)
            if not isinstance(tdt, torch.dtype):
                raise _invalid(f"dtype: {dtype!r} is not a torch dtype")
        else:
            raise _type_error("dtype", "a torch dtype or its name", dtype)
        size = torch.empty((), dtype=tdt).element_size()
        return torch.from_numpy(allocate(count * size)).view(tdt).reshape(dims)
    raise _invalid(f"framework: {framework!r} is not numpy or torch")


def _report(verbose: bool, op: str, result: Union[GetResult, PutResult, TensorResult]) -> None:
    """With ``verbose``: a line per transfer on stderr (after the bar, on a
    terminal)."""
    if not verbose:
        return
    for r in (result.gets or (result,)) if isinstance(result, GetResult) else (result,):
        if isinstance(r, TensorResult):
            line = (f"{op} {r.key}: {r.tensors} tensors, {r.bytes} bytes in {r.seconds:.2f}s"
                    + (f" (rank {r.rank} of {r.world})" if r.rank is not None else ""))
        else:
            line = f"{op} {r.key}: {r.files} files, {r.bytes_sent} bytes moved in {r.seconds:.2f}s"
            if isinstance(r, GetResult) and r.rank is not None:
                line += f" (broadcast {r.group} rank {r.rank})"
        print(f"kt: {line}", file=sys.stderr)
