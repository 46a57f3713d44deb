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

    [sinks.team-am]              # hand the alerts to an Alertmanager (re-sent while active, resolved with endsAt)
    type = "alertmanager"
    url = "http://alertmanager.example:9093"

    [delivery]                   # retries: max_attempts, backoff_base, backoff_max, jitter, retry_after_max
    [watchdog]                   # service_down = true, service_stale = "60s"
    [deadman]                    # url_env/url_file/url, interval = "60s": ping while healthy

Durations are Alertmanager duration strings (``30s``, ``5m``, ``4h``, ``1h30m``, ``1d``, ``500ms``) or
numbers of seconds. Every error is a :class:`~trainhealth.exceptions.ConfigError` reading
``<file>: <key> = <value>: <what is wrong>``; secret values are never quoted.

Validation has two stages. **Shape**: :class:`RawConfig` and the tables under it are :class:`msgspec.Struct`
types declaring each table's keys and each value's type, checked by :func:`msgspec.convert` (``strict=True``);
a fault it reports (``Expected `array | null`, got `str` - at `$.route.group_by```) is put in this module's
words, one per declared type (``_PROBLEMS``). **Meaning**, on the typed values: durations
(:func:`~trainhealth.text.parse_duration`, at most :data:`MAX_DURATION_S`), secrets
(:mod:`~trainhealth.alerts.secrets`), matchers (:mod:`~trainhealth.matchers`), receivers naming sinks, label
names, unique route names. A file with several mistakes gets the first in the order of the second stage (msgspec
stops at the first in the order of the file): the first stage records every fault, and the second reports one
when it reaches its key.
"""

from __future__ import annotations

import copy
import re
import sys
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Union, get_args, get_origin

import msgspec
from msgspec import Meta

from trainhealth import defaults
from trainhealth.alerts import secrets as _secrets
from trainhealth.alerts.inhibition import DEFAULT_RULES, InhibitRule
from trainhealth.alerts.routing import Route, Timers
from trainhealth.alerts.secrets import Secret
from trainhealth.alerts.sinks import SINK_TYPES, Sink
from trainhealth.alerts.sinks.alertmanager import ALERT_LABELS, LABEL_NAME
from trainhealth.alerts.sinks.pagerduty import DEFAULT_URL as PAGERDUTY_URL
from trainhealth.config import redact_url
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
        """Every secret of the config (the sinks', the dead-man's switch URL), for redacting them from text."""
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
                         f"timeout {sink.timeout:g} s; {src}" + (f"; {d['note']}" if d.get("note") else ""))
        d = self.delivery
        lines.append(f"  delivery: {d.max_attempts} tries, backoff {d.backoff_base:g} s doubling to "
                     f"{d.backoff_max:g} s, jitter {d.jitter:g}, Retry-After capped at {d.retry_after_max:g} s")
        if self.deadman is not None:
            lines.append(f"  deadman: ping every {self.deadman.interval:g} s, url from {self.deadman.url.source}")
        return "\n".join(lines)


# Stage 1: the shape. A key absent from the file is None (stage 2 supplies the default, or the parent's value).

#: An Alertmanager duration string (``1h30m``) or a number of seconds (true/false are neither).
Duration = Annotated[str | float | int, Meta(description="duration")]
Url = Annotated[str, Meta(description="http:// or https:// URL")]
RouteName = Annotated[str, Meta(pattern=_NAME.pattern)]
#: A secret written in the file itself (some URLs may be); never quoted in an error.
SecretValue = Annotated[str, Meta(pattern=r"\S", description="secret")]
#: Where a secret is: ``*_env`` an environment variable, ``*_file`` a file (relative to the config's folder).
SecretSource = Annotated[str, Meta(pattern=r"\S", description="secret source")]
MaxAlerts = Annotated[int, Meta(ge=1, le=7)]
#: An HTTP basic auth user name: no ':' (RFC 7617 §2), no blank.
UserName = Annotated[str, Meta(pattern=r"^[^:\s]+$")]
#: Labels added to every alert of an Alertmanager sink: names to values.
ExtraLabels = Annotated[dict[str, str], Meta(description="labels")]
Attempts = Annotated[int, Meta(ge=1, le=100)]
Jitter = Annotated[float, Meta(ge=0, le=1)]


class _Table(msgspec.Struct, forbid_unknown_fields=True):
    """A TOML table: its keys are its fields, in the order an unknown key's error lists them."""


