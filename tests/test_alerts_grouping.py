"""The grouping engine on numbers: Alertmanager's timers, flapping, resolves, silences, inhibition, routing.

Pure logic (no Redis, no HTTP): alerts are fed with explicit times (unix seconds) and the notifications
that come out are compared field by field.
"""

from __future__ import annotations

import threading
from typing import Any

from trainhealth.alerts.grouping import Grouper
from trainhealth.alerts.inhibition import DEFAULT_RULES
from trainhealth.alerts.notification import Alert, Notification, idempotency_key
from trainhealth.alerts.routing import Route, Timers
from trainhealth.matchers import Matcher, parse_all
from trainhealth.silences import Silence

AM = Timers(group_wait=30.0, group_interval=300.0, repeat_interval=14400.0)  # Alertmanager's defaults


def root(*children: Route, receivers: tuple[str, ...] = ("ops",), group_by: tuple[str, ...] = ("run", "kind"),
         timers: Timers = AM) -> Route:
    return Route("root", (), receivers, group_by, timers, False, children)


def anomaly(kind: str = "straggler", step: int = 250, ranks: tuple[int, ...] = (5,), severity: str = "warning",
            status: str = "active", end_step: int | None = None, t: float = 0.0, **evidence: Any) -> dict[str, Any]:
    who = "-".join(map(str, ranks)) or "*"
    return {"id": f"{kind}:{who}:{step}:0", "kind": kind, "severity": severity, "status": status, "step": step,
            "end_step": end_step, "ranks": list(ranks), "hosts": [f"node-{r // 8}" for r in ranks][:1],
            "evidence": evidence or {"score": 0.6}, "message": f"{kind} at step {step}", "first_seen": t,
            "last_seen": t}


def alert(run: str = "r1", transition: str = "opened", **kw: Any) -> Alert:
    return Alert.from_transition(run, transition, anomaly(**kw))


def summary(notes: list[Notification]) -> list[tuple]:
    """(group key, seq, at, reason, firing keys, resolved keys) of each notification."""
    return [(n.group_key, n.seq, n.at, n.reason, [a.key for a in n.firing], [a.key for a in n.resolved])
            for n in notes]


G_STRAG = 'root:{run="r1",kind="straggler"}'


def test_group_wait_then_group_interval_then_repeat_interval() -> None:
    g = Grouper(root())
    assert g.observe(alert(t=100.0), 100.0) == []
    assert g.advance(129.999) == []
    first = g.advance(130.0)
    assert summary(first) == [(G_STRAG, 1, 130.0, "new", ["r1/straggler:5:250:0"], [])]
    n = first[0]
    assert (n.receivers, n.group_labels, n.status, n.group_started) == (("ops",), {"run": "r1", "kind": "straggler"},
                                                                       "firing", 100.0)
    assert g.advance(430.0) == [] and g.advance(14229.0) == []  # unchanged: nothing until repeat_interval
    assert summary(g.advance(14530.0)) == [(G_STRAG, 2, 14530.0, "repeat", ["r1/straggler:5:250:0"], [])]
    assert g.advance(14830.0) == []
    assert g.next_due() == 15130.0


def test_alerts_of_one_group_are_batched_and_later_ones_wait_for_group_interval() -> None:
    g = Grouper(root())
    g.observe(alert(ranks=(5,), t=100.0), 100.0)
    g.observe(alert(ranks=(6,), t=110.0), 110.0)
    assert summary(g.advance(130.0)) == [(G_STRAG, 1, 130.0, "new", ["r1/straggler:5:250:0", "r1/straggler:6:250:0"],
                                          [])]
    g.observe(alert(ranks=(7,), t=200.0), 200.0)
    assert g.advance(429.0) == []
    notes = g.advance(430.0)  # the whole firing group again, as Alertmanager sends it
    assert summary(notes) == [(G_STRAG, 2, 430.0, "update", ["r1/straggler:5:250:0", "r1/straggler:6:250:0",
                                                             "r1/straggler:7:250:0"], [])]
    # other runs and kinds are other groups, on their own timers
    g.observe(alert(run="r2", t=140.0), 440.0)
    g.observe(alert(kind="hang", ranks=(), severity="critical", t=441.0), 441.0)
    assert [(n.group_key, n.at) for n in g.advance(471.0)] == [('root:{run="r2",kind="straggler"}', 470.0),
                                                              ('root:{run="r1",kind="hang"}', 471.0)]


