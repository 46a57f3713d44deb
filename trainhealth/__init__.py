"""trainhealth: live training-health monitor for large ML training runs.

Data flows :mod:`trainhealth.collectors` (in every rank) → Redis → :mod:`trainhealth.detectors` (the
service) → Redis → :mod:`trainhealth.dashboard` and :mod:`trainhealth.alerts`; the commands on top
(:mod:`trainhealth.commands`) wire them together. The modules directly in this package are the ground
floor all parts share: Redis keys, the wire format, the records stored for others to read (anomalies,
recommendations, silences), defaults, configuration, exceptions, formatting and the embedded Redis
server. They import nothing above them (docs/architecture.md).

``from trainhealth import Monitor`` is the job's entry point, or ``trainhealth.init()`` (a Monitor configured
from the launcher's environment); they are imported on first use, so importing this package stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Monitor", "__version__", "init"]

if TYPE_CHECKING:
    from trainhealth.collectors.environment import init
    from trainhealth.collectors.monitor import Monitor


def __getattr__(name: str) -> Any:
    # Lazy: the ground floor must not import the collectors above it at import time.
    if name == "Monitor":
        from trainhealth.collectors.monitor import Monitor

        return Monitor
    if name == "init":
        from trainhealth.collectors.environment import init

        return init
    raise AttributeError(f"module 'trainhealth' has no attribute {name!r}")
