"""The raw step stream's bound (records and bytes) is kept by the detector service once it has read the entries,
for every rank alike; the collectors' own trim is a backstop that never removes a record the bound keeps
(issue 17)."""

from __future__ import annotations

import json

import pytest
import redis

from trainhealth.collectors import Monitor
from trainhealth.detectors.hang import HangDetector
from trainhealth.detectors.retention import RawWindow, entry_bytes
from trainhealth.detectors.service import DetectorService


def _records_by_rank(r: redis.Redis, run: str) -> dict[int, list[int]]:
    """Per rank, the steps of its records in the run's raw stream, in stream order."""
    out: dict[int, list[int]] = {}
    for _, f in r.xrange(f"th:{{{run}}}:steps"):
        out.setdefault(int(f[b"rank"]), []).extend(x["step"] for x in json.loads(f[b"recs"]))
    return out


def _service(r: redis.Redis, **kw) -> DetectorService:
    return DetectorService(r, consumer="t", snapshot_interval=0.0, hang_factory=lambda: HangDetector(floor_s=1e9),
                           **kw)


def _drain(svc: DetectorService, r: redis.Redis, run: str) -> None:
    """Run the service until it has read and acknowledged every entry of the run's raw stream."""
    key = f"th:{{{run}}}:steps"
    for _ in range(200):
        svc.run_once(block_ms=10)
        last = r.xrevrange(key, count=1)
        groups = r.xinfo_groups(key) if last else []
        if last and groups and groups[0]["last-delivered-id"] == last[0][0] and groups[0]["pending"] == 0:
            return
    raise AssertionError(f"the service did not read all of {key}")


def _newest_within(entries: list, records: int, nbytes: int = 2**62) -> list:
    """The newest of ``entries`` (``XRANGE`` replies) whose records and bytes fit the bound, and at least one: what
    the service keeps. (How a sender splits its records into entries depends on its thread's timing: the expected
    entries are taken from what was written, not assumed.)"""
    kept, n, b = [], 0, 0
    for entry in reversed(entries):
        n, b = n + int(entry[1][b"n"]), b + entry_bytes(entry[1])
        if kept and (n > records or b > nbytes):
            break
        kept.append(entry)
    return kept[::-1]


def _log(mon: Monitor, steps: range, sections: list[str] = ()) -> None:
    for s in steps:
        if sections:
            with mon.step(s):
                for name in sections:
                    with mon.section(name):
                        pass
        mon.log_step(s, loss=1.0)


def _backlog(run: str, redis_url: str, steps: range, sections: list[str] = (), **kw) -> None:
    """One rank's records of ``steps`` sent as a backlog: entries of up to 100 records (its sender waits 60 s
    between flushes, and ``close()`` flushes it all)."""
    mon = Monitor(run, redis_url=redis_url, rank=0, world_size=1, batch_records=100, flush_interval=60.0,
                  spill_dir=False, **kw)
    _log(mon, steps, sections)
    assert mon.close() is True


def test_one_ranks_backlog_does_not_trim_the_other_ranks_records(r: redis.Redis, redis_url: str) -> None:
    # No service reads: the collectors' backstop alone. Rank 0 flushes every record as its own entry; rank 1 then
    # sends a 100-record backlog in one entry. A bound of 1,000 records holds all 600 (the trim of the bound over
    # that entry's 100 records, 10 entries, left 9 of rank 0's 500).
    r0 = Monitor("shared", redis_url=redis_url, rank=0, world_size=2, retention=1_000, batch_records=1,
                 spill_dir=False, close_timeout=60.0)
    _log(r0, range(500))
    assert r0.flush(30)
    r1 = Monitor("shared", redis_url=redis_url, rank=1, world_size=2, retention=1_000, batch_records=100,
                 flush_interval=60.0, spill_dir=False)
    _log(r1, range(100))
    assert r1.close() is True
    entries = r.xrange("th:{shared}:steps")
    assert max(int(f[b"n"]) for _, f in entries if f[b"rank"] == b"1") >= 99  # the backlog's entry (and a straggler)
    by_rank = _records_by_rank(r, "shared")
    assert (by_rank[0], by_rank[1]) == (list(range(500)), list(range(100)))
    # The backstop still bounds the stream: as many entries as the bound has records (exact below 1,000 entries).
    _log(r0, range(500, 1_500))
    assert r0.close() is True
    assert r.xlen("th:{shared}:steps") == 1_000
    assert _records_by_rank(r, "shared") == {0: list(range(500, 1_500))}


