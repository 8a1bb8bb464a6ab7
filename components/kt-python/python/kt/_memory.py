"""Shared memory the pod's node agent can map: CPU tensors are lent to it
as files in its shared-memory directory (the one the agent names when
asked; ``KT_SHM_DIR``, default ``/dev/shm``, where no agent answers). :func:`empty` allocates arrays there, which kt moves with
no copy; anything else is copied into such a file first (a put) or out of
one afterwards (a get).
"""

from __future__ import annotations

import collections
import mmap
import os
import threading
import uuid
import weakref
from typing import Deque, Dict, Optional, Tuple

import numpy as np

from . import _kt

# Regions this process allocated, by start address: (length, path).
_regions: Dict[int, Tuple[int, str]] = {}
_lock = threading.Lock()
# Regions whose memory went while _lock was held, to drop from _regions
# under the lock by the next allocate or locate.
_pending: Deque[Tuple[int, str]] = collections.deque()


def _drop(start: int, path: str) -> None:
    # With _lock held. The path check keeps a region allocated since at the
    # same address.
    if _regions.get(start, (0, None))[1] == path:
        del _regions[start]


def _drain() -> None:
    # With _lock held.
    while _pending:
        _drop(*_pending.popleft())


def _forget(start: int, path: str, owner: int) -> None:
    # Never waits for _lock: a garbage collection can run this finalizer in
    # a thread that holds it (inside locate's loop or allocate's insert),
    # which would then wait for itself forever, with the GIL held.
    if _lock.acquire(blocking=False):
        try:
            _drop(start, path)
        finally:
            _lock.release()
    else:
        _pending.append((start, path))
    # A forked child's copy of the mapping going away leaves the file to
    # the process that made it.
    if os.getpid() != owner:
        return
    try:
        os.unlink(path)
    except OSError:
        pass


def allocate(nbytes: int) -> np.ndarray:
    """``nbytes`` of zeroed shared memory as a flat ``uint8`` array. The
    file is removed once nothing uses the memory any more."""
    directory = _kt.shm_dir()
    path = os.path.join(directory, f"kt-py-{os.getpid()}-{uuid.uuid4().hex}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        # Allocated now: the pages count against this process's memory, not
        # the agent's (a sparse file would be filled by the agent).
        size = max(nbytes, 1)
        os.posix_fallocate(fd, 0, size)
        mem = mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    flat = np.frombuffer(mem, dtype=np.uint8)
    start = flat.__array_interface__["data"][0]
    with _lock:
        _drain()
        _regions[start] = (size, path)
    # When the last array over it goes, so do the mapping and the file.
    weakref.finalize(mem, _forget, start, path, os.getpid())
    return flat[:nbytes]


def locate(address: int, nbytes: int) -> Optional[Tuple[str, int]]:
    """The file and offset of ``nbytes`` at ``address`` when they lie in
    shared memory this process allocated; ``None`` otherwise."""
    with _lock:
        _drain()
        for start, (length, path) in _regions.items():
            if start <= address and address + nbytes <= start + length:
                return path, address - start
    return None
