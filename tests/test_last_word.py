"""A rank's last word: the ``rank_exit`` event a Monitor sends at interpreter exit without ``close()``.

Real training-like scripts in real subprocesses against the suite's real redis-server: the event must
tell a rank that saw its own end (an unhandled exception, ``sys.exit``, the script's end) from one that
went silent (``os._exit`` here stands in for SIGKILL, an OOM kill or a segfault: no atexit handler runs).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import redis

from trainhealth.collectors import Monitor
from trainhealth.wire import Event, decode_event

RUN = "run-x"
EVENTS = "th:{run-x}:events"

#: The head of every script: a rank 1 of 2 that logs steps 1..3, then does what the test appends.
HEAD = """\
import os, sys
from trainhealth.collectors.monitor import Monitor
mon = Monitor("run-x", rank=1, world_size=2, spill_dir=False)
for s in (1, 2, 3):
    mon.log_step(s, loss=1.0 / s)
"""


def run_script(redis_url: str, body: str) -> subprocess.CompletedProcess:
    script = HEAD + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", script], env={**os.environ, "TRAINHEALTH_REDIS_URL": redis_url},
                          capture_output=True, text=True, timeout=60)


def events(r: redis.Redis) -> list[Event]:
    return [decode_event(f) for _, f in r.xrange(EVENTS)]


def rank_exits(r: redis.Redis) -> list[Event]:
    return [e for e in events(r) if e.kind == "rank_exit"]


def test_unhandled_exception_sends_its_redacted_error(r: redis.Redis, redis_url: str) -> None:
    out = run_script(redis_url, 'raise RuntimeError("boom with redis://user:secret@host:6379/0")\n')
    assert out.returncode == 1, out.stderr
    assert [e.kind for e in events(r)] == ["run_start", "rank_exit"]  # no run_end: the run is not finished
    (ev,) = rank_exits(r)
    assert (ev.rank, ev.step, ev.seconds) == (1, 3, None)
    assert ev.extra == {"reason": "exception", "error": "RuntimeError: boom with redis://***@host:6379/0",
                        "phase": "train"}
    # The password is nowhere in what the rank sent (the traceback on stderr is Python's own).
    raw = [(k, v) for _, f in r.xrange(EVENTS) for k, v in f.items()]
    assert raw and not any(b"secret" in k or b"secret" in v for k, v in raw)
    assert not any(b"secret" in v for _, f in r.xrange("th:{run-x}:steps") for v in f.values())


def test_error_is_one_line_with_the_module_of_its_type(r: redis.Redis, redis_url: str) -> None:
    # A non-builtin type shows with its module, as in a traceback; a multi-line message becomes one line.
    out = run_script(redis_url, """\
        import json
        try:
            json.loads("{")
        except ValueError as exc:
            raise json.JSONDecodeError("Expecting property name\\n  enclosed in quotes", "{", 1) from exc
        """)
    assert out.returncode == 1, out.stderr
    (ev,) = rank_exits(r)
    assert ev.extra["error"] == ("json.decoder.JSONDecodeError: Expecting property name enclosed in quotes: "
                                 "line 1 column 2 (char 1)")


def test_long_error_is_cut_to_500_characters(r: redis.Redis, redis_url: str) -> None:
    out = run_script(redis_url, 'raise RuntimeError("x" * 1000 + " redis://u:secret@h/0")\n')
    assert out.returncode == 1, out.stderr
    (ev,) = rank_exits(r)
    assert ev.extra["error"] == "RuntimeError: " + "x" * (500 - len("RuntimeError: "))
    assert not any(b"secret" in v for _, f in r.xrange(EVENTS) for v in f.values())


def test_os_exit_leaves_no_last_word(r: redis.Redis, redis_url: str) -> None:
    # flush() first, so what is missing is the last word only, not everything the rank sent.
    out = run_script(redis_url, "mon.flush()\nos._exit(1)\n")
    assert out.returncode == 1, out.stderr
    assert [e.kind for e in events(r)] == ["run_start"]


def test_script_end_without_close_is_an_exit(r: redis.Redis, redis_url: str) -> None:
    out = run_script(redis_url, "")
    assert out.returncode == 0, out.stderr
    assert [e.kind for e in events(r)] == ["run_start", "rank_exit"]
    (ev,) = rank_exits(r)
    assert (ev.rank, ev.step, ev.extra) == (1, 3, {"reason": "exit", "phase": "train"})


def test_sys_exit_is_an_exit_without_its_code(r: redis.Redis, redis_url: str) -> None:
    # CPython keeps no trace of a SystemExit for atexit handlers, and the collector replaces no hook:
    # the code is unknown, so exit_code is left out rather than guessed.
    out = run_script(redis_url, "sys.exit(3)\n")
    assert out.returncode == 3, out.stderr
    (ev,) = rank_exits(r)
    assert (ev.rank, ev.step, ev.extra) == (1, 3, {"reason": "exit", "phase": "train"})


def test_exception_inside_a_step_names_that_step(r: redis.Redis, redis_url: str) -> None:
    # The Monitor records a step whose block raised (its time was spent), so it is the last step.
    out = run_script(redis_url, """\
        with mon.step(4):
            raise OSError(104, "Connection reset by peer")
        """)
    assert out.returncode == 1, out.stderr
    (ev,) = rank_exits(r)
    assert (ev.step, ev.extra["reason"], ev.extra["error"]) == (
        4, "exception", "ConnectionResetError: [Errno 104] Connection reset by peer")


@pytest.mark.parametrize("end", ["with", "close"])
def test_closed_monitor_sends_run_end_and_no_last_word(r: redis.Redis, redis_url: str, end: str) -> None:
    body = {"with": """\
        mon.close()
        with Monitor("run-x", rank=1, world_size=2, spill_dir=False) as m2:
            m2.log_step(4, loss=0.25)
        raise RuntimeError("after close")
        """, "close": 'mon.close()\nraise RuntimeError("after close")\n'}[end]
    out = run_script(redis_url, body)
    assert out.returncode == 1, out.stderr
    kinds = [e.kind for e in events(r)]
    assert kinds == (["run_start", "run_end", "run_start", "run_end"] if end == "with" else ["run_start", "run_end"])


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_sends_no_last_word(r: redis.Redis, redis_url: str) -> None:
    # The child inherits the atexit handler; its copy of the monitor is off, so its crash says nothing.
    out = run_script(redis_url, """\
        pid = os.fork()
        if pid == 0:
            raise RuntimeError("child")
        assert os.waitpid(pid, 0)[1] != 0
        mon.close()
        """)
    assert out.returncode == 0, out.stderr
    assert [e.kind for e in events(r)] == ["run_start", "run_end"]


def test_at_most_one_last_word_and_close_still_ends_the_run(r: redis.Redis, redis_url: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # pytest itself leaves sys.last_value set after a failed test: this one must not depend on that.
    monkeypatch.setattr(sys, "last_value", None, raising=False)
    monkeypatch.setattr(sys, "last_exc", None, raising=False)
    mon = Monitor(RUN, redis_url=redis_url, rank=0, world_size=1, spill_dir=False)
    with mon.checkpoint_save(7):
        mon._atexit()  # an exit handler running while the rank saves a checkpoint
        mon._atexit()
    assert mon.close() is True
    mon._atexit()
    assert [e.kind for e in events(r)] == ["run_start", "rank_exit", "checkpoint_save", "run_end"]
    (ev,) = rank_exits(r)
    assert (ev.step, ev.extra) == (None, {"reason": "exit", "phase": "checkpoint_save"})



def test_sigterm_leaves_a_last_word_and_still_kills(r: redis.Redis, redis_url: str) -> None:
    # A launcher tearing the group down (torchrun after another rank died, a preemption) sends SIGTERM: the rank says
    # so before it dies of the signal, as it would have without the monitor.
    out = run_script(redis_url, """\
        import signal
        os.kill(os.getpid(), signal.SIGTERM)
        print("not reached")
        """)
    assert out.returncode == -signal.SIGTERM and "not reached" not in out.stdout
    [ev] = rank_exits(r)
    assert (ev.rank, ev.step, ev.extra) == (1, 3, {"reason": "signal", "signal": "SIGTERM", "phase": "train"})


def test_sigterm_inside_the_flushs_lock_still_kills(r: redis.Redis, redis_url: str) -> None:
    # The launcher's SIGTERM can land while the main thread is inside the sender's flush() (close(), the exit's
    # flush), holding an Event's lock: the handler must not take that lock again (it would wait on itself for
    # ever, and the launcher's SIGKILL would follow 30 s later with no last word). Forced here at that exact point.
    out = run_script(redis_url, """\
        import signal, threading
        for s in range(4, 20000):
            mon.log_step(s, loss=1.0)
        orig = threading.Condition.notify
        fired = []
        def notify(self, n=1):
            if not fired and threading.current_thread() is threading.main_thread() and self is mon._sender._wake._cond:
                fired.append(1)
                os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here, with the Event's lock held
            return orig(self, n)
        threading.Condition.notify = notify
        mon.flush(5.0)
        print("not reached")
        """)
    assert out.returncode == -signal.SIGTERM and "not reached" not in out.stdout, out.stderr[-2000:]
    [ev] = rank_exits(r)
    assert (ev.rank, ev.extra["reason"], ev.extra["signal"]) == (1, "signal", "SIGTERM")


def test_a_jobs_own_sigterm_handler_is_kept(r: redis.Redis, redis_url: str) -> None:
    script = ("import os, signal, sys\n"
              "signal.signal(signal.SIGTERM, lambda *a: (print('own handler'), sys.exit(0)))\n"
              "from trainhealth.collectors.monitor import Monitor\n"
              "mon = Monitor('run-x', rank=0, world_size=1, spill_dir=False)\n"
              "os.kill(os.getpid(), signal.SIGTERM)\n")
    out = subprocess.run([sys.executable, "-c", script], env={**os.environ, "TRAINHEALTH_REDIS_URL": redis_url},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "own handler" in out.stdout
    [ev] = rank_exits(r)
    assert ev.extra["reason"] == "exit"  # its handler exited cleanly: the ordinary last word, no signal one
