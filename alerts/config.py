"""The alerting config file (TOML, read with :mod:`tomllib`), validated with errors naming file, key and value.

Layout (full example with comments: ``docs/alerts.example.toml``; reference: ``docs/alerts.md``)::

    dashboard_url = "http://dash.example:8501"   # base of the links in notifications

    [route]                      # the root route: Alertmanager's routing tree
    receivers = ["oncall-slack"]
    group_by = ["run", "kind"]   # default
    group_wait = "30s"           # defaults: Alertmanager's 30s / 5m / 4h
    group_interval = "5m"
    repeat_interval = "4h"

    [[route.routes]]             # children, first match wins unless continue = true
    matchers = ['severity="critical"']
    receivers = ["pagerduty", "oncall-slack"]

    [[inhibit_rules]]            # omitted: trainhealth.alerts.inhibition.DEFAULT_RULES; [] disables
    source_matchers = ['kind="hang"']
    target_matchers = ['kind="straggler"']
    equal = ["run"]

    [sinks.oncall-slack]
    type = "slack"
    url_env = "TH_SLACK_WEBHOOK_URL"   # secrets: *_env or *_file, never in the file itself

    [delivery]                   # retries: max_attempts, backoff_base, backoff_max, jitter, retry_after_max
    [watchdog]                   # service_down = true, service_stale = "60s"
    [deadman]                    # url_env/url_file/url, interval = "60s": ping while healthy

Durations are Alertmanager duration strings (``30s``, ``5m``, ``4h``, ``1h30m``, ``1d``, ``500ms``) or
numbers of seconds. Every error is a :class:`~trainhealth.exceptions.ConfigError` reading
``<file>: <key> = <value>: <what is wrong>``; secret values are never quoted.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainhealth import defaults
from trainhealth.alerts import secrets as _secrets
from trainhealth.alerts.inhibition import DEFAULT_RULES, InhibitRule
from trainhealth.alerts.routing import Route, Timers
from trainhealth.alerts.secrets import Secret
from trainhealth.alerts.sinks import SINK_TYPES, Sink
from trainhealth.alerts.sinks.pagerduty import DEFAULT_URL as PAGERDUTY_URL
from trainhealth.exceptions import ConfigError
from trainhealth.matchers import LABELS, Matcher, MatcherError
from trainhealth.text import parse_duration

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

#: The longest duration a setting takes (s): longer is a typo that would keep its alerts from ever firing.
MAX_DURATION_S = 366 * 86400
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_TOP_KEYS = ("version", "dashboard_url", "backfill", "route", "inhibit_rules", "sinks", "delivery", "watchdog",
             "deadman")
_ROUTE_KEYS = ("name", "matchers", "receivers", "group_by", "group_wait", "group_interval", "repeat_interval",
               "continue", "routes")
_SINK_COMMON = ("type", "send_resolved", "timeout", "url", "url_env", "url_file")
_SINK_SECRETS = {"slack": (), "webhook": ("secret",), "pagerduty": ("routing_key",)}


@dataclass(frozen=True)
class DeliveryConfig:
    """Retry policy (seconds): see :func:`trainhealth.alerts.outbox.backoff_delay`."""

    max_attempts: int = defaults.ALERT_MAX_ATTEMPTS
    backoff_base: float = defaults.ALERT_BACKOFF_BASE_S
    backoff_max: float = defaults.ALERT_BACKOFF_MAX_S
    jitter: float = defaults.ALERT_BACKOFF_JITTER
    retry_after_max: float = defaults.ALERT_RETRY_AFTER_MAX_S


@dataclass(frozen=True)
class WatchdogConfig:
    """Raise ``service_down`` when ranks heartbeat but no detector service did for ``service_stale`` s."""

    service_down: bool = True
    service_stale: float = defaults.ALERT_SERVICE_STALE_S


@dataclass(frozen=True)
class DeadmanConfig:
    """External dead-man's switch: POST to ``url`` every ``interval`` s while the worker and the service are healthy."""

    url: Secret
    interval: float = 60.0
    timeout: float = defaults.ALERT_HTTP_TIMEOUT_S