class RawChildRoute(_Table):
    """``[[route.routes]]`` (and their own ``routes``): absent settings are the parent route's."""

    name: RouteName | None = None
    matchers: list[str] | None = None
    receivers: list[str] | None = None
    group_by: list[str] | None = None
    group_wait: Duration | None = None
    group_interval: Duration | None = None
    repeat_interval: Duration | None = None
    continue_: bool = msgspec.field(default=False, name="continue")
    routes: list[RawChildRoute] = []


class RawRoute(_Table):
    """``[route]``, the root of the routing tree: it takes every alert (no ``matchers``, no ``continue``)."""

    name: RouteName | None = None
    receivers: list[str] | None = None
    group_by: list[str] | None = None
    group_wait: Duration | None = None
    group_interval: Duration | None = None
    repeat_interval: Duration | None = None
    routes: list[RawChildRoute] = []


class RawInhibitRule(_Table):
    """One ``[[inhibit_rules]]``."""

    source_matchers: list[str] | None = None
    target_matchers: list[str] | None = None
    equal: list[str] | None = None


class RawSink(_Table, tag_field="type"):
    """``[sinks.<name>]``, told apart by ``type``: the keys of every sink, then those of its type."""

    #: Secrets besides ``url``, each given as ``<name>_env`` or ``<name>_file``.
    SECRETS: ClassVar[tuple[str, ...]] = ()
    #: The same, for secrets that may be left out.
    OPTIONAL_SECRETS: ClassVar[tuple[str, ...]] = ()
    #: Whether ``url`` may be written in the file; the URL when none is given.
    PLAIN_URL: ClassVar[bool] = True
    DEFAULT_URL: ClassVar[str | None] = None

    send_resolved: bool = True
    timeout: Duration | None = None
    url: SecretValue | None = None
    url_env: SecretSource | None = None
    url_file: SecretSource | None = None


class RawSlackSink(RawSink, tag="slack"):
    """A Slack incoming webhook: its URL is the secret."""

    PLAIN_URL = False
    max_alerts: MaxAlerts | None = None  # the sink class's OPTIONS


class RawWebhookSink(RawSink, tag="webhook"):
    """A JSON webhook signed with ``secret``."""

    SECRETS = ("secret",)
    secret_env: SecretSource | None = None
    secret_file: SecretSource | None = None


class RawPagerDutySink(RawSink, tag="pagerduty"):
    """PagerDuty Events API v2."""

    SECRETS = ("routing_key",)
    DEFAULT_URL = PAGERDUTY_URL
    routing_key_env: SecretSource | None = None
    routing_key_file: SecretSource | None = None


class RawAlertmanagerSink(RawSink, tag="alertmanager"):
    """A Prometheus Alertmanager (API v2): optional basic auth or bearer token, the resend interval, extra labels."""

    OPTIONAL_SECRETS = ("password", "bearer_token")
    username: UserName | None = None
    password_env: SecretSource | None = None
    password_file: SecretSource | None = None
    bearer_token_env: SecretSource | None = None
    bearer_token_file: SecretSource | None = None
    resend_interval: Duration | None = None
    labels: ExtraLabels | None = None


#: A sink's table, by ``type`` (in the order of :data:`~trainhealth.alerts.sinks.SINK_TYPES`).
RawSinkTable = RawSlackSink | RawWebhookSink | RawPagerDutySink | RawAlertmanagerSink


class RawDelivery(_Table):
    """``[delivery]``."""

    max_attempts: Attempts = defaults.ALERT_MAX_ATTEMPTS
    backoff_base: Duration | None = None
    backoff_max: Duration | None = None
    jitter: Jitter = defaults.ALERT_BACKOFF_JITTER
    retry_after_max: Duration | None = None


class RawWatchdog(_Table):
    """``[watchdog]``."""

    service_down: bool = True
    service_stale: Duration | None = None


