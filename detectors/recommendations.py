"""Stored recommendations (``th:{run}:recommendations``): read them, move them through their lifecycle.

The detector service writes them; people move them: ``proposed`` → ``acknowledged`` →
``applied`` or ``dismissed`` (from ``trainhealth advise`` or the dashboard). A change of
advice (another checkpoint or skip range) starts again at ``proposed``.
"""

from __future__ import annotations

import json
import time
from typing import Any

import redis

from detectors.advisor import STATUSES
from trainhealth.exceptions import ConfigError
from trainhealth.keys import run_keys


def load(client: redis.Redis, run: str) -> list[dict[str, Any]]:
    """All recommendations of ``run``, newest update first (JSON dicts as stored)."""
    raw = client.hgetall(run_keys(run).recommendations)
    recs = [json.loads(v) for v in raw.values()]
    return sorted(recs, key=lambda d: d.get("updated_at", 0.0), reverse=True)


def set_status(client: redis.Redis, run: str, rec_id: str, status: str, *, by: str = "", note: str = "") -> dict:
    """Move recommendation ``rec_id`` of ``run`` to ``status``; returns the stored dict.

    The change is recorded in the recommendation's ``history`` (time, status, by, note).

    Raises
    ------
    ConfigError
        For an unknown ``status`` or ``rec_id`` (naming the value); nothing is changed then.
    """
    if status not in STATUSES:
        raise ConfigError(f"status={status!r} is not one of {', '.join(STATUSES)}")
    key = run_keys(run).recommendations
    with client.pipeline(transaction=True) as pipe:
        while True:
            try:
                pipe.watch(key)  # optimistic lock: the service may update the figures meanwhile
                raw = pipe.hget(key, rec_id)
                if raw is None:
                    raise ConfigError(f"recommendation id={rec_id!r} does not exist in run {run!r}")
                d = json.loads(raw)
                d["status"] = status
                d.setdefault("history", []).append({"t": time.time(), "status": status, "by": by, "note": note})
                pipe.multi()
                pipe.hset(key, rec_id, json.dumps(d, sort_keys=True))
                pipe.execute()
                return d
            except redis.WatchError:
                continue