@dataclass(frozen=True)
class AlertsConfig:
    """A validated alerting config. Build with :func:`load` (a file) or :func:`parse` (a dict)."""

    path: str
    route: Route
    sinks: dict[str, Sink]
    inhibit_rules: tuple[InhibitRule, ...] = DEFAULT_RULES
    dashboard_url: str = defaults.ALERT_DASHBOARD_URL
    delivery: DeliveryConfig = field(default_factory=DeliveryConfig)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    deadman: DeadmanConfig | None = None
    backfill: float = defaults.ALERT_BACKFILL_S

    def secrets(self) -> list[Secret]:
        out = [s for sink in self.sinks.values() for s in sink.secrets()]
        if self.deadman is not None:
            out.append(self.deadman.url)
        return out

    def describe(self) -> str:
        """Multi-line summary for ``trainhealth alerts --check``: no secret values, only their sources."""
        lines = [f"config {self.path}: dashboard links to {self.dashboard_url}"]
        for r in self.route.walk():
            t = r.timers
            lines.append(f"  route {r.id}: {' '.join(map(str, r.matchers)) or '(all alerts)'} -> "
                         f"{', '.join(r.receivers) or '(nowhere)'}; group_by {', '.join(r.group_by)}; "
                         f"wait {t.group_wait:g} s, interval {t.group_interval:g} s, repeat {t.repeat_interval:g} s"
                         + ("; continue" if r.continue_ else ""))
        for rule in self.inhibit_rules:
            lines.append(f"  inhibit: {' '.join(map(str, rule.source_matchers))} mutes "
                         f"{' '.join(map(str, rule.target_matchers))} with equal {', '.join(rule.equal) or '-'}")
        for sink in self.sinks.values():
            d = sink.describe()
            src = ", ".join(f"{k} from {v}" for k, v in d["secrets"].items())
            lines.append(f"  sink {sink.name}: {sink.type}, send_resolved={str(sink.send_resolved).lower()}, "
                         f"timeout {sink.timeout:g} s; {src}")
        d = self.delivery
        lines.append(f"  delivery: {d.max_attempts} tries, backoff {d.backoff_base:g} s doubling to "
                     f"{d.backoff_max:g} s, jitter {d.jitter:g}, Retry-After capped at {d.retry_after_max:g} s")
        if self.deadman is not None:
            lines.append(f"  deadman: ping every {self.deadman.interval:g} s, url from {self.deadman.url.source}")
        return "\n".join(lines)


class _Ctx:
    """Error helper: knows the file name; formats ``<file>: <key> = <value>: <problem>``."""

    def __init__(self, path: str, base: Path) -> None:
        self.path = path
        self.base = base

    def error(self, key: str, problem: str, value: Any = None, show: bool = True) -> ConfigError:
        shown = f" = {_show(value)}" if show and value is not None else ""
        return ConfigError(f"{self.path}: {key}{shown}: {problem}")

    def table(self, value: Any, key: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.error(key, "must be a table", value)
        return value

    def keys(self, table: Mapping[str, Any], key: str, allowed: tuple[str, ...]) -> None:
        for k in table:
            if k not in allowed:
                where = f"{key}.{k}" if key else k
                raise self.error(where, f"unknown key (expected one of: {', '.join(allowed)})")

    def duration(self, table: Mapping[str, Any], key: str, name: str, default: float, minimum: float = 0.0,
                 strict_min: bool = False) -> float:
        if name not in table:
            return default
        value = table[name]
        secs = parse_duration(value)
        where = f"{key}.{name}" if key else name
        if secs is None:
            raise self.error(where, "not a duration (use e.g. 30s, 5m, 4h, 1h30m, 1d, or a number of seconds)", value)
        if secs < minimum or (strict_min and secs == minimum):
            raise self.error(where, f"must be {'>' if strict_min else '>='} {minimum:g} s", value)
        if secs > MAX_DURATION_S:  # a typo ("99999999d") would silence the alerts it times
            raise self.error(where, f"must be at most {MAX_DURATION_S // 86400} days", value)
        return secs

    def boolean(self, table: Mapping[str, Any], key: str, name: str, default: bool) -> bool:
        value = table.get(name, default)
        if not isinstance(value, bool):
            raise self.error(f"{key}.{name}" if key else name, "must be true or false", value)
        return value

    def strings(self, table: Mapping[str, Any], key: str, name: str) -> list[str] | None:
        if name not in table:
            return None
        value = table[name]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.error(f"{key}.{name}", "must be a list of strings", value)
        return value

    def matchers(self, table: Mapping[str, Any], key: str, name: str) -> tuple[Matcher, ...]:
        out = []
        for i, text in enumerate(self.strings(table, key, name) or []):
            try:
                out.append(Matcher.parse(text))
            except MatcherError as exc:
                raise self.error(f"{key}.{name}[{i}]", str(exc), text) from None
        return tuple(out)


def _show(value: Any) -> str:
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value)


