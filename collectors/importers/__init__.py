"""Readers of the logs training stacks already write, into :class:`LogPoint` s (standard library only)."""

from __future__ import annotations

from collectors.importers.base import LogPoint

__all__ = ["LogPoint"]