def test_an_anomaly_that_ends_within_group_wait_never_notifies() -> None:
    g = Grouper(root())
    g.observe(alert(t=100.0), 100.0)
    g.observe(alert(transition="resolved", status="resolved", end_step=260, t=120.0), 120.0)
    assert g.advance(100_000.0) == []
    assert g.groups == {}
    # an "updated" of an already resolved anomaly the engine no longer holds changes nothing
    assert g.observe(alert(transition="updated", status="resolved", end_step=261, t=200.0), 100_001.0) == []
    assert g.groups == {}


def test_resolve_notification_then_a_new_life_of_the_group_with_a_fresh_key() -> None:
    g = Grouper(root())
    g.observe(alert(t=100.0), 100.0)
    first = g.advance(130.0)
    g.observe(alert(transition="resolved", status="resolved", end_step=800, t=200.0), 200.0)
    resolved = g.advance(430.0)
    assert summary(resolved) == [(G_STRAG, 2, 430.0, "resolved", [], ["r1/straggler:5:250:0"])]
    assert resolved[0].status == "resolved"
    assert resolved[0].resolved[0].ends_at == 200.0 and resolved[0].resolved[0].anomaly["end_step"] == 800
    assert g.groups == {}
    # the same labels again later: a new group (sequence 1 again) whose notifications have other keys
    g.observe(alert(step=900, t=1000.0), 1000.0)
    again = g.advance(1030.0)
    assert summary(again) == [(G_STRAG, 1, 1030.0, "new", ["r1/straggler:5:900:0"], [])]
    assert again[0].idempotency_key("ops") != first[0].idempotency_key("ops")
    assert first[0].idempotency_key("ops") == idempotency_key(G_STRAG, 100.0, 1, "ops")


def test_mixed_notification_reports_resolved_alerts_beside_firing_ones() -> None:
    g = Grouper(root())
    g.observe(alert(ranks=(5,), t=100.0), 100.0)
    g.observe(alert(ranks=(6,), t=100.0), 100.0)
    g.advance(130.0)
    g.observe(alert(ranks=(6,), transition="resolved", status="resolved", end_step=300, t=200.0), 200.0)
    # a third rank appears and vanishes between two flushes: never notified, never "resolved"
    g.observe(alert(ranks=(7,), t=210.0), 210.0)
    g.observe(alert(ranks=(7,), transition="resolved", status="resolved", end_step=260, t=220.0), 220.0)
    assert summary(g.advance(430.0)) == [(G_STRAG, 2, 430.0, "update", ["r1/straggler:5:250:0"],
                                          ["r1/straggler:6:250:0"])]
    assert list(g.groups[G_STRAG].alerts) == ["r1/straggler:5:250:0"]


def test_severity_escalation_notifies_at_the_next_interval_evidence_updates_do_not() -> None:
    g = Grouper(root())
    kw: dict[str, Any] = {"kind": "loss_spike", "ranks": (), "step": 4410}
    g.observe(alert(**kw, t=100.0), 100.0)
    g.advance(130.0)
    g.observe(alert(**kw, transition="updated", z=12.0, t=200.0), 200.0)  # same severity, new numbers
    assert g.advance(430.0) == []
    g.observe(alert(**kw, transition="updated", severity="critical", t=500.0), 500.0)
    notes = g.advance(730.0)
    assert summary(notes) == [('root:{run="r1",kind="loss_spike"}', 2, 730.0, "update", ["r1/loss_spike:*:4410:0"],
                               [])]
    assert notes[0].firing[0].severity == "critical"
    # going back to warning is not news
    g.observe(alert(**kw, transition="updated", severity="warning", t=800.0), 800.0)
    assert g.advance(1030.0) == []