def _url_ok(url: str) -> bool:
    return url.startswith(("http://", "https://")) and len(url) > len("https://")


def _secret(ctx: _Ctx, table: Mapping[str, Any], key: str, name: str, *, plain_ok: bool, required: bool,
            url: bool, default: str | None = None) -> Secret | None:
    """Resolve ``name`` / ``name_env`` / ``name_file`` (exactly one) of ``table`` at ``key``."""
    given = [k for k in (name, f"{name}_env", f"{name}_file") if k in table]
    if len(given) > 1:
        raise ctx.error(key, f"give only one of {', '.join(given)}")
    if not given:
        if default is not None:
            return Secret(default, "default")
        if required:
            raise ctx.error(key, f"missing {name}_env (environment variable) or {name}_file (file holding it)")
        return None
    k = given[0]
    value = table[k]
    where = f"{ctx.path}: {key}.{k}"
    if not isinstance(value, str) or not value.strip():
        raise ctx.error(f"{key}.{k}", "must be a non-empty string", value if k != name else None, show=k != name)
    if k == name:
        if not plain_ok:
            raise ctx.error(f"{key}.{k}", f"is a secret and must not be written in the file: set {name}_env or "
                            f"{name}_file instead (value not shown)")
        secret = Secret(value.strip(), "config file")
    elif k.endswith("_env"):
        secret = _secrets.from_env(value, where)
    else:
        secret = _secrets.from_file(value, where, ctx.base)
    if url and not _url_ok(secret.reveal()):
        shown = f" = {_show(value)}" if k == name else f" (from {secret.source}; value not shown)"
        raise ConfigError(f"{ctx.path}: {key}.{k}{shown}: not an http:// or https:// URL")
    return secret


def _sink(ctx: _Ctx, name: str, table: Any, dashboard_url: str) -> Sink:
    key = f"sinks.{name}"
    if not _NAME.match(name):
        raise ctx.error(key, "sink names are 1-64 letters, digits, '_', '.', '-'")
    table = ctx.table(table, key)
    kind = table.get("type")
    if kind not in SINK_TYPES:
        raise ctx.error(f"{key}.type", f"must be one of {', '.join(SINK_TYPES)}", kind)
    cls = SINK_TYPES[kind]
    secret_names = _SINK_SECRETS[kind]
    allowed = _SINK_COMMON + tuple(f"{s}{suf}" for s in secret_names for suf in ("_env", "_file")) + cls.OPTIONS
    ctx.keys(table, key, allowed)
    kw: dict[str, Any] = {
        "send_resolved": ctx.boolean(table, key, "send_resolved", True),
        "timeout": ctx.duration(table, key, "timeout", defaults.ALERT_HTTP_TIMEOUT_S, 0.0, strict_min=True),
        "dashboard_url": dashboard_url,
    }
    kw["url"] = _secret(ctx, table, key, "url", plain_ok=kind != "slack", required=True, url=True,
                        default=PAGERDUTY_URL if kind == "pagerduty" else None)
    for s in secret_names:
        kw[s] = _secret(ctx, table, key, s, plain_ok=False, required=True, url=False)
    if "max_alerts" in table:
        v = table["max_alerts"]
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 7:
            raise ctx.error(f"{key}.max_alerts", "must be an integer from 1 to 7 (Slack allows 50 blocks)", v)
        kw["max_alerts"] = v
    return cls(name, **kw)