class RawDeadman(_Table):
    """``[deadman]``."""

    url: SecretValue | None = None
    url_env: SecretSource | None = None
    url_file: SecretSource | None = None
    interval: Duration | None = None
    timeout: Duration | None = None


class RawConfig(_Table):
    """The whole document. Each sink's table is converted on its own (:data:`RawSinkTable`), when the checks reach
    it: msgspec's paths do not name the key of a table's entry (``$.sinks[...]``)."""

    version: Any = 1  # any value is compared with 1, the only version
    dashboard_url: Url = defaults.ALERT_DASHBOARD_URL
    backfill: Duration | None = None
    route: RawRoute | None = None
    inhibit_rules: list[RawInhibitRule] | None = None
    sinks: dict[str, Any] = {}
    delivery: RawDelivery = msgspec.field(default_factory=RawDelivery)
    watchdog: RawWatchdog = msgspec.field(default_factory=RawWatchdog)
    deadman: RawDeadman | None = None


#: What is wrong with a value not of its declared type, by that type. Besides: a table (a Struct) "must be a
#: table", a sink's ``type`` "must be one of" its values, an undeclared key is "unknown key (expected one of: ...)".
_PROBLEMS: dict[Any, str] = {
    bool: "must be true or false",
    list[str]: "must be a list of strings",
    Duration: "not a duration (use e.g. 30s, 5m, 4h, 1h30m, 1d, or a number of seconds)",
    Url: "must be an http:// or https:// URL",
    RouteName: "route names are 1-64 letters, digits, '_', '.', '-'",
    SecretValue: "must be a non-empty string",
    SecretSource: "must be a non-empty string",
    MaxAlerts: "must be an integer from 1 to 7 (Slack allows 50 blocks)",
    UserName: "must be a user name without ':' or blanks",
    ExtraLabels: "must be a table of label names to string values",
    Attempts: "must be an integer from 1 to 100",
    Jitter: "must be a number from 0 (none) to 1 (full jitter)",
    list[RawChildRoute]: "must be an array of tables ([[...routes]])",
    list[RawInhibitRule]: "must be an array of tables ([[inhibit_rules]]) or []",
}
#: Declared types whose value an error never quotes.
_UNQUOTED = (SecretValue,)
_UNKNOWN, _MISSING = "Object contains unknown field `", "Object missing required field `"
_STEP = re.compile(r"\.(\w+)|\[(\d+)\]")


def _options(tp: Any) -> tuple[Any, ...]:
    """The types of a union but None (``X | None``: ``(X,)``); ``(tp,)`` for a type that is no union."""
    args = get_args(tp) if get_origin(tp) in (Union, types.UnionType) else (tp,)
    return tuple(a for a in args if a is not type(None))


def _plain(tp: Any) -> Any:
    """``X`` for ``X | None``, else ``tp``."""
    opts = _options(tp)
    return opts[0] if len(opts) == 1 else tp


def _structs(tp: Any) -> list[type[msgspec.Struct]]:
    """The tables a value of type ``tp`` may be: ``[S]`` for ``S | None``, the members of a tagged union."""
    return [t for t in _options(tp) if get_origin(t) is None and isinstance(t, type) and issubclass(t, msgspec.Struct)]


def _keys(tp: Any, table: Any) -> dict[str, Any]:
    """The keys a table of type ``tp`` takes, in order, with their types; for a tagged union, the tag (a Literal
    of its values) and the keys of the member ``table`` names."""
    structs = _structs(tp)
    tag, keys = structs[0].__struct_config__.tag_field, {}
    if tag is not None:
        keys[tag] = Literal[tuple(s.__struct_config__.tag for s in structs)]
        structs = [s for s in structs if table.get(tag) == s.__struct_config__.tag]
    for s in structs[:1]:
        keys.update((f.encode_name, f.type) for f in msgspec.structs.fields(s))
    return keys


def _problem(tp: Any) -> str:
    """What is wrong with a value that is not of type ``tp``."""
    if get_origin(tp) is Literal:
        return f"must be one of {', '.join(get_args(tp))}"
    if _structs(tp) or get_origin(_plain(tp)) is dict:
        return "must be a table"
    return _PROBLEMS[_plain(tp)]


