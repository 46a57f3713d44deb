"""Say a thing once: a problem that repeats every step (a bad value, a broken heartbeat) is logged the first time
and then only counted, so a log stays readable and a tight loop does not spend its time logging."""

from __future__ import annotations

import logging
from typing import Any


class WarnOnce:
    """Log each distinct ``key`` once on ``logger``, at most ``limit`` keys (then silently).

    Parameters
    ----------
    logger : logging.Logger
        Where to log (the caller's module logger).
    prefix : str
        Put before every message (``"trainhealth collector: "`` inside a training job, so a user sees whose
        line it is among the framework's).
    limit : int
        Distinct keys remembered; beyond it nothing more is logged (a key built from bad input must not grow
        memory without bound).
    level : int
        The logging level (``logging.ERROR`` with ``exc_info=True`` for an internal error with its traceback).

    >>> import logging, sys
    >>> logging.basicConfig(stream=sys.stdout, format="%(message)s", level=logging.WARNING, force=True)
    >>> warn = WarnOnce(logging.getLogger("example"), prefix="trainhealth collector: ")
    >>> for _ in range(3):
    ...     warn("nan", "field %r is NaN; not recorded", "loss")
    trainhealth collector: field 'loss' is NaN; not recorded
    >>> warn.seen("nan"), warn.seen("inf")
    (True, False)
    """

    def __init__(self, logger: logging.Logger, prefix: str = "", limit: int = 10_000, level: int = logging.WARNING,
                 ) -> None:
        self.logger = logger
        self.prefix = prefix
        self.limit = limit
        self.level = level
        self._keys: set[str] = set()

    def __call__(self, key: str, msg: str, *args: Any, exc_info: bool = False) -> None:
        """Log ``msg % args`` (with the current exception's traceback when ``exc_info``) unless ``key`` was."""
        if key in self._keys or len(self._keys) >= self.limit:
            return
        self._keys.add(key)
        self.logger.log(self.level, self.prefix + msg, *args, exc_info=exc_info)

    def seen(self, key: str) -> bool:
        """Whether ``key`` was logged already."""
        return key in self._keys
