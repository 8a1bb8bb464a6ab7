"""Tensors and state dicts as kt lends them to the pod's node agent.

A tensor is a ``numpy.ndarray`` or a ``torch.Tensor`` (torch is used only
when the caller already imported it); a state dict is a mapping of names
to tensors, in its order. Each is described to the native half as
``(name, dtype, shape, device, memory)``, where memory is shared memory the
agent maps (``("shm", [path, offset, nbytes])``) or CUDA memory it opens
by IPC handle (``("cuda", [pointer])``). Nothing here speaks to the agent.

A get of a key several putters put in a quorum lends several destinations
at once (:func:`lend_many`): a list (one per putter, in putter-rank order)
or a dict by putter rank; each described entry then carries its set's rank
(the list index, or the dict key) as ``(rank, described)``.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Mapping
from typing import Any, Callable, Dict, List, Sequence, Tuple, Union

import numpy as np

from . import _memory
from .errors import InvalidInput

Described = Tuple[str, str, List[int], str, Tuple[str, List[str]]]

# numpy's and torch's dtype names kt moves (the native half knows both).
_DTYPES = {
    "float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
    "int64", "int32", "int16", "int8", "uint8", "bool",
}


def _torch() -> Any:
    """torch, when the caller imported it (kt never imports it itself)."""
    return sys.modules.get("torch")


def is_tensor(x: Any) -> bool:
    if isinstance(x, np.ndarray):
        return True
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


def is_state_dict(x: Any) -> bool:
    return isinstance(x, Mapping) and len(x) > 0 and all(is_tensor(v) for v in x.values())


def _what(param: str, name: str) -> str:
    return param if not name else f"{param}[{name!r}]"


def _layout(param: str, name: str, t: Any) -> Tuple[str, List[int], int, str, int]:
    """dtype name, shape, nbytes, device, data address; refuses what kt
    cannot lend, naming the parameter."""
    where = _what(param, name)
    if isinstance(t, np.ndarray):
        dtype = str(t.dtype)
        if dtype not in _DTYPES:
            raise InvalidInput(f"{where}: dtype {dtype} is not one kt moves "
                               f"({', '.join(sorted(_DTYPES))})", "invalid_request")
        if not t.flags.c_contiguous:
            raise InvalidInput(f"{where}: the array is not contiguous "
                               "(numpy.ascontiguousarray makes a contiguous copy)",
                               "invalid_request")
        return dtype, [int(d) for d in t.shape], int(t.nbytes), "cpu", \
            int(t.__array_interface__["data"][0])
    dtype = str(t.dtype).removeprefix("torch.")
    if dtype not in _DTYPES:
        raise InvalidInput(f"{where}: dtype torch.{dtype} is not one kt moves",
                           "invalid_request")
    if not t.is_contiguous():
        raise InvalidInput(f"{where}: the tensor is not contiguous (.contiguous() "
                           "makes a contiguous copy)", "invalid_request")
    device = t.device
    if device.type == "cuda":
        dev = f"cuda:{device.index if device.index is not None else 0}"
    elif device.type == "cpu":
        dev = "cpu"
    else:
        raise InvalidInput(f"{where}: a tensor on {device} (kt moves cpu and cuda)",
                           "invalid_request")
    nbytes = int(t.numel() * t.element_size())
    return dtype, [int(d) for d in t.shape], nbytes, dev, int(t.data_ptr())


def _shm_like(t: Any, nbytes: int) -> Any:
    """A tensor of ``t``'s kind, dtype and shape in fresh shared memory."""
    flat = _memory.allocate(nbytes)
    if isinstance(t, np.ndarray):
        return flat.view(t.dtype).reshape(t.shape)
    torch = _torch()
    return torch.from_numpy(flat).view(t.dtype).reshape(t.shape)


def _copy(dst: Any, src: Any) -> None:
    if isinstance(dst, np.ndarray):
        np.copyto(dst, src, casting="no")
    else:
        dst.copy_(src)


class Lent:
    """Tensors described for the agent, with what must stay alive while it
    uses them (shared-memory copies) and the copies to make afterwards
    (into destinations outside shared memory)."""

    def __init__(self) -> None:
        self.described: List[Described] = []
        self.keep: List[Any] = []
        self.after: List[Callable[[], None]] = []
        self.nbytes = 0