def _locate(tp: Any, raw: Any, key: str, steps: list[str | int]) -> tuple[str, Any, Any, Any, str | int | None]:
    """Where the fault at the path ``steps`` of table ``raw`` (type ``tp``, at ``key``) belongs: to the innermost key
    or entry of an array of tables on the path (a bad entry of a list of strings is the list's fault). Returns its
    key, declared type and value, and what holds it (a table or array; None for ``raw`` itself) with the step."""
    found: tuple[str, Any, Any, Any, str | int | None] = (key, tp, raw, None, None)
    for step in steps:
        holder = raw
        if isinstance(step, str):
            tp, raw, key = _keys(tp, raw)[step], raw.get(step), _dot(key, step)  # get: a missing tag is None
        else:
            tp, raw, key = get_args(_plain(tp))[0], raw[step], f"{key}[{step}]"
        if isinstance(step, str) or _structs(tp):
            found = (key, tp, raw, holder, step)
    return found


def _dot(key: str, name: str) -> str:
    return f"{key}.{name}" if key else name


class _Ctx:
    """The file and its faults: formats ``<file>: <key> = <value>: <problem>``; stage 1 records, stage 2 reports."""

    def __init__(self, path: str, base: Path) -> None:
        self.path = path
        self.base = base
        self.faults: dict[str, ConfigError] = {}

    def error(self, key: str, problem: str, value: Any = None, show: bool = True) -> ConfigError:
        shown = f" = {_show(value)}" if show and value is not None else ""
        return ConfigError(f"{self.path}: {key}{shown}: {problem}")

    def convert(self, raw: Any, cls: Any, key: str) -> Any:
        """Stage 1: the table ``raw`` (at ``key``) as ``cls``, each fault recorded under its key (see :meth:`shape`).

        The bad value is cut out of a copy of ``raw`` and the copy converted again, until it converts. Raises at
        once when ``raw`` is no table or its ``type`` is unknown: stage 2 would check that first.
        """
        raw = copy.deepcopy(raw)
        while True:
            try:
                return msgspec.convert(raw, cls, strict=True)
            except msgspec.ValidationError as exc:
                message, _, path = str(exc).partition(" - at `$")
                steps: list[str | int] = [name or int(i) for name, i in _STEP.findall(path)]
                if message.startswith(_MISSING):  # the tag: the only required key
                    steps.append(message[len(_MISSING):-1])
                at, tp, value, holder, step = _locate(cls, raw, key, steps)
                if message.startswith(_UNKNOWN):  # recorded under the table: checked before its keys
                    name = message[len(_UNKNOWN):-1]
                    self.faults.setdefault(at, self.error(_dot(at, name), "unknown key (expected one of: "
                                                          f"{', '.join(_keys(tp, value))})"))
                    del value[name]
                    continue
                fault = self.error(at, _problem(tp), value, show=_plain(tp) not in _UNQUOTED)
                if holder is None or get_origin(tp) is Literal:
                    raise fault from None
                self.faults.setdefault(at, fault)
                if isinstance(step, int):  # an entry of an array of tables: emptied, the next keep their index
                    holder[step] = {}
                else:
                    del holder[step]

    def shape(self, key: str, value: Any = None) -> Any:
        """Stage 2 reaches ``key``: raise the fault stage 1 found there (a table's: no table, an unknown key in
        it), else return ``value``, the typed value at ``key``."""
        if key in self.faults:
            raise self.faults[key]
        return value

    def duration(self, key: str, value: Any, default: float, minimum: float = 0.0, strict_min: bool = False) -> float:
        if self.shape(key, value) is None:
            return default
        secs = parse_duration(value)
        if secs is None:
            raise self.error(key, _PROBLEMS[Duration], value)
        if secs < minimum or (strict_min and secs == minimum):
            raise self.error(key, f"must be {'>' if strict_min else '>='} {minimum:g} s", value)
        if secs > MAX_DURATION_S:  # a typo ("99999999d") would silence the alerts it times
            raise self.error(key, f"must be at most {MAX_DURATION_S // 86400} days", value)
        return secs

    def matchers(self, key: str, texts: list[str] | None) -> tuple[Matcher, ...]:
        out = []
        for i, text in enumerate(self.shape(key, texts) or []):
            try:
                out.append(Matcher.parse(text))
            except MatcherError as exc:
                raise self.error(f"{key}[{i}]", str(exc), text) from None
        return tuple(out)


