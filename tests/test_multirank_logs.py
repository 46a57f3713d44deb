"""Per-rank logs: the all-reduce benchmark (16 ranks interleaved in one file) and Kineto traces (one rank per file).

Values are the files' own (../shared/real_logs/MANIFEST.md; the hand-made fixtures in tests/data/importers/):
parsed per rank, analysed offline as one multi-rank run, replayed through one Monitor per rank.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from trainhealth.collectors.importers import PER_RANK_FORMATS, detect, read
from trainhealth.commands.analyze_report import analyze_paths, format_text
from trainhealth.commands.replay import read_run, replay
from trainhealth.detectors.hang import HangDetector
from trainhealth.detectors.offline import OfflineRun
from trainhealth.detectors.service import DetectorService
from trainhealth.exceptions import InputFormatError
from trainhealth.logpoint import LogPoint
from trainhealth.timeline import arrange, timeline

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "importers"
ALLREDUCE = "allreduce_bench_16ranks.log"
KINETO = ("kineto_trace_rank0_ws128.json.gz", "kineto_trace_rank1_ws128.json.gz")

#: Iteration 1 of each rank (s): the warm-up. Rank 0 / 11 are the one pair whose lines interleave
#: ("0:", "11:", 1.0927, 1.8093): nearest '<rank>:' line (allreduce_bench's doc), matching the nodes.
FIRST_ITERATION = {0: 1.8093, 1: 1.8395, 2: 1.7637, 3: 1.7691, 4: 1.7526, 5: 2.0802, 6: 2.1418, 7: 1.8124,
                   8: 1.2561, 9: 1.4402, 10: 1.4738, 11: 1.0927, 12: 1.2946, 13: 1.1545, 14: 1.1593, 15: 1.2942}


def cli(*args: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    if env is None:
        env = {k: v for k, v in os.environ.items() if k != "TRAINHEALTH_REDIS_URL"}  # analyze needs no Redis
    return subprocess.run([sys.executable, "-m", "trainhealth", *map(str, args)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env=env)


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "trainhealth.collectors.importers" and r.levelno == logging.WARNING]


def by_rank(points: list[LogPoint]) -> dict[int, list[LogPoint]]:
    out: dict[int, list[LogPoint]] = {}
    for p in points:
        assert p.rank is not None
        out.setdefault(p.rank, []).append(p)
    return out


# -- the real files ------------------------------------------------------------------------------------------
def test_allreduce_bench_parses_16_ranks_of_5_iterations(real_logs: Path) -> None:
    path = real_logs / ALLREDUCE
    assert detect(path) == "allreduce_bench"
    pts = list(read(path))
    assert len(pts) == 80
    ranks = by_rank(pts)
    assert sorted(ranks) == list(range(16))
    assert all([p.step for p in v] == [1, 2, 3, 4, 5] for v in ranks.values())
    assert {r: v[0].step_seconds for r, v in ranks.items()} == FIRST_ITERATION
    assert (min(FIRST_ITERATION.values()), max(FIRST_ITERATION.values())) == (1.0927, 2.1418)  # MANIFEST 1.09–2.14
    later = [p.step_seconds for v in ranks.values() for p in v[1:]]
    assert (min(later), max(later)) == (0.7078, 0.7107)  # MANIFEST: then every rank 0.708–0.711 s
    assert all(p.sections == (("trial", p.step_seconds),) for p in pts)
    # hosts from NCCL's "rank R nranks 16 ... Init COMPLETE" lines: 4 ranks on each of 4 nodes
    hosts = {r: {p.host for p in v} for r, v in ranks.items()}
    assert hosts[0] == {"r6i6n4"} and hosts[6] == {"r6i6n5"} and hosts[11] == {"r7i6n2"} and hosts[15] == {"r7i6n3"}
    assert all(len({next(iter(hosts[r])) for r in range(n, n + 4)}) == 1 for n in range(0, 16, 4))
    # iteration 2 of rank 14 is the first duration after the "ignore me 109" line
    assert (ranks[14][1].step_seconds, ranks[14][1].source_line) == (0.708, 533)


def test_kineto_traces_parse_with_the_manifest_step_times(real_logs: Path) -> None:
    got = {}
    for name in KINETO:
        assert detect(real_logs / name) == "kineto_trace"
        pts = list(read(real_logs / name))
        assert {p.rank for p in pts} == {int(name[len("kineto_trace_rank")])}  # distributedInfo.rank
        got[pts[0].rank] = [(p.step, round(p.step_seconds * 1e3, 1)) for p in pts]
        assert all(p.sections == (("profiler_step", p.step_seconds),) for p in pts)
    assert got == {0: [(551, 607.3), (552, 622.9)], 1: [(551, 607.9), (552, 630.6)]}


def test_analyze_allreduce_finds_no_straggler_in_the_warm_up(real_logs: Path) -> None:
    out = cli("analyze", real_logs / ALLREDUCE, "--json")
    assert out.returncode == 0, out.stderr
    f = json.loads(out.stdout)["files"][0]
    s = f["summary"]
    assert (f["format"], s["steps"], s["ranks"], s["records"]) == ("allreduce_bench", 5, list(range(16)), 80)
    assert (s["first_step"], s["last_step"], s["restarts"], s["timeline"]) == (1, 5, 0, "logged")
    assert f["anomalies"] == [] and s["anomalies"] == 0
    # 5 iterations, the first a warm-up: too few for a goodput estimate, and the report says so.
    assert f["goodput"]["ledger"] is None
    assert f["goodput"]["note"] == ("not estimated: 5 steps are too few (the first step of a launch is its start-up; "
                                    "at least 10 are needed)")


def test_offline_pipeline_sees_every_ranks_busy_time(real_logs: Path) -> None:
    pts = list(read(real_logs / ALLREDUCE))
    run = OfflineRun()
    arranged = arrange(pts)
    run.expect_ranks(arranged)
    aggs = [a for tp in arranged.points for a in run.feed(tp).aggs] + run.finish().aggs
    assert run.pipeline.world_size == 16 and run.pipeline.hosts[11] == "r7i6n2"
    assert [(a.step, a.n_ranks) for a in aggs] == [(s, 16) for s in range(1, 6)]
    assert aggs[0].busy == tuple(FIRST_ITERATION[r] for r in range(16))
    ranks = by_rank(pts)
    assert aggs[4].busy == tuple(ranks[r][4].step_seconds for r in range(16))
    assert aggs[0].step_s == 2.1418  # the slowest rank's iteration: the job's step time
    assert run.anomalies == {}


def test_analyze_two_kineto_traces_as_one_run(real_logs: Path) -> None:
    paths = [real_logs / n for n in KINETO]
    out = cli("analyze", "--one-run", *paths, "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["summary"] == {"files": 1, "failed": 0, "anomalies": 0, "critical": 0, "exit_status": 0}
    f = doc["files"][0]
    assert (f["path"], f["paths"], f["format"], f["run"]) == (str(paths[0]), list(map(str, paths)), "kineto_trace",
                                                             "kineto_trace")
    s = f["summary"]
    assert (s["steps"], s["ranks"], s["records"], s["first_step"], s["last_step"]) == (2, [0, 1], 4, 551, 552)
    assert f["anomalies"] == []
    assert f["goodput"]["ledger"] is None  # two sampled steps: no goodput estimate
    text = cli("analyze", "--one-run", *paths).stdout
    line = "  run        2 logged training steps (steps 551–552) on 2 ranks (0–1; 4 per-rank records), 0 evaluations"
    assert line + "\n" in text
    # Without --one-run each trace is its own run, and the report says how to join them.
    reps = analyze_paths(paths)
    assert [(r.ranks, r.steps, r.anomalies) for r in reps] == [([0], 2, []), ([1], 2, [])]
    assert "`trainhealth analyze --one-run PATH...` analyses them together" in format_text(reps)


def _drain(client: redis.Redis) -> None:
    svc = DetectorService(client, consumer="t", snapshot_interval=0.0, hang_factory=lambda: HangDetector(floor_s=60))
    for _ in range(100):
        if svc.run_once(block_ms=20) == 0:
            break
    svc._tick(svc.clock() + 10)


def test_replay_of_the_allreduce_log_pushes_16_ranks(r: redis.Redis, real_logs: Path) -> None:
    res = replay(real_logs / ALLREDUCE, r, run="ar16")
    assert (res.points, res.evals, res.ranks, res.delivered) == (80, 0, tuple(range(16)), True)
    assert r.hget("th:{ar16}:meta", "world_size") == b"16"
    _drain(r)
    aggs = [{k.decode(): v.decode() for k, v in f.items()} for _, f in r.xrange("th:{ar16}:agg")]
    assert [(int(a["step"]), int(a["n_ranks"])) for a in aggs] == [(s, 16) for s in range(1, 6)]
    busy = [json.loads(a["busy"]) for a in aggs]
    assert busy[0] == [FIRST_ITERATION[rk] for rk in range(16)]
    ranks = by_rank(list(read(real_logs / ALLREDUCE)))
    assert busy[1:] == [[ranks[rk][i].step_seconds for rk in range(16)] for i in range(1, 5)]
    assert r.hgetall("th:{ar16}:anomalies") == {}
    hosts = {json.loads(v)["host"] for v in r.hgetall("th:{ar16}:hb").values()}
    assert hosts == {"r6i6n4", "r6i6n5", "r7i6n2", "r7i6n3"}


def test_cli_replays_two_kineto_traces_as_one_run(r: redis.Redis, redis_url: str, real_logs: Path) -> None:
    env = {**os.environ, "TRAINHEALTH_REDIS_URL": redis_url}
    out = cli("replay", "--one-run", *(real_logs / n for n in KINETO), env=env)
    assert out.returncode == 0, out.stderr
    assert (f"replayed 4 per-rank records of 2 ranks and 0 evaluations of {real_logs / KINETO[0]} + "
            f"{real_logs / KINETO[1]} as run 'replay-kineto_trace'") in out.stdout
    assert r.hget("th:{replay-kineto_trace}:meta", "source") == f"replay:{KINETO[0]}+{KINETO[1]}".encode()
    _drain(r)
    aggs = [json.loads(f[b"busy"]) for _, f in r.xrange("th:{replay-kineto_trace}:agg")]
    assert [[round(b * 1e3, 1) for b in a] for a in aggs] == [[607.3, 607.9], [622.9, 630.6]]


# -- hand-made fixtures ------------------------------------------------------------------------------------
def test_allreduce_fixture_interleaved_ranks_and_hosts() -> None:
    pts = list(read(DATA / "allreduce_bench.log"))
    assert [(p.rank, p.step, p.step_seconds, p.host, p.source_line) for p in pts] == [
        (1, 1, 1.25, "nodeA", 8),
        (0, 1, 0.9, "nodeA", 14),   # "2:", "0:", then two durations: the nearest waiting rank takes the first
        (2, 1, 1.6, "nodeB", 15),
        (0, 2, 0.7, "nodeA", 22), (2, 2, 0.701, "nodeB", 27), (1, 2, 0.702, "nodeA", 31),
    ]


def test_allreduce_fixture_bad_lines(caplog: pytest.LogCaptureFixture) -> None:
    path = DATA / "allreduce_bench_partly_bad.log"
    with caplog.at_level(logging.WARNING, logger="trainhealth.collectors.importers"):
        got = [(p.rank, p.step, p.step_seconds, p.source_line) for p in read(path)]
    # rank 1's malformed iteration 1 still counts: its next duration is iteration 2
    assert got == [(0, 1, 1.1, 3), (0, 2, 0.7, 7), (1, 2, 0.71, 9)]
    assert warnings_of(caplog) == [f"{path}: skipped 3 malformed all-reduce benchmark duration line(s); the first: "
                                   "line 1: a 'duration:' line with no '<rank>:' line before it: "
                                   "'duration: 0.5000 sec'"]
    path = DATA / "allreduce_bench_all_bad.log"
    with pytest.raises(InputFormatError) as err:
        list(read(path))
    assert str(err.value) == (f"{path}: line 1: a 'duration:' line with no '<rank>:' line before it: "
                              "'duration: 0.7000 sec'")


def test_kineto_fixtures_rank_from_distributed_info_or_file_name() -> None:
    r3 = DATA / "kineto_rank3.pt.trace.json"
    # the GPU copy of ProfilerStep#10 is not a step; slices come in time order whatever the file order
    assert [(p.rank, p.step, p.step_seconds, p.source_line) for p in read(r3)] == [(3, 10, 0.25, 3),
                                                                                   (3, 11, 0.2625, 2)]
    r5 = DATA / "kineto_nodist_rank5.json.gz"
    assert [(p.rank, p.step, p.step_seconds) for p in read(r5)] == [(5, 10, 0.24), (5, 11, 0.3)]
    # one run of ranks 3 and 5: world size 6 (rank ids index the per-rank columns); steps close at the end
    reps = analyze_paths([r3, r5], one_run=True)
    assert [(r.error, r.ranks, r.steps, r.records, r.first_step, r.last_step) for r in reps] == [
        (None, [3, 5], 2, 4, 10, 11)]
    run = OfflineRun()
    arranged = arrange(read_run([r3, r5])[0])
    run.expect_ranks(arranged)
    for tp in arranged.points:
        assert run.feed(tp).aggs == []
    assert [a.busy for a in run.finish().aggs] == [(None, None, None, 0.25, None, 0.24),
                                                   (None, None, None, 0.2625, None, 0.3)]


def test_kineto_errors_name_file_event_and_field(tmp_path: Path) -> None:
    path = DATA / "kineto_bad_dur.json"
    with pytest.raises(InputFormatError) as err:
        list(read(path))
    assert str(err.value) == (f"{path}: traceEvents[1] (ProfilerStep#2): field 'dur' is not a non-negative number "
                              "of microseconds: 'abc'")

    def trace(name: str, doc: dict) -> Path:
        p = tmp_path / name
        p.write_text(json.dumps(doc))
        return p

    step = {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#4", "pid": 1, "tid": 1, "ts": 0, "dur": 10}
    cases = {
        "dup.json": ({"traceEvents": [step, {"ph": "X", "name": "aten::mm"}, dict(step, ts=20)]},
                     "traceEvents[2] (ProfilerStep#4): step 4 again (first at traceEvents[0])"),
        "nosteps.json": ({"traceEvents": [{"ph": "X", "name": "aten::mm", "ts": 0, "dur": 1}]},
                         "no 'ProfilerStep#N' slices on a CPU thread (a trace recorded without torch.profiler's "
                         "step(), or not a PyTorch profiler trace)"),
        "rankstr.json": ({"distributedInfo": {"rank": "0"}, "traceEvents": [step]},
                         "distributedInfo.rank is not a non-negative integer: '0'"),
        "rankbig.json": ({"distributedInfo": {"rank": 8, "world_size": 8}, "traceEvents": [step]},
                         "distributedInfo.rank 8 is not below its world_size 8"),
        "nots.json": ({"traceEvents": [dict(step, ts=None)]},
                      "traceEvents[0] (ProfilerStep#4): field 'ts' is not a number of microseconds: None"),
        "nonum.json": ({"traceEvents": [dict(step, name="ProfilerStep#x")]},
                       "traceEvents[0] (ProfilerStep#x): field 'name' has no step number after 'ProfilerStep#'"),
        "notlist.json": ({"traceEvents": {"a": 1}}, "not a Chrome trace: no 'traceEvents' list"),
    }
    for name, (doc, msg) in cases.items():
        p = trace(name, doc)
        assert detect(p) == "kineto_trace", name
        with pytest.raises(InputFormatError) as err:
            list(read(p))
        assert str(err.value) == f"{p}: {msg}", name
    torn = tmp_path / "torn.pt.trace.json.gz"
    torn.write_bytes(gzip.compress(b'{"traceEvents": [')[:-8])
    with pytest.raises(InputFormatError, match=r"torn\.pt\.trace\.json\.gz: a gzip file that cannot be decompressed"):
        list(read(torn))


def test_one_run_refuses_single_stream_logs_and_a_rank_twice(tmp_path: Path) -> None:
    r3 = DATA / "kineto_rank3.pt.trace.json"
    with pytest.raises(InputFormatError) as err:
        read_run([r3, DATA / "nanogpt.log"])
    assert str(err.value) == (f"{DATA / 'nanogpt.log'}: a nanogpt log has no rank: --one-run joins per-rank logs "
                              "of one job (formats allreduce_bench, kineto_trace)")
    anon = tmp_path / "trace.json"
    anon.write_text(json.dumps({"traceEvents": [{"ph": "X", "name": "ProfilerStep#1", "ts": 0, "dur": 5}]}))
    assert [p.rank for p in read(anon)] == [None]  # alone: a one-rank trace, analysed as a single stream
    with pytest.raises(InputFormatError, match=r"trace\.json: a kineto_trace log without distributedInfo\.rank or "
                                               r"'rank<N>' in its name has no rank"):
        read_run([r3, anon])
    copy = tmp_path / "again_rank3.json"
    copy.write_bytes(r3.read_bytes())
    with pytest.raises(InputFormatError) as err:
        read_run([r3, copy])
    assert str(err.value) == f"{copy}: rank 3 is also in {r3}: --one-run joins different ranks of one job"
    out = cli("analyze", "--one-run", r3, DATA / "nanogpt.log")
    assert out.returncode == 2
    assert out.stderr == (f"trainhealth: error: {DATA / 'nanogpt.log'}: a nanogpt log has no rank: --one-run joins "
                          "per-rank logs of one job (formats allreduce_bench, kineto_trace)\n")
    assert sorted(PER_RANK_FORMATS) == ["allreduce_bench", "kineto_trace"]


def test_single_stream_logs_are_placed_exactly_as_before() -> None:
    pts = list(read(DATA / "nanogpt.log"))
    arranged = arrange(pts)
    assert (arranged.ranks, arranged.world_size) == ((), 1)
    assert not isinstance(arranged.points, list)  # lazy: a million-step log is never in memory
    assert list(arranged.points) == list(timeline(pts))
    with pytest.raises(ValueError, match=r"step 2 has no rank in a per-rank log"):
        arrange([LogPoint(1, rank=0), LogPoint(2)])
