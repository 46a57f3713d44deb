"""trainhealth: live training-health monitor for large ML training runs.

Data flows ``collectors`` (in every rank) → Redis → ``detectors`` (the service)
→ Redis → ``dashboard`` and alerts. This package holds what all three share:
defaults, the Redis key schema, event encoding, configuration, the embedded
Redis server and the CLI. It imports only the standard library at top level,
so training jobs that import :mod:`collectors` stay light.
"""

from __future__ import annotations

__version__ = "0.1.0"