def _show(value: Any) -> str:
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value)


def _url_ok(url: str) -> bool:
    return url.startswith(("http://", "https://")) and len(url) > len("https://")


# Stage 2: the meaning, in the order the errors are reported.


def _secret(ctx: _Ctx, t: RawSink | RawDeadman, key: str, name: str, *, plain_ok: bool,
            default: str | None = None, optional: bool = False) -> Secret | None:
    """Resolve ``name`` / ``name_env`` / ``name_file`` (exactly one; none for an ``optional`` one: None) of table
    ``t`` at ``key``."""
    given = [k for k in (name, f"{name}_env", f"{name}_file")
             if getattr(t, k, None) is not None or f"{key}.{k}" in ctx.faults]
    if len(given) > 1:
        raise ctx.error(key, f"give only one of {', '.join(given)}")
    if not given:
        if optional:
            return None
        if default is None:
            raise ctx.error(key, f"missing {name}_env (environment variable) or {name}_file (file holding it)")
        return Secret(default, "default")
    k = given[0]
    value = ctx.shape(f"{key}.{k}", getattr(t, k))
    where = f"{ctx.path}: {key}.{k}"
    if k == name:
        if not plain_ok:
            raise ctx.error(f"{key}.{k}", f"is a secret and must not be written in the file: set {name}_env or "
                            f"{name}_file instead (value not shown)")
        secret = Secret(value.strip(), "config file")
    elif k.endswith("_env"):
        secret = _secrets.from_env(value, where)
    else:
        secret = _secrets.from_file(value, where, ctx.base)
    if name == "url" and not _url_ok(secret.reveal()):
        # A URL written in the file: shown with its credentials hidden, whatever its scheme (a mistyped one may
        # still carry a password or a token).
        shown = f" = {_show(redact_url(value))}" if k == name else f" (from {secret.source}; value not shown)"
        raise ConfigError(f"{ctx.path}: {key}.{k}{shown}: not an http:// or https:// URL")
    return secret


def _sink(ctx: _Ctx, name: str, raw: Any, dashboard_url: str) -> Sink:
    key = f"sinks.{name}"
    if not _NAME.match(name):
        raise ctx.error(key, "sink names are 1-64 letters, digits, '_', '.', '-'")
    t: RawSink = ctx.convert(raw, RawSinkTable, key)
    ctx.shape(key)
    cls = SINK_TYPES[str(t.__struct_config__.tag)]
    kw: dict[str, Any] = {
        "send_resolved": ctx.shape(f"{key}.send_resolved", t.send_resolved),
        "timeout": ctx.duration(f"{key}.timeout", t.timeout, defaults.ALERT_HTTP_TIMEOUT_S, strict_min=True),
        "dashboard_url": dashboard_url,
    }
    kw["url"] = _secret(ctx, t, key, "url", plain_ok=t.PLAIN_URL, default=t.DEFAULT_URL)
    for s in t.SECRETS:
        kw[s] = _secret(ctx, t, key, s, plain_ok=False)
    for s in t.OPTIONAL_SECRETS:
        if (secret := _secret(ctx, t, key, s, plain_ok=False, optional=True)) is not None:
            kw[s] = secret
    for option in cls.OPTIONS:  # the sink class's own settings
        if (value := ctx.shape(f"{key}.{option}", getattr(t, option))) is not None:
            kw[option] = value
    if isinstance(t, RawAlertmanagerSink):
        kw.update(_alertmanager(ctx, t, key, kw))
    return cls(name, **kw)


