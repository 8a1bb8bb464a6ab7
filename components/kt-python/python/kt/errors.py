"""kt's exceptions.

What kt could not do is a :class:`KtError`, carrying the server's error
``code`` (``"not_found"``, ``"unavailable"``, ...; ``None`` for errors that
never reached a server) and its ``message``. Each class is also the
built-in exception a Python caller would expect: :class:`NotFound` is a
``LookupError`` and a ``FileNotFoundError``, :class:`Forbidden` a
``PermissionError``, :class:`Timeout` a ``TimeoutError``,
:class:`InvalidInput` a ``ValueError``, :class:`FileExists` a
``FileExistsError``. Arguments of the wrong type raise ``TypeError`` before
anything is sent; a full shared-memory directory while copying a tensor for
the agent raises ``OSError``; ``RuntimeError`` means a bug in kt (please
report it). Catch the subclass you can act on::

    try:
        kt.get("team/model/v3", dest="model/")
    except kt.NotFound:
        ...  # not published yet
    except kt.Unavailable:
        ...  # no store, or no live source of the key: retry later
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

__all__ = [
    "KtError",
    "NotFound",
    "Unauthorized",
    "Forbidden",
    "Unavailable",
    "Timeout",
    "InvalidInput",
    "Conflict",
    "FileExists",
]


class KtError(Exception):
    """Any error of kt: ``code`` is the server's error code, ``message``
    the explanation (also ``str(error)``)."""

    def __init__(self, message: str, code: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> Tuple[Any, Tuple[str, Optional[str]]]:
        # Picklable across processes (multiprocessing).
        return (type(self), (self.message, self.code))


class NotFound(KtError, LookupError, FileNotFoundError):
    """The key (or a prefix's keys) does not exist."""


class Unauthorized(KtError):
    """The token is missing, wrong or expired (``KT_TOKEN``,
    ``KT_TOKEN_FILE``, ``kt.configure(token=...)``): HTTP 401."""


class Forbidden(KtError, PermissionError):
    """The token is good but its role may not do this (a key outside the
    services it writes, say): HTTP 403."""


class Unavailable(KtError):
    """kt cannot serve it now: no store, no live source of the key, a
    server or the pod's agent unreachable. Retrying later may work."""


class Timeout(Unavailable, TimeoutError):
    """A bounded wait of the call ran out: its ``timeout=`` (the call was
    stopped; files land whole or not at all), or the metadata server was not
    reached within the connect timeout. The message says what the call was
    doing then."""


class InvalidInput(KtError, ValueError):
    """The call's arguments are wrong (a bad key, locale, tensor layout,
    a destination that does not match the source); nothing was sent."""


class Conflict(KtError):
    """The key is held by another process, or changed meanwhile."""


class FileExists(KtError, FileExistsError):
    """A destination path is in the way: a file where the get needs a
    directory, or the other way round."""