def test_restart_point_event_is_notified_once_and_never_resolved() -> None:
    g = Grouper(root())
    kw: dict[str, Any] = {"kind": "restart", "ranks": (), "step": 621, "status": "resolved", "end_step": 621,
                          "t": 100.0}
    g.observe(alert(transition="opened", **kw), 100.0)
    g.observe(alert(transition="resolved", **kw), 100.0)
    notes = g.advance(130.0)
    assert summary(notes) == [('root:{run="r1",kind="restart"}', 1, 130.0, "new", ["r1/restart:*:621:0"], [])]
    assert notes[0].status == "firing" and notes[0].firing[0].point
    assert g.groups == {} and g.advance(100_000.0) == []


def test_silence_by_run_kind_and_rank_with_expiry() -> None:
    g = Grouper(root())
    g.silences = [Silence("s1", parse_all(['run="r1"', 'kind="straggler"', 'rank="5"']), 0.0, 1000.0)]
    g.observe(alert(ranks=(5,), t=100.0), 100.0)
    assert g.advance(130.0) == []  # muted: no first notification
    g.observe(alert(ranks=(6,), t=140.0), 140.0)
    assert summary(g.advance(430.0)) == [(G_STRAG, 1, 430.0, "new", ["r1/straggler:6:250:0"], [])]
    assert g.advance(730.0) == []
    # the silence ends at 1000: rank 5 is news at the next tick (1030)
    assert summary(g.advance(1030.0)) == [(G_STRAG, 2, 1030.0, "update", ["r1/straggler:5:250:0",
                                                                            "r1/straggler:6:250:0"], [])]
    # a multi-rank anomaly involving rank 5 is matched by rank="5"; rank 15 is not
    s = Silence("s2", (Matcher.parse('rank="5"'),), 0.0, 10.0)
    assert s.mutes({"rank": "3,5"}, 5.0) and not s.mutes({"rank": "15"}, 5.0) and not s.mutes({"rank": "5"}, 10.0)


def test_a_silence_does_not_swallow_the_resolve_of_an_alert_already_notified() -> None:
    g = Grouper(root())
    g.observe(alert(t=100.0), 100.0)
    g.advance(130.0)
    g.silences = [Silence("s1", parse_all(['kind="straggler"']), 150.0, 10_000.0)]
    g.observe(alert(ranks=(6,), t=200.0), 200.0)  # silenced: never notified
    assert g.advance(430.0) == []
    g.observe(alert(transition="resolved", status="resolved", end_step=800, t=500.0), 500.0)
    assert summary(g.advance(730.0)) == [(G_STRAG, 2, 730.0, "resolved", [], ["r1/straggler:5:250:0"])]


def test_hang_inhibits_straggler_of_the_same_run_until_it_resolves() -> None:
    g = Grouper(root(), DEFAULT_RULES)
    g.observe(alert(kind="hang", ranks=(), severity="critical", step=700, t=100.0), 100.0)
    g.observe(alert(ranks=(5,), t=105.0), 105.0)
    g.observe(alert(run="r2", ranks=(3,), t=105.0), 105.0)
    notes = g.advance(135.0)
    assert [(n.group_key, n.at) for n in notes] == [('root:{run="r1",kind="hang"}', 130.0),
                                                    ('root:{run="r2",kind="straggler"}', 135.0)]
    assert g.muted(g.groups[G_STRAG].alerts["r1/straggler:5:250:0"], 135.0) == "inhibited by r1/hang:*:700:0"
    g.observe(alert(kind="hang", ranks=(), severity="critical", step=700, transition="resolved",
                    status="resolved", end_step=700, t=500.0), 500.0)
    notes = g.advance(735.0)
    assert summary(notes) == [('root:{run="r1",kind="hang"}', 2, 730.0, "resolved", [], ["r1/hang:*:700:0"]),
                              (G_STRAG, 1, 735.0, "new", ["r1/straggler:5:250:0"], [])]


