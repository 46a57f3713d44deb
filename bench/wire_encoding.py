"""Bytes per rank-step and encode/decode time of the step records' wire encodings: today's JSON batches against
msgspec's MessagePack and a packed layout of the fields that repeat.

The records are the ones a ``Monitor`` makes: a real ``Monitor`` logs timed steps like ``examples/torchrun_gpt.py``'s
(``mon.step`` with three sections, data / forward / optimizer; ``log_step`` with loss, grad norm, lr, tokens,
samples, consumed samples) into a fresh redis-server, and the bench reads its ``th:{run}:steps`` entries back: the
records exactly as they crossed the wire. Then, per encoding and per records an entry (1: a real job's pace, one
record per flush; 25; 1,000: the collector's batch under load):

- bytes of the ``recs`` field per record, and Redis ``MEMORY USAGE`` of a stream of such entries (with the
  ``rank``/``n``/``seq`` fields the collector writes) per record;
- encode µs per record: the sender's own path for JSON (``collectors/sender.py``: one ``JSONEncoder.encode`` per
  record, joined), ``msgspec.msgpack.encode`` of the list for MessagePack, building and encoding the layout for
  packed;
- decode µs per record: to the record dicts the service reads (``json.loads``; ``msgspec.msgpack.decode``; the
  packed layout unpacked into dicts), and for JSON also the service's whole decode into rows
  (``trainhealth.wire.decode_step_rows``), for scale.

Encodings: ``json`` (today: a JSON list of objects, every record repeating its field names); ``msgpack`` (the same
list as MessagePack, msgspec); ``packed`` (MessagePack of ``{"v": 2, "c": {fields equal in every record: rank,
inc}, "k": [field-name lists], "r": [[layout index, values…], …]}``: each distinct list of field names once an entry,
each record its values only); ``packed-json`` (the same layout as JSON: the standard library only, as the
collectors are). All four keep NaN/±inf and float64 exactly (checked: each decodes to the records).

    .venv/bin/python bench/wire_encoding.py [--records 20000]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgspec
import redis

from trainhealth import Monitor
from trainhealth.embedded_redis import find_redis_server, free_port
from trainhealth.wire import decode_step_rows

_dumps = json.JSONEncoder(separators=(",", ":")).encode  # the sender's encoder (collectors/sender.py)
_mp_encode = msgspec.msgpack.Encoder().encode
_mp_decode = msgspec.msgpack.Decoder().decode
DATA = ("data",)  # the data-loading sections, as the service's aggregator names them


def monitor_records(url: str, n: int) -> list[dict[str, Any]]:
    """``n`` step records as a real Monitor sends them (read back from its stream)."""
    mon = Monitor("wire", redis_url=url, rank=3, world_size=8, batch_records=1000, buffer_records=n + 10,
                  close_timeout=300, spill_dir=False)
    for s in range(n):
        with mon.step(s):
            with mon.section("data"):
                pass
            with mon.section("forward"):
                pass
            with mon.section("optimizer"):
                pass
        mon.log_step(s, loss=2.0 + math.sin(s) * 0.1, grad_norm=0.5 + (s % 7) / 10, lr=3e-4 * min(1.0, s / 1000),
                     tokens=4096, samples=8, consumed_samples=(s + 1) * 64)
    mon.close()
    r = redis.Redis.from_url(url)
    return [rec for _, f in r.xrange("th:{wire}:steps") for rec in json.loads(f[b"recs"])]


def enc_json(recs: list[dict]) -> bytes:
    return ("[" + ",".join(map(_dumps, recs)) + "]").encode()


def dec_json(body: bytes) -> list[dict]:
    return json.loads(body)


def _layout(recs: list[dict]) -> dict[str, Any]:
    first = recs[0]
    const = {k: first[k] for k in ("rank", "inc") if k in first and all(r.get(k) == first[k] for r in recs)}
    layouts: dict[tuple, int] = {}
    rows = []
    for rec in recs:
        names = tuple(k for k in rec if k not in const)
        i = layouts.setdefault(names, len(layouts))
        rows.append([i, *(rec[k] for k in names)])
    return {"v": 2, "c": const, "k": list(layouts), "r": rows}


def _unlayout(d: dict[str, Any]) -> list[dict]:
    const, names = d["c"], d["k"]
    return [{**const, **dict(zip(names[row[0]], row[1:], strict=True))} for row in d["r"]]


def enc_packed(recs: list[dict]) -> bytes:
    return _mp_encode(_layout(recs))


def dec_packed(body: bytes) -> list[dict]:
    return _unlayout(_mp_decode(body))


def enc_packed_json(recs: list[dict]) -> bytes:
    return _dumps(_layout(recs)).encode()


def dec_packed_json(body: bytes) -> list[dict]:
    return _unlayout(json.loads(body))


ENCODINGS: dict[str, tuple[Callable[[list[dict]], bytes], Callable[[bytes], list[dict]]]] = {
    "json": (enc_json, dec_json),
    "msgpack": (_mp_encode, _mp_decode),
    "packed": (enc_packed, dec_packed),
    "packed-json": (enc_packed_json, dec_packed_json),
}


def same(a: list[dict], b: list[dict]) -> bool:
    """Equal records, NaN equal to NaN, key order aside."""
    def norm(r: dict) -> dict:
        return {k: ("nan" if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()}
    return [norm(x) for x in a] == [norm(x) for x in b]


def timed(fn: Callable[[], Any], repeats: int = 5) -> float:
    best = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best.append(time.perf_counter() - t)
    return statistics.median(best)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--records", type=int, default=20_000)
    args = p.parse_args()
    port = free_port()
    with tempfile.TemporaryDirectory() as d:
        srv = subprocess.Popen([find_redis_server(), "--port", str(port), "--save", "", "--appendonly", "no",
                                "--dir", d], stdout=subprocess.DEVNULL)
        try:
            url = f"redis://127.0.0.1:{port}/0"
            r = redis.Redis.from_url(url)
            for _ in range(200):
                try:
                    r.ping()
                    break
                except redis.ConnectionError:
                    time.sleep(0.05)
            recs = monitor_records(url, args.records)
            print(f"{len(recs):,} records of a Monitor; one: {_dumps(recs[-1])}")
            print(f"{'encoding':>11} {'recs/entry':>10} {'B/rec wire':>10} {'B/rec Redis':>11} {'enc µs/rec':>10} "
                  f"{'dec µs/rec':>10} {'rows µs/rec':>11}")
            for batch in (1, 25, 1000):
                n = min(len(recs), 5_000 if batch == 1 else len(recs)) // batch * batch
                batches = [recs[i:i + batch] for i in range(0, n, batch)]
                for name, (enc, dec) in ENCODINGS.items():
                    bodies = [enc(b) for b in batches]
                    assert all(same(dec(body), b) for body, b in zip(bodies, batches, strict=True)), name
                    t_enc = timed(lambda enc=enc, batches=batches: [enc(b) for b in batches]) / n * 1e6
                    t_dec = timed(lambda dec=dec, bodies=bodies: [dec(x) for x in bodies]) / n * 1e6
                    rows = ""
                    if name == "json":
                        t_rows = timed(lambda bodies=bodies: [decode_step_rows({b"recs": x}, DATA) for x in bodies])
                        rows = f"{t_rows / n * 1e6:.2f}"
                    key = f"th:{{mem-{name}-{batch}}}:steps"
                    pipe = r.pipeline(transaction=False)
                    for i, body in enumerate(bodies):
                        pipe.xadd(key, {"rank": 3, "n": len(batches[i]), "seq": i * batch, "recs": body})
                    pipe.execute()
                    mem = r.memory_usage(key, samples=0) / n
                    wire = sum(map(len, bodies)) / n
                    print(f"{name:>11} {batch:>10,} {wire:>10.1f} {mem:>11.1f} {t_enc:>10.2f} {t_dec:>10.2f} "
                          f"{rows:>11}")
        finally:
            srv.terminate()
            srv.wait(10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