def _route(ctx: _Ctx, table: Any, key: str, rid: str, parent: Route | None, sinks: Mapping[str, Sink],
           names: set[str]) -> Route:
    table = ctx.table(table, key)
    allowed = _ROUTE_KEYS if parent is not None else tuple(k for k in _ROUTE_KEYS if k not in ("matchers",
                                                                                                "continue"))
    ctx.keys(table, key, allowed)
    name = table.get("name")
    if name is not None:
        if not isinstance(name, str) or not _NAME.match(name):
            raise ctx.error(f"{key}.name", "route names are 1-64 letters, digits, '_', '.', '-'", name)
        if name in names:
            raise ctx.error(f"{key}.name", "another route has this name", name)
        names.add(name)
        rid = name
    receivers = ctx.strings(table, key, "receivers")
    if receivers is None:
        if parent is None:
            raise ctx.error(f"{key}.receivers", "missing: list the sinks of the root route (may be [])")
        receivers = list(parent.receivers)
    for i, r in enumerate(receivers):
        if r not in sinks:
            raise ctx.error(f"{key}.receivers[{i}]", f"no sink of this name (sinks: {', '.join(sinks) or 'none'})", r)
    group_by = ctx.strings(table, key, "group_by")
    if group_by is None:
        group_by = list(parent.group_by) if parent else list(defaults.ALERT_GROUP_BY)
    if group_by != ["..."]:
        for i, lb in enumerate(group_by):
            if lb not in LABELS:
                raise ctx.error(f"{key}.group_by[{i}]", f"not an alert label (labels: {', '.join(LABELS)}; "
                                "or [\"...\"] for one group per anomaly)", lb)
        if len(set(group_by)) != len(group_by):
            raise ctx.error(f"{key}.group_by", "repeats a label", group_by)
    pt = parent.timers if parent else Timers(defaults.ALERT_GROUP_WAIT_S, defaults.ALERT_GROUP_INTERVAL_S,
                                             defaults.ALERT_REPEAT_INTERVAL_S)
    timers = Timers(ctx.duration(table, key, "group_wait", pt.group_wait),
                    ctx.duration(table, key, "group_interval", pt.group_interval, 0.0, strict_min=True),
                    ctx.duration(table, key, "repeat_interval", pt.repeat_interval, 0.0, strict_min=True))
    route = Route(id=rid, matchers=ctx.matchers(table, key, "matchers") if parent else (),
                  receivers=tuple(receivers), group_by=tuple(group_by), timers=timers,
                  continue_=ctx.boolean(table, key, "continue", False) if parent else False)
    children = table.get("routes", [])
    if not isinstance(children, list):
        raise ctx.error(f"{key}.routes", "must be an array of tables ([[...routes]])", children)
    kids = tuple(_route(ctx, c, f"{key}.routes[{i}]", f"{rid}.{i}", route, sinks, names)
                 for i, c in enumerate(children))
    return Route(route.id, route.matchers, route.receivers, route.group_by, route.timers, route.continue_, kids)


def _inhibit(ctx: _Ctx, rules: Any) -> tuple[InhibitRule, ...]:
    if not isinstance(rules, list):
        raise ctx.error("inhibit_rules", "must be an array of tables ([[inhibit_rules]]) or []", rules)
    out = []
    for i, t in enumerate(rules):
        key = f"inhibit_rules[{i}]"
        t = ctx.table(t, key)
        ctx.keys(t, key, ("source_matchers", "target_matchers", "equal"))
        src, dst = ctx.matchers(t, key, "source_matchers"), ctx.matchers(t, key, "target_matchers")
        if not src or not dst:
            raise ctx.error(key, "needs non-empty source_matchers and target_matchers")
        equal = ctx.strings(t, key, "equal")
        equal = ["run"] if equal is None else equal
        for j, lb in enumerate(equal):
            if lb not in LABELS:
                raise ctx.error(f"{key}.equal[{j}]", f"not an alert label ({', '.join(LABELS)})", lb)
        out.append(InhibitRule(src, dst, tuple(equal)))
    return tuple(out)