def lend(param: str, value: Any, for_get: bool) -> Lent:
    """Describes a tensor or a state dict (``value``) given as ``param``;
    raises :class:`InvalidInput` before anything is sent."""
    if is_tensor(value):
        items: Sequence[Tuple[str, Any]] = [("", value)]
    elif isinstance(value, Mapping):
        if not value:
            raise InvalidInput(f"{param}: an empty state dict", "invalid_request")
        for k, v in value.items():
            if not isinstance(k, str) or not k:
                raise InvalidInput(f"{param}: state dict names must be non-empty "
                                   f"strings, not {k!r}", "invalid_request")
            if not is_tensor(v):
                raise TypeError(f"{param}[{k!r}] must be a numpy.ndarray or a "
                                f"torch.Tensor, not {type(v).__name__}")
        items = list(value.items())
    else:
        raise TypeError(f"{param} must be a tensor or a dict of tensors here, "
                        f"not {type(value).__name__}")
    out = Lent()
    synced = set()
    for name, t in items:
        dtype, shape, nbytes, device, address = _layout(param, name, t)
        out.nbytes += nbytes
        if for_get and isinstance(t, np.ndarray) and not t.flags.writeable:
            raise InvalidInput(f"{_what(param, name)}: the array is read-only",
                               "invalid_request")
        if device != "cpu":
            # The agent opens this memory by IPC handle: it must hold what
            # the caller's queued kernels write (a put) and stay allocated
            # while the agent uses it.
            if device not in synced:
                _torch().cuda.synchronize(t.device)
                synced.add(device)
            out.keep.append(t)
            out.described.append((name, dtype, shape, device, ("cuda", [str(address)])))
            continue
        found = _memory.locate(address, nbytes)
        if found is None:
            # Not in shared memory: lent through a copy that is.
            shm = _shm_like(t, nbytes)
            if for_get:
                out.after.append(functools.partial(_copy, t, shm))
            else:
                _copy(shm, t)
            out.keep.append(shm)
            address = int(shm.__array_interface__["data"][0]) if isinstance(shm, np.ndarray) \
                else int(shm.data_ptr())
            found = _memory.locate(address, nbytes)
            assert found is not None
        else:
            out.keep.append(t)
        path, offset = found
        out.described.append((name, dtype, shape, "cpu",
                              ("shm", [path, str(offset), str(nbytes)])))
    return out


def lend_many(param: str, value: Union[Sequence[Any], Mapping[int, Any]]) -> Lent:
    """Describes destinations for every putter's tensors of a key
    (``value``, given as ``param``): a list or tuple of tensors or state
    dicts, one per putter in putter-rank order, or a dict ``{rank: tensor or
    state dict}`` by putter rank (each rank a non-negative int; they are
    sent in ascending order). Every destination has one layout. Each
    described entry is ``(rank, described)``: the list index, or the dict
    key. Raises :class:`InvalidInput` before anything is sent."""
    if isinstance(value, Mapping):
        pairs: List[Tuple[int, Any]] = []
        for k in value:
            if isinstance(k, bool) or not isinstance(k, int) or k < 0:
                raise InvalidInput(f"{param}: a dict by rank has non-negative int keys, "
                                   f"not {k!r}", "invalid_request")
            pairs.append((int(k), value[k]))
        pairs.sort(key=lambda p: p[0])
    elif isinstance(value, (list, tuple)):
        pairs = list(enumerate(value))
    else:
        raise TypeError(f"{param} must be a list of tensors or a dict {{rank: tensor}} "
                        f"here, not {type(value).__name__}")
    if not pairs:
        raise InvalidInput(f"{param}: no destination (one per putter)", "invalid_request")
    out = Lent()
    described: List[Tuple[int, Described]] = []
    first: Dict[str, Any] = {}
    for rank, dest in pairs:
        part = lend(f"{param}[{rank}]", dest, for_get=True)
        layout = [(d[0], d[1], d[2]) for d in part.described]
        if not first:
            first = {"rank": rank, "layout": layout}
        elif layout != first["layout"]:
            raise InvalidInput(f"{param}[{rank}] has another layout than "
                               f"{param}[{first['rank']}] (every putter of a key "
                               "brings one layout)", "invalid_request")
        described.extend((rank, d) for d in part.described)
        out.keep.extend(part.keep)
        out.after.extend(part.after)
        out.nbytes += part.nbytes
    out.described = described  # type: ignore[assignment]
    return out