def _alertmanager(ctx: _Ctx, t: RawAlertmanagerSink, key: str, kw: Mapping[str, Any]) -> dict[str, Any]:
    """The settings of an ``alertmanager`` sink besides the common ones and its secrets (already in ``kw``)."""
    if not kw["send_resolved"]:
        raise ctx.error(f"{key}.send_resolved", "must be true for an alertmanager sink: a resolve is how Alertmanager "
                        "learns an alert ended (choose send_resolved on Alertmanager's receivers instead)", False)
    out: dict[str, Any] = {"resend_interval": ctx.duration(f"{key}.resend_interval", t.resend_interval,
                                                           defaults.ALERT_AM_RESEND_INTERVAL_S, minimum=1.0)}
    username = ctx.shape(f"{key}.username", t.username)
    if username is not None:
        if "password" not in kw:
            raise ctx.error(f"{key}.username", "basic auth needs the password too: set password_env or password_file",
                            username)
        out["username"] = username
    elif "password" in kw:
        raise ctx.error(key, "password_env / password_file is basic auth: set username too")
    if "password" in kw and "bearer_token" in kw:
        raise ctx.error(key, "give basic auth (username, password_*) or bearer_token_*, not both")
    labels = ctx.shape(f"{key}.labels", t.labels) or {}
    for name, value in labels.items():
        if not LABEL_NAME.match(name) or name.startswith("__"):
            raise ctx.error(f"{key}.labels.{name}", "not a label name (letters, digits and '_', not starting with a "
                            "digit; '__' is reserved)", value)
        if name in ALERT_LABELS:
            raise ctx.error(f"{key}.labels.{name}", f"is set from the anomaly ({', '.join(ALERT_LABELS)})", value)
        if value == "":
            raise ctx.error(f"{key}.labels.{name}", "must not be empty (Alertmanager drops empty labels)", value)
    out["labels"] = dict(labels)
    return out


def _route(ctx: _Ctx, t: RawRoute | RawChildRoute, key: str, rid: str, parent: Route | None,
           sinks: Mapping[str, Sink], names: set[str]) -> Route:
    ctx.shape(key)
    name = ctx.shape(f"{key}.name", t.name)
    if name is not None:
        if name in names:
            raise ctx.error(f"{key}.name", "another route has this name", name)
        names.add(name)
        rid = name
    receivers = ctx.shape(f"{key}.receivers", t.receivers)
    if receivers is None:
        if parent is None:
            raise ctx.error(f"{key}.receivers", "missing: list the sinks of the root route (may be [])")
        receivers = list(parent.receivers)
    for i, r in enumerate(receivers):
        if r not in sinks:
            raise ctx.error(f"{key}.receivers[{i}]", f"no sink of this name (sinks: {', '.join(sinks) or 'none'})", r)
    group_by = ctx.shape(f"{key}.group_by", t.group_by)
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
    timers = Timers(ctx.duration(f"{key}.group_wait", t.group_wait, pt.group_wait),
                    ctx.duration(f"{key}.group_interval", t.group_interval, pt.group_interval, strict_min=True),
                    ctx.duration(f"{key}.repeat_interval", t.repeat_interval, pt.repeat_interval, strict_min=True))
    matchers: tuple[Matcher, ...] = ()
    continue_ = False
    if isinstance(t, RawChildRoute):
        matchers = ctx.matchers(f"{key}.matchers", t.matchers)
        continue_ = ctx.shape(f"{key}.continue", t.continue_)
    route = Route(rid, matchers, tuple(receivers), tuple(group_by), timers, continue_)
    ctx.shape(f"{key}.routes")
    kids = tuple(_route(ctx, c, f"{key}.routes[{i}]", f"{rid}.{i}", route, sinks, names)
                 for i, c in enumerate(t.routes))
    return Route(route.id, route.matchers, route.receivers, route.group_by, route.timers, route.continue_, kids)


def _inhibit(ctx: _Ctx, rules: list[RawInhibitRule]) -> tuple[InhibitRule, ...]:
    out = []
    for i, t in enumerate(rules):
        key = f"inhibit_rules[{i}]"
        ctx.shape(key)
        src = ctx.matchers(f"{key}.source_matchers", t.source_matchers)
        dst = ctx.matchers(f"{key}.target_matchers", t.target_matchers)
        if not src or not dst:
            raise ctx.error(key, "needs non-empty source_matchers and target_matchers")
        equal = ctx.shape(f"{key}.equal", t.equal)
        equal = ["run"] if equal is None else equal
        for j, lb in enumerate(equal):
            if lb not in LABELS:
                raise ctx.error(f"{key}.equal[{j}]", f"not an alert label ({', '.join(LABELS)})", lb)
        out.append(InhibitRule(src, dst, tuple(equal)))
    return tuple(out)


