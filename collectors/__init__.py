"""Collectors: imported by the training job on every rank (standard library + redis-py only)."""

from __future__ import annotations

from trainhealth.collectors.environment import init
from trainhealth.collectors.monitor import Monitor
from trainhealth.collectors.ranks import detect as detect_rank

__all__ = ["Monitor", "detect_rank", "init"]
