"""Shared by the framework callbacks: run ids and the never-raise hook guard (standard library only)."""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable
from typing import Any, TypeVar

log = logging.getLogger("trainhealth.collectors.integrations")

_F = TypeVar("_F", bound=Callable[..., Any])
_NOT_RUN_ID = re.compile(r"[^A-Za-z0-9._-]+")


def run_id(*candidates: str | None, default: str = "train") -> str:
    """First candidate that gives a valid run id: runs of other characters become ``-``, at most 128.

    >>> run_id(None, "llama 8b (sft)")
    'llama-8b-sft'
    >>> run_id("", "//", default="hf-trainer")
    'hf-trainer'
    """
    for c in candidates:
        rid = _NOT_RUN_ID.sub("-", str(c or "")).strip("-")[:128]
        if rid:
            return rid
    return default


def guarded(fn: _F) -> _F:
    """Decorate a callback hook: its first error is logged, none is raised into training, it returns None.

    The callback instance needs a ``_failed_hooks`` set (hooks that already logged an error).
    """

    @functools.wraps(fn)
    def hook(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            fn(self, *args, **kwargs)
        except Exception:
            if fn.__name__ not in self._failed_hooks:
                self._failed_hooks.add(fn.__name__)
                log.exception("trainhealth: %s.%s failed (training continues; later errors there are not logged)",
                              type(self).__name__, fn.__name__)

    return hook  # type: ignore[return-value]