def parse(data: Mapping[str, Any], path: str = "<config>", base: Path | None = None) -> AlertsConfig:
    """Validate a decoded TOML document. Raises :class:`ConfigError` naming ``path``, the key and the value."""
    ctx = _Ctx(path, base or Path.cwd())
    ctx.keys(data, "", _TOP_KEYS)
    if "version" in data and data["version"] != 1:
        raise ctx.error("version", "only version 1 exists", data["version"])
    dashboard_url = data.get("dashboard_url", defaults.ALERT_DASHBOARD_URL)
    if not isinstance(dashboard_url, str) or not _url_ok(dashboard_url):
        raise ctx.error("dashboard_url", "must be an http:// or https:// URL", dashboard_url)
    sinks_t = ctx.table(data.get("sinks", {}), "sinks")
    sinks = {name: _sink(ctx, name, t, dashboard_url) for name, t in sinks_t.items()}
    if "route" not in data:
        raise ctx.error("route", "missing: add a [route] table with receivers = [...]")
    route = _route(ctx, data["route"], "route", "root", None, sinks, set())
    inhibit = _inhibit(ctx, data["inhibit_rules"]) if "inhibit_rules" in data else DEFAULT_RULES
    d = ctx.table(data.get("delivery", {}), "delivery")
    ctx.keys(d, "delivery", ("max_attempts", "backoff_base", "backoff_max", "jitter", "retry_after_max"))
    attempts = d.get("max_attempts", defaults.ALERT_MAX_ATTEMPTS)
    if isinstance(attempts, bool) or not isinstance(attempts, int) or not 1 <= attempts <= 100:
        raise ctx.error("delivery.max_attempts", "must be an integer from 1 to 100", attempts)
    jitter = d.get("jitter", defaults.ALERT_BACKOFF_JITTER)
    if isinstance(jitter, bool) or not isinstance(jitter, (int, float)) or not 0 <= jitter <= 1:
        raise ctx.error("delivery.jitter", "must be a number from 0 (none) to 1 (full jitter)", jitter)
    base_s = ctx.duration(d, "delivery", "backoff_base", defaults.ALERT_BACKOFF_BASE_S, 0.0, strict_min=True)
    max_s = ctx.duration(d, "delivery", "backoff_max", defaults.ALERT_BACKOFF_MAX_S, base_s)
    delivery = DeliveryConfig(attempts, base_s, max_s, float(jitter),
                              ctx.duration(d, "delivery", "retry_after_max", defaults.ALERT_RETRY_AFTER_MAX_S, 0.0,
                                           strict_min=True))
    w = ctx.table(data.get("watchdog", {}), "watchdog")
    ctx.keys(w, "watchdog", ("service_down", "service_stale"))
    watchdog = WatchdogConfig(ctx.boolean(w, "watchdog", "service_down", True),
                              ctx.duration(w, "watchdog", "service_stale", defaults.ALERT_SERVICE_STALE_S, 0.0,
                                           strict_min=True))
    deadman = None
    if "deadman" in data:
        dm = ctx.table(data["deadman"], "deadman")
        ctx.keys(dm, "deadman", ("url", "url_env", "url_file", "interval", "timeout"))
        url = _secret(ctx, dm, "deadman", "url", plain_ok=True, required=True, url=True)
        deadman = DeadmanConfig(url, ctx.duration(dm, "deadman", "interval", 60.0, 0.0, strict_min=True),  # type: ignore[arg-type]
                                ctx.duration(dm, "deadman", "timeout", defaults.ALERT_HTTP_TIMEOUT_S, 0.0,
                                             strict_min=True))
    backfill = ctx.duration(data, "", "backfill", defaults.ALERT_BACKFILL_S)
    return AlertsConfig(path=path, route=route, sinks=sinks, inhibit_rules=inhibit, dashboard_url=dashboard_url,
                        delivery=delivery, watchdog=watchdog, deadman=deadman, backfill=backfill)


def load(path: str | Path) -> AlertsConfig:
    """Read and validate the TOML file at ``path``.

    Raises
    ------
    ConfigError
        Unreadable file, TOML syntax error (with line and column), or any invalid key/value (file, key, value).
    """
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read the alerts config ({exc.strerror or exc})") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{p}: not valid TOML: {exc}") from None
    return parse(data, str(p), p.resolve().parent)