def test_critical_nan_inhibits_loss_spike_a_grad_norm_only_nan_does_not() -> None:
    spike: dict[str, Any] = {"kind": "loss_spike", "ranks": (), "step": 450}
    g = Grouper(root(), DEFAULT_RULES)
    g.observe(alert(kind="nan_inf", ranks=(), severity="critical", step=449, t=100.0), 100.0)
    g.observe(alert(**spike, t=101.0), 101.0)
    assert [n.group_key for n in g.advance(200.0)] == ['root:{run="r1",kind="nan_inf"}']
    g = Grouper(root(), DEFAULT_RULES)
    g.observe(alert(kind="nan_inf", ranks=(), severity="warning", step=449, t=100.0), 100.0)
    g.observe(alert(**spike, t=101.0), 101.0)
    assert [n.group_key for n in g.advance(200.0)] == ['root:{run="r1",kind="nan_inf"}',
                                                       'root:{run="r1",kind="loss_spike"}']


def _tree() -> Route:
    page = Route("page", parse_all(['severity="critical"']), ("pagerduty",), ("run", "kind"),
                 Timers(10.0, 60.0, 3600.0), True)
    ml = Route("ml-team", parse_all(['kind=~"loss_spike|divergence|nan_inf"']), ("slack-ml",), ("run",), AM)
    return root(page, ml, receivers=("slack",))


def test_routing_first_match_continue_and_fallback_to_root() -> None:
    tree = _tree()
    ids = [r.id for r in tree.match({"run": "r", "kind": "hang", "severity": "critical", "rank": "", "host": ""})]
    assert ids == ["page"]
    ids = [r.id for r in tree.match({"run": "r", "kind": "nan_inf", "severity": "critical", "rank": "", "host": ""})]
    assert ids == ["page", "ml-team"]  # page continues
    ids = [r.id for r in tree.match({"run": "r", "kind": "straggler", "severity": "warning", "rank": "5",
                                     "host": ""})]
    assert ids == ["root"]
    g = Grouper(tree)
    g.observe(alert(kind="nan_inf", ranks=(), severity="critical", step=100, t=0.0), 0.0)
    notes = g.advance(30.0)
    assert [(n.group_key, n.receivers, n.at) for n in notes] == [
        ('page:{run="r1",kind="nan_inf"}', ("pagerduty",), 10.0), ('ml-team:{run="r1"}', ("slack-ml",), 30.0)]


def test_escalation_moves_an_alert_to_the_paging_route() -> None:
    g = Grouper(_tree())
    kw: dict[str, Any] = {"kind": "straggler", "ranks": (5,)}
    g.observe(alert(**kw, t=0.0), 0.0)
    assert [n.group_key for n in g.advance(30.0)] == [G_STRAG]
    g.observe(alert(**kw, severity="critical", transition="updated", t=100.0), 100.0)
    assert G_STRAG not in g.groups or not g.groups[G_STRAG].alerts
    notes = g.advance(110.0)
    assert summary(notes) == [('page:{run="r1",kind="straggler"}', 1, 110.0, "new", ["r1/straggler:5:250:0"], [])]


def test_group_by_all_labels_gives_one_group_per_anomaly() -> None:
    g = Grouper(root(group_by=("...",)))
    g.observe(alert(ranks=(5,), t=0.0), 0.0)
    g.observe(alert(ranks=(6,), t=0.0), 0.0)
    assert [len(n.firing) for n in g.advance(30.0)] == [1, 1]