def test_the_service_trims_what_it_read_to_the_runs_record_bound(r: redis.Redis, redis_url: str) -> None:
    # 100-record entries under a bound of 1,000 records: the backstop keeps all 30 entries (3,000 records), the
    # service the newest 10 once it has read them.
    _backlog("by-records", redis_url, range(3_000), retention=1_000)
    written = r.xrange("th:{by-records}:steps")
    assert sum(int(f[b"n"]) for _, f in written) == 3_000 and len(written) >= 30
    assert r.hmget("th:{by-records}:meta", "retention_records", "retention_bytes") == [b"1000", b"536870912"]
    svc = _service(r)
    _drain(svc, r, "by-records")
    kept = _newest_within(written, 1_000)
    assert r.xrange("th:{by-records}:steps") == kept
    assert 900 < sum(int(f[b"n"]) for _, f in kept) <= 1_000
    assert json.loads(r.get("th:{by-records}:ledger:latest"))["steps_done"] == 3_000  # every record was read

    # A restarted service rebuilds the window from the entries it replays: new entries trim the oldest again.
    svc2 = _service(r)
    _backlog("by-records", redis_url, range(3_000, 3_500), retention=1_000)
    written = r.xrange("th:{by-records}:steps")
    _drain(svc2, r, "by-records")
    assert r.xrange("th:{by-records}:steps") == _newest_within(written, 1_000)
    assert _records_by_rank(r, "by-records")[0][-1] == 3_499


def test_the_service_keeps_the_smaller_of_its_bound_and_the_runs(r: redis.Redis, redis_url: str) -> None:
    _backlog("smaller", redis_url, range(1_000), retention=1_000)
    written = r.xrange("th:{smaller}:steps")
    _drain(_service(r, raw_retention=(500, 2**30)), r, "smaller")
    assert r.xrange("th:{smaller}:steps") == _newest_within(written, 500)


def test_the_service_trims_what_it_read_to_the_runs_byte_bound(r: redis.Redis, redis_url: str) -> None:
    # Fat records (40 timed sections, ~1.7 kB of JSON each) in 100-record entries: the record bound (1,000,000)
    # does not bind, the byte bound of 1 MiB does (8.5 MB are logged). The backstop keeps every entry (a record
    # bound of entries: 50 entries of ~170 kB hold 100 times as many records as it counts).
    names = [f"section_{i:02d}" for i in range(40)]
    _backlog("by-bytes", redis_url, range(5_000), names, retention_bytes=2**20, buffer_records=20_000,
             close_timeout=60.0)
    written = r.xrange("th:{by-bytes}:steps")
    assert sum(int(f[b"n"]) for _, f in written) == 5_000 and len(written) >= 50
    _drain(_service(r), r, "by-bytes")
    entries = r.xrange("th:{by-bytes}:steps")
    # The newest entries that fit the bound, and no fewer: one entry more would not fit.
    assert entries == _newest_within(written, 10**9, 2**20)
    sizes = [entry_bytes(f) for _, f in entries]
    assert 150_000 < max(sizes) < 200_000 and 2**20 - max(sizes) < sum(sizes) <= 2**20
    assert _records_by_rank(r, "by-bytes")[0][-1] == 4_999


def test_raw_window_keeps_the_newest_chunk_and_rejects_bad_bounds() -> None:
    w = RawWindow(max_records=1_000, max_bytes=2**20)
    w.add((1, 0), records=1_000, nbytes=100)
    w.add((2, 0), records=5_000, nbytes=100)  # a backlog over the bound on its own: still kept
    assert (w.trim(), w.records, w.nbytes) == (("2-0", False), 5_000, 100)
    assert w.trim() is None
    with pytest.raises(ValueError, match="max_records >= 1 and max_bytes >= 1, not 0, 10"):
        RawWindow(0, 10)
