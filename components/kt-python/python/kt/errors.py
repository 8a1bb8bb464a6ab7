"""kt's exceptions.

What kt could not do is a :class:`KtError`, carrying the server's error
``code`` (``"not_found"``, ``"unavailable"``, ...; ``None`` for errors that
never reached a server) and its ``message``. Arguments of the wrong type
raise ``TypeError`` before anything is sent; a full shared-memory directory
while copying a tensor for the agent raises ``OSError``; ``RuntimeError``
means a bug in kt (please report it). Catch the subclass you can act on::

    try:
        kt.get("team/model/v3", dest="model/")
    except kt.NotFound:
        ...  # not published yet
    except kt.Unavailable:
        ...  # no store, or no live source of the key: retry later
"""

from __future__ import annotations

from typing import Optional

__all__ = [
    "KtError",
    "NotFound",
    "Unauthorized",
    "Unavailable",
    "InvalidInput",
    "Conflict",
]


class KtError(Exception):
    """Any error of kt: ``code`` is the server's error code, ``message``
    the explanation (also ``str(error)``)."""

    def __init__(self, message: str, code: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code

    def __reduce__(self):  # picklable across processes (multiprocessing)
        return (type(self), (self.message, self.code))


class NotFound(KtError, LookupError):
    """The key (or a prefix's keys) does not exist."""


class Unauthorized(KtError):
    """The token is missing or wrong (``KT_TOKEN``, ``KT_TOKEN_FILE``)."""


class Unavailable(KtError):
    """kt cannot serve it now: no store, no live source of the key, a
    server or the pod's agent unreachable. Retrying later may work."""


class InvalidInput(KtError, ValueError):
    """The call's arguments are wrong (a bad key, locale, tensor layout,
    a destination that does not match the source); nothing was sent."""


class Conflict(KtError):
    """The key is held by another process, or changed meanwhile."""