def parse(data: Mapping[str, Any], path: str = "<config>", base: Path | None = None) -> AlertsConfig:
    """Validate a decoded TOML document.

    Parameters
    ----------
    data : Mapping
        The document, as :func:`tomllib.loads` returns it.
    path : str
        The file's name, first in every error.
    base : Path, optional
        The folder relative ``*_file`` secrets are read from (default: the current directory).

    Returns
    -------
    AlertsConfig
        The config, defaults filled in and secrets read.

    Raises
    ------
    ConfigError
        ``<path>: <key> = <value>: <what is wrong>`` for the first invalid key or value (secrets never shown).
    """
    ctx = _Ctx(path, base or Path.cwd())
    doc: RawConfig = ctx.convert(data, RawConfig, "")
    ctx.shape("")
    if doc.version != 1:
        raise ctx.error("version", "only version 1 exists", doc.version)
    dashboard_url = ctx.shape("dashboard_url", doc.dashboard_url)
    if not _url_ok(dashboard_url):
        raise ctx.error("dashboard_url", _PROBLEMS[Url], dashboard_url)
    ctx.shape("sinks")
    sinks = {name: _sink(ctx, name, t, dashboard_url) for name, t in doc.sinks.items()}
    ctx.shape("route")
    if doc.route is None:
        raise ctx.error("route", "missing: add a [route] table with receivers = [...]")
    route = _route(ctx, doc.route, "route", "root", None, sinks, set())
    rules = ctx.shape("inhibit_rules", doc.inhibit_rules)
    inhibit = DEFAULT_RULES if rules is None else _inhibit(ctx, rules)
    d = doc.delivery
    ctx.shape("delivery")
    attempts, jitter = ctx.shape("delivery.max_attempts", d.max_attempts), ctx.shape("delivery.jitter", d.jitter)
    base_s = ctx.duration("delivery.backoff_base", d.backoff_base, defaults.ALERT_BACKOFF_BASE_S, strict_min=True)
    delivery = DeliveryConfig(attempts, base_s,
                              ctx.duration("delivery.backoff_max", d.backoff_max, defaults.ALERT_BACKOFF_MAX_S, base_s),
                              jitter, ctx.duration("delivery.retry_after_max", d.retry_after_max,
                                                   defaults.ALERT_RETRY_AFTER_MAX_S, strict_min=True))
    w = doc.watchdog
    ctx.shape("watchdog")
    watchdog = WatchdogConfig(ctx.shape("watchdog.service_down", w.service_down),
                              ctx.duration("watchdog.service_stale", w.service_stale, defaults.ALERT_SERVICE_STALE_S,
                                           strict_min=True))
    deadman = None
    ctx.shape("deadman")
    if (dm := doc.deadman) is not None:
        deadman = DeadmanConfig(_secret(ctx, dm, "deadman", "url", plain_ok=True),
                                ctx.duration("deadman.interval", dm.interval, 60.0, strict_min=True),
                                ctx.duration("deadman.timeout", dm.timeout, defaults.ALERT_HTTP_TIMEOUT_S,
                                             strict_min=True))
    backfill = ctx.duration("backfill", doc.backfill, defaults.ALERT_BACKFILL_S)
    if ctx.faults:  # every fault is at a key stage 2 reads (else it would have raised): never let one pass
        raise next(iter(ctx.faults.values()))
    return AlertsConfig(path=path, route=route, sinks=sinks, inhibit_rules=inhibit, dashboard_url=dashboard_url,
                        delivery=delivery, watchdog=watchdog, deadman=deadman, backfill=backfill)


def load(path: str | Path) -> AlertsConfig:
    """Read and validate the TOML file at ``path``.

    Parameters
    ----------
    path : str or Path
        The alerts config file; relative ``*_file`` secrets are read from its folder.

    Returns
    -------
    AlertsConfig
        The validated config (see :func:`parse`).

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
