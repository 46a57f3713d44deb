"""``trainhealth advise RUN``: the rollback advisor's recommendations, for people and launchers."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import redis

from trainhealth import recommendations, samples
from trainhealth.commands._shared import with_url
from trainhealth.exceptions import ConfigError
from trainhealth.keys import RUNS, run_keys
from trainhealth.recommendations import STATUSES, Recommendation

#: What ``--format`` prints.
FORMATS = ("text", "json", "megatron", "skip-json", "indices")


def register(sub: Any) -> None:
    """Add ``advise`` to the ``trainhealth`` sub-parsers."""
    summary = ("Show the rollback advisor's recommendations for a run, export them for a launcher, or move "
               "one through its lifecycle (proposed → acknowledged → applied / dismissed).")
    a = with_url(sub.add_parser("advise", help=summary, description=summary), starts=False)
    a.add_argument("run", help="run id")
    a.add_argument("--json", action="store_true", help="print the recommendations as JSON")
    a.add_argument("--id", dest="rec_id", help="one recommendation (default: the newest)")
    a.add_argument("--set", dest="status", choices=[s for s in STATUSES if s != "proposed"],
                   help="move the recommendation to this status")
    a.add_argument("--by", default="", help="who sets the status (recorded in its history)")
    a.add_argument("--note", default="", help="a note recorded with the status change")
    a.add_argument("--format", choices=FORMATS, default=None,
                   help="what to print: text (default), json (every recommendation), megatron (the rollback's "
                        "Megatron arguments), skip-json (the exact skip: step, sample and batch ranges and the "
                        "sample indices of the skipped steps), indices (those sample indices, one a line)")
    a.add_argument("-o", "--output", metavar="FILE", help="write what --format json, megatron, skip-json or indices "
                   "prints to FILE instead")
    a.add_argument("--megatron", action="store_true", help="print the Megatron arguments of the rollback "
                   "(--format megatron)")
    a.add_argument("--lightning", metavar="FILE", help="write the skip_batches.json of the rollback to FILE")
    a.set_defaults(func=run, extra=None)


def run(args: argparse.Namespace) -> int:
    """``trainhealth advise``, on the Redis of ``--redis-url`` (never starting the embedded one)."""
    from trainhealth.connection import connect
    from trainhealth.embedded_redis import resolve_url

    url, _ = resolve_url(args.redis_url, start=False)
    return run_advise(connect(url), args)


def run_advise(client: redis.Redis, args: argparse.Namespace) -> int:
    """Carry out ``trainhealth advise``; returns the exit status (1 when there is nothing to advise)."""
    keys = run_keys(args.run)
    if client.zscore(RUNS, args.run) is None:
        raise ConfigError(f"run={args.run!r} is not in the run registry")
    recs = recommendations.load(client, args.run)
    if args.rec_id:
        recs = [r for r in recs if r["id"] == args.rec_id]
        if not recs:
            raise ConfigError(f"--id={args.rec_id!r} is not a recommendation of run {args.run!r}")
    if args.status:
        if not recs:
            raise ConfigError(f"run {args.run!r} has no recommendation to set")
        d = recommendations.set_status(client, args.run, recs[0]["id"], args.status, by=args.by, note=args.note)
        print(f"{d['id']}: {d['status']}")
        return 0
    fmt = args.format or ("json" if args.json else "megatron" if args.megatron else "text")
    if fmt == "json":
        _emit(json.dumps(recs, indent=2, sort_keys=True) + "\n", args.output)
        return 0 if recs else 1
    if not recs:
        print(f"No recommendation for run {args.run!r}: no loss spike, divergence or NaN needs one "
              f"({keys.recommendations} is empty).")
        return 1
    rec = recs[0]
    if fmt in ("skip-json", "indices"):
        return _export_skip(client, rec, args, fmt)
    if fmt == "megatron" or args.lightning:
        return _export(rec, args)
    if args.output:
        raise ConfigError(f"--output={args.output!r} takes --format json, megatron, skip-json or indices")
    for d in recs:
        print(f"[{d['status']}] {d['id']} — {d['action']}")
        print(f"  {d['summary']}")
        for line in d.get("reasoning", []):
            print(f"  · {line}")
        for opt in d.get("options", []):
            print(f"  · {opt}")
    return 0


def _export(rec: dict[str, Any], args: argparse.Namespace) -> int:
    r = Recommendation.from_dict(rec)
    megatron, skip = r.megatron_args(), r.lightning_skip()
    if megatron is None or skip is None or r.checkpoint_step is None:
        raise ConfigError(f"recommendation {r.id!r} ({r.action}) has no rollback to export")
    if args.megatron or args.format == "megatron":
        _emit(megatron + "\n", args.output)
    if args.lightning:
        with open(args.lightning, "w") as f:
            json.dump(skip, f, indent=2)
        print(f"wrote {args.lightning}")
    return 0


def _export_skip(client: redis.Redis, rec: dict[str, Any], args: argparse.Namespace, fmt: str) -> int:
    """``--format skip-json`` / ``indices``: the exact skip of ``rec``, its sample indices read from Redis."""
    doc = samples.read_skip(client, args.run, rec)
    if doc is None:
        raise ConfigError(f"recommendation {rec['id']!r} ({rec['action']}) has no skip range to export")
    if fmt == "skip-json":
        _emit(samples.dumps(doc), args.output)
        return 0
    body = samples.skip_list(doc)
    if body is None:
        a, b = doc["skip_steps"]
        raise ConfigError(f"run {args.run!r} logged no sample indices for steps {a}-{b} (log_step(sample_indices=) "
                          f"records them); --format skip-json has the step, sample and batch ranges")
    _emit(body, args.output)
    return 0


def _emit(text: str, path: str | None) -> None:
    """``text`` to ``path``, or to stdout."""
    if path is None:
        sys.stdout.write(text)
        return
    with open(path, "w") as f:
        f.write(text)
    print(f"wrote {path}")