def test_alert_arriving_exactly_at_a_flush_joins_the_next_one() -> None:
    g = Grouper(root())
    g.observe(alert(ranks=(5,), t=100.0), 100.0)
    notes = g.observe(alert(ranks=(6,), t=130.0), 130.0)
    assert summary(notes) == [(G_STRAG, 1, 130.0, "new", ["r1/straggler:5:250:0"], [])]
    assert summary(g.advance(430.0)) == [(G_STRAG, 2, 430.0, "update", ["r1/straggler:5:250:0",
                                                                          "r1/straggler:6:250:0"], [])]


def test_catching_up_after_downtime_flushes_each_group_once() -> None:
    g = Grouper(root())
    g.observe(alert(t=100.0), 100.0)
    assert summary(g.advance(100_000.0)) == [(G_STRAG, 1, 99_730.0, "new", ["r1/straggler:5:250:0"], [])]
    assert g.next_due() == 100_030.0


def test_state_survives_dump_and_load_and_time_never_goes_back() -> None:
    g = Grouper(root())
    g.observe(alert(t=100.0), 100.0)
    g.advance(130.0)
    upserts, deleted = g.take_changes()
    assert list(upserts) == [G_STRAG] and deleted == set()
    h = Grouper(root(), now=g.now)
    h.load(g.dump())
    assert h.observe(alert(t=50.0), 50.0) == []  # an old timestamp is taken as "now" (130)
    h.observe(alert(transition="resolved", status="resolved", end_step=800, t=200.0), 200.0)
    assert summary(h.advance(430.0)) == [(G_STRAG, 2, 430.0, "resolved", [], ["r1/straggler:5:250:0"])]
    assert h.take_changes() == ({}, {G_STRAG})
    # a group whose route left the config is dropped (and reported as deleted)
    other = Grouper(Route("new-root", (), ("ops",), ("run", "kind"), AM))
    other.load(g.dump())
    assert other.groups == {} and other.take_changes() == ({}, {G_STRAG})


def test_the_timeline_in_the_docs() -> None:
    """docs/alerts.md, "When a notification is sent": the example table, with the defaults."""
    g = Grouper(root())
    out = g.observe(alert(ranks=(5,), t=0.0), 0.0)
    out += g.observe(alert(ranks=(6,), t=100.0), 100.0)
    for t in range(101, 15_000):  # a live worker advances the clock every second
        out += g.advance(float(t))
    out += g.observe(alert(ranks=(5,), transition="resolved", status="resolved", end_step=900, t=15_000.0), 15_000.0)
    out += g.observe(alert(ranks=(6,), transition="resolved", status="resolved", end_step=900, t=15_000.0), 15_000.0)
    for t in range(15_001, 16_000):
        out += g.advance(float(t))
    assert [(n.seq, n.at, n.reason, len(n.firing), len(n.resolved)) for n in out] == [
        (1, 30.0, "new", 1, 0), (2, 330.0, "update", 2, 0), (3, 14_730.0, "repeat", 2, 0),
        (4, 15_030.0, "resolved", 0, 2)]
    assert g.groups == {}


def test_dead_rank_inhibits_the_hang_it_causes_and_hang_inhibits_slow_node() -> None:
    g = Grouper(root(), DEFAULT_RULES)
    g.observe(alert(kind="dead_rank", ranks=(7,), severity="critical", step=700, t=100.0), 100.0)
    g.observe(alert(kind="hang", ranks=(), severity="critical", step=700, t=101.0), 101.0)
    g.observe(alert(kind="slow_node", ranks=(8, 9), step=650, t=102.0), 102.0)
    g.observe(alert(kind="hang", run="r2", ranks=(), severity="critical", step=10, t=102.0), 102.0)
    g.observe(alert(kind="slow_node", run="r2", ranks=(8, 9), step=5, t=102.0), 102.0)
    assert sorted(n.group_key for n in g.advance(200.0)) == ['root:{run="r1",kind="dead_rank"}',
                                                             'root:{run="r2",kind="hang"}']


def test_advance_never_spins_where_adding_the_interval_does_not_change_the_time() -> None:
    # At 1e308 (and from about 1e16 on with a 1 s interval) ``ts + interval == ts``: the group stayed due forever.
    fast = Timers(group_wait=0.0, group_interval=1.0, repeat_interval=14400.0)
    g = Grouper(root(timers=fast))
    out: list[list[Notification]] = []
    worker = threading.Thread(target=lambda: out.append(g.observe(alert(t=1e308), 1e308) + g.advance(1e308)),
                              daemon=True)
    worker.start()
    worker.join(5.0)
    assert not worker.is_alive(), "Grouper.advance spins"
    assert summary(out[0]) == [(G_STRAG, 1, 1e308, "new", ["r1/straggler:5:250:0"], [])]
    assert g.next_due() > 1e308
    g2 = Grouper(root(timers=fast), now=2e16)
    g2.observe(alert(t=2e16), 2e16)
    assert [n.reason for n in g2.advance(2e16 + 10)] == ["new"] and g2.next_due() > 2e16 + 10
    assert g2.advance(2e16 + 20) == []


def test_advance_refuses_a_time_that_is_not_finite() -> None:
    g = Grouper(root())
    for bad in (float("inf"), float("nan")):
        try:
            g.advance(bad)
        except ValueError as exc:
            assert str(exc) == f"time {bad!r} is not a finite unix time"
        else:
            raise AssertionError(f"advance({bad!r}) accepted")
    assert g.now == 0.0


def test_a_quiet_alert_is_tracked_without_notifying_and_survives_dump_and_load() -> None:
    g = Grouper(root())
    assert g.observe(alert(t=100.0), 100.0, quiet=True) == []
    assert g.observe(alert(kind="restart", ranks=(), step=9, status="resolved", end_step=9, t=100.0), 100.0,
                     quiet=True) == []  # a stale point event is dropped
    assert g.advance(130.0) == [] and g.advance(20_000.0) == []  # no first notification, no repeat
    assert (g.groups[G_STRAG].quiet, g.groups[G_STRAG].notified) == ({"r1/straggler:5:250:0": "warning"}, {})
    restored = Grouper(root(), now=g.now)
    restored.load(g.dump())
    # another rank is news: the notification shows every firing alert, the quiet one included
    restored.observe(alert(ranks=(6,), t=20_100.0), 20_100.0)
    assert summary(restored.advance(20_230.0)) == [(G_STRAG, 1, 20_230.0, "new", ["r1/straggler:5:250:0",
                                                                                  "r1/straggler:6:250:0"], [])]
    assert restored.groups[G_STRAG].quiet == {}  # shown as firing: its resolve is reported from now on
    restored.observe(alert(transition="resolved", status="resolved", end_step=800, t=20_300.0), 20_300.0)
    assert summary(restored.advance(20_530.0)) == [(G_STRAG, 2, 20_530.0, "update", ["r1/straggler:6:250:0"],
                                                    ["r1/straggler:5:250:0"])]


def test_the_alerts_of_runs_that_are_over_are_muted_but_their_resolves_go_out() -> None:
    g = Grouper(root())
    g.observe(alert(t=100.0), 100.0)
    assert [n.seq for n in g.advance(130.0)] == [1]
    g.ended_runs = frozenset({"r1"})
    assert g.muted(g.groups[G_STRAG].alerts["r1/straggler:5:250:0"], 200.0) == "run over"
    g.observe(alert(ranks=(6,), t=200.0), 200.0)
    assert g.advance(14_530.0) == []  # neither the new rank nor the repeat
    g.observe(alert(transition="resolved", status="resolved", end_step=800, t=14_600.0), 14_600.0)
    assert summary(g.advance(14_830.0)) == [(G_STRAG, 2, 14_830.0, "resolved", [], ["r1/straggler:5:250:0"])]
