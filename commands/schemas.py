"""``trainhealth schemas``: the JSON Schemas (draft 2020-12) of the JSON documents trainhealth writes and sends,
generated from the code's own types, published in ``docs/schemas/`` (one file per document).

Each document is a type in the code that builds it: a dataclass (``Anomaly``, ``Recommendation``, ``Incident``,
``JobState``, ``StepRecord``, ``Event``) or a ``TypedDict`` its builder is annotated with (the heartbeat, the ledger
snapshot, the ``analyze --json`` report, the webhook payload). msgspec (:func:`msgspec.json.schema_components`)
turns the types into schemas; this module then finishes them, in one place, where the JSON differs from the type or
says more than a type can:

- descriptions: each class's summary and, per property, its entry in the class's numpydoc ``Attributes`` section
  (units included), so the schema says what the docstring says;
- closed objects: ``additionalProperties: false`` on every object built from a class (``evidence``, ``cost`` and
  the like are ``dict`` fields: open);
- a dataclass is written by ``to_dict()`` (``dataclasses.asdict``): every field present, so every property is
  required; ``Anomaly.to_dict()`` adds its ``id`` and leaves ``scope`` out;
- what the detector service adds as it stores a record (``first_seen``, the recommendation's lifecycle: the
  ``TypedDict`` of those fields beside the record's type) is merged into the stored form;
- the wire forms: a step record leaves a missing value out (never null) and carries its sections as ``sec.<name>``
  and GPU times as ``gpu.<name>`` keys; an event's fields are strings as Redis returns them;
- what a ``TypedDict`` cannot say: exactly one of ``cuda``/``cuda_absent`` in a heartbeat's memory sample, a GPU
  sample or its ``absent`` reason, the webhook alert's anomaly (a stored one or the ``service_down`` alert's).

``tests/test_schemas.py`` checks that the committed files equal :func:`build`'s, so a change to a type fails until
the schemas are written again (``trainhealth schemas --write docs/schemas``), and the tests that read such JSON
validate it against the committed files.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import inspect
import json
import re
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainhealth.commands._shared import command

DRAFT = "https://json-schema.org/draft/2020-12/schema"
#: Where the schemas are published, relative to the repository.
DEFAULT_DIR = Path("docs") / "schemas"
_REF = "#/$defs/{name}"
#: A number as ``repr(float)`` or ``str(int)`` writes it (events' fields as Redis returns them); NaN and ±Inf
#: included, as ``encode_value`` keeps them.
_FLOAT_TEXT = r"^(-?([0-9]+(\.[0-9]*)?([eE][-+]?[0-9]+)?|inf)|nan)$"
_INT_TEXT = r"^-?[0-9]+$"
_RANK_TEXT = r"^[0-9]+$"


# -- docstrings -> descriptions -------------------------------------------------------------------------
_ROLE = re.compile(r":(?:data|class|attr|meth|func|mod|exc):`~?([^`]+)`")


def _plain(text: str) -> str:
    """RST markup in words: ``:class:`~a.B``` → ```B```, double backquotes → single, lines joined."""
    text = _ROLE.sub(lambda m: "`" + m.group(1).rsplit(".", 1)[-1] + "`", text)
    text = text.replace("``", "`")
    return " ".join(line.strip() for line in text.strip().splitlines() if line.strip())


def docstring_parts(cls: type) -> tuple[str, dict[str, str]]:
    """``(summary, {attribute: description})`` of a numpydoc class docstring: the text before the first section,
    and the entries of its ``Attributes`` section (``a, b : type`` entries give each name the description).

    >>> from trainhealth.anomaly import Seen
    >>> docstring_parts(Seen)[1]["first_seen"]
    'Unix s the service first wrote it.'
    """
    doc = inspect.cleandoc(cls.__doc__ or "")
    lines = doc.splitlines()
    sections: dict[str, list[str]] = {}
    summary: list[str] = []
    current: list[str] | None = None
    i = 0
    while i < len(lines):
        if i + 1 < len(lines) and lines[i].strip() and set(lines[i + 1].strip()) == {"-"}:
            current = sections.setdefault(lines[i].strip(), [])
            i += 2
            continue
        (summary if current is None else current).append(lines[i])
        i += 1
    attrs: dict[str, str] = {}
    names: list[str] = []
    body: list[str] = []

    def flush() -> None:
        for n in names:
            attrs[n] = _plain("\n".join(body))

    for line in sections.get("Attributes", []):
        if line and not line[0].isspace():
            flush()
            names = [n.strip() for n in line.split(" : ")[0].split(",") if n.strip()]
            body = []
        else:
            body.append(line)
    flush()
    paragraphs = "\n".join(summary).strip().split("\n\n")
    return "\n\n".join(_plain(p) for p in paragraphs if p.strip()), attrs


# -- msgspec's schemas, finished ----------------------------------------------------------------------
def _classes(*types: Any) -> dict[str, type]:
    """Every dataclass and TypedDict in the type trees of ``types``, by the name msgspec gives its component."""
    import msgspec.inspect as mi

    found: dict[str, type] = {}

    def walk(t: Any) -> None:
        while isinstance(t, mi.Metadata):
            t = t.type
        if isinstance(t, (mi.DataclassType, mi.TypedDictType)):
            if found.get(t.cls.__name__, t.cls) is not t.cls:
                raise ValueError(f"two types named {t.cls.__name__!r} in one document: rename one")
            if t.cls.__name__ in found:
                return
            found[t.cls.__name__] = t.cls
            for f in t.fields:
                walk(f.type)
        elif isinstance(t, mi.CollectionType):
            walk(t.item_type)
        elif isinstance(t, mi.TupleType):
            for x in t.item_types:
                walk(x)
        elif isinstance(t, mi.DictType):
            walk(t.key_type)
            walk(t.value_type)
        elif isinstance(t, mi.UnionType):
            for x in t.types:
                walk(x)

    for info in mi.multi_type_info(types):
        walk(info)
    return found


def _finish(comp: dict[str, Any], cls: type) -> None:
    """Descriptions from ``cls``'s docstring, the object closed; for a dataclass, its ``to_dict()`` form."""
    summary, attrs = docstring_parts(cls)
    comp["title"] = cls.__name__
    if summary:
        comp["description"] = summary
    else:
        comp.pop("description", None)
    props = comp["properties"]
    if dataclasses.is_dataclass(cls):
        added, dropped = _JSON_FORM.get(cls.__name__, ((), ()))
        for name in dropped:
            props.pop(name)
        for name in added:
            getter = getattr(cls, name)
            ret = typing.get_type_hints(getter.fget)["return"]
            props[name] = {"type": {str: "string", int: "integer", float: "number"}[ret]}
            attrs[name] = _plain(getter.__doc__ or "")
        for p in props.values():
            p.pop("default", None)
        comp["required"] = list(props)  # asdict writes every field
    for name, p in props.items():
        if attrs.get(name):
            p["description"] = attrs[name]
    comp["additionalProperties"] = False


#: How a dataclass's ``to_dict()`` differs from its fields: (properties added, from the class's own read-only
#: properties, fields left out).
_JSON_FORM = {"Anomaly": (("id",), ("scope",))}


def _components(*types: Any) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """msgspec's schemas of ``types`` and their shared components (``$defs``), finished (:func:`_finish`)."""
    import msgspec

    roots, defs = msgspec.json.schema_components(types, ref_template=_REF)
    classes = _classes(*types)
    for name, comp in defs.items():
        _finish(comp, classes[name])
    return list(roots), defs


def _merged(base: dict[str, Any], extra: dict[str, Any], title: str, description: str) -> dict[str, Any]:
    """``base``'s object with ``extra``'s properties (a record as stored: the record, then what storing adds)."""
    out = copy.deepcopy(base)
    out["title"] = title
    out["description"] = description
    out["properties"].update(copy.deepcopy(extra["properties"]))
    out["required"] = out["required"] + [r for r in extra["required"] if r not in out["required"]]
    return out


#: How msgspec writes an item of ``trainhealth.wire.Indices`` (an int or a list of ints), and what it is: an index,
#: or a ``[start, stop]`` / ``[start, stop, step]`` range, every number in 0..2**53.
_INDEX_ITEM = {"anyOf": [{"type": "integer"}, {"type": "array", "items": {"type": "integer"}}]}
_INDEX_ITEM_EXACT = {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 2**53 - 1},
                               {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 2**53},
                                "minItems": 2, "maxItems": 3}]}


def _exact_indices(node: Any) -> Any:
    """``node`` with each item schema of a compact index list (:data:`_INDEX_ITEM`) made exact."""
    if isinstance(node, dict):
        return {k: (copy.deepcopy(_INDEX_ITEM_EXACT) if k == "items" and v == _INDEX_ITEM else _exact_indices(v))
                for k, v in node.items()}
    if isinstance(node, list):
        return [_exact_indices(v) for v in node]
    return node


def _document(title: str, description: str, root: dict[str, Any], defs: dict[str, dict[str, Any]]
              ) -> dict[str, Any]:
    """A published schema: ``$schema``, what it is, the root, and only the ``$defs`` it reaches."""
    root, defs = _exact_indices(root), _exact_indices(defs)
    doc: dict[str, Any] = {"$schema": DRAFT, "title": title, "description": description, **root}
    used: dict[str, dict[str, Any]] = {}
    todo = [doc]
    while todo:
        node = todo.pop()
        for ref in re.findall(r'"\$ref": "#/\$defs/([^"]+)"', json.dumps(node)):
            if ref not in used:
                used[ref] = defs[ref]
                todo.append(defs[ref])
    if used:
        doc["$defs"] = dict(sorted(used.items()))
    return doc


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF.format(name=name)}


def _not_null(prop: dict[str, Any]) -> dict[str, Any]:
    """``prop`` without its null alternative (a value the wire leaves out instead of writing null)."""
    options = [o for o in prop.get("anyOf", ()) if o != {"type": "null"}]
    if "anyOf" in prop and len(options) == 1:
        out = {k: v for k, v in prop.items() if k != "anyOf"}
        out.update(options[0])
        return out
    return prop


# -- the documents ------------------------------------------------------------------------------------
def _as_recommendations(defs: dict[str, dict[str, Any]], *names: str) -> None:
    """The components ``names`` hold fields of a recommendation: each property takes the recommendation's schema
    (its ``action`` enum...), keeping its own description."""
    from trainhealth.recommendations import Recommendation

    _, rec_defs = _components(Recommendation)
    rec = rec_defs["Recommendation"]["properties"]
    for ref in (defs[n] for n in names):
        for name, prop in ref["properties"].items():
            ref["properties"][name] = {**rec[name], "description": prop["description"]}


def _stored_anomaly(defs: dict[str, dict[str, Any]], extra: dict[str, dict[str, Any]]) -> dict[str, Any]:
    defs["RecommendationRef"] = extra["RecommendationRef"]
    _as_recommendations(defs, "RecommendationRef")
    return _merged(defs["Anomaly"], extra["StoredFields"], "StoredAnomaly",
                   "An anomaly as the detector service stores it in `th:{run}:anomalies` (and in the `json` of its "
                   "`th:{run}:anomaly_log` transitions): `Anomaly.to_dict()`, then `first_seen`, `last_seen` and, "
                   "when it has one, the stable part of its recommendation.")


def anomaly_schema() -> dict[str, Any]:
    """``th:{run}:anomalies``: a field's value (and ``th:{run}:anomaly_log``'s ``json``)."""
    from trainhealth.anomaly import Anomaly, StoredFields

    _, defs = _components(Anomaly, StoredFields)
    stored = _stored_anomaly(defs, defs)
    return _document("trainhealth anomaly", "The value of a field of th:{run}:anomalies (field = the anomaly id), "
                     "and the `json` of a th:{run}:anomaly_log entry. Kinds, severities and evidence: "
                     "docs/anomalies.md.", {"$ref": _REF.format(name="StoredAnomaly")},
                     {**defs, "StoredAnomaly": stored})


def recommendation_schema() -> dict[str, Any]:
    """``th:{run}:recommendations``: a field's value."""
    from trainhealth.recommendations import Lifecycle, Recommendation

    _, defs = _components(Recommendation, Lifecycle)
    stored = _merged(defs["Recommendation"], defs["Lifecycle"], "StoredRecommendation",
                     "A recommendation as th:{run}:recommendations stores it: `Recommendation.to_dict()` and its "
                     "lifecycle (docs/advisor.md).")
    return _document("trainhealth recommendation", "The value of a field of th:{run}:recommendations (field = "
                     "`rec:<anomaly id>`).", _ref("StoredRecommendation"), {**defs, "StoredRecommendation": stored})


def incident_schema() -> dict[str, Any]:
    """``th:{run}:incidents``: a field's value."""
    from trainhealth.anomaly import Seen
    from trainhealth.detectors.incidents import Incident

    _, defs = _components(Incident, Seen)
    stored = _merged(defs["Incident"], defs["Seen"], "StoredIncident",
                     "An incident as th:{run}:incidents stores it: `Incident.to_dict()`, then `first_seen` and "
                     "`last_seen`.")
    return _document("trainhealth incident", "The value of a field of th:{run}:incidents (field = the incident id): "
                     "one root cause, grouping its anomalies (docs/anomalies.md, Incidents).",
                     _ref("StoredIncident"), {**defs, "StoredIncident": stored})


def job_state_schema() -> dict[str, Any]:
    """``th:{run}:state``."""
    from trainhealth.job import JobState

    (root,), defs = _components(JobState)
    return _document("trainhealth job state", "The value of th:{run}:state: the job's state as the detector service "
                     "judges it (docs/anomalies.md, Job state).", root, defs)


def ledger_snapshot_schema() -> dict[str, Any]:
    """``th:{run}:ledger:latest`` and ``th:{run}:ledger``'s ``json``."""
    from trainhealth.goodput import LedgerSnapshot

    (root,), defs = _components(LedgerSnapshot)
    return _document("trainhealth goodput ledger snapshot", "The value of th:{run}:ledger:latest and the `json` of a "
                     "th:{run}:ledger entry (docs/goodput.md); also `goodput.ledger` of `trainhealth analyze "
                     "--json`.", root, defs)


def heartbeat_schema() -> dict[str, Any]:
    """``th:{run}:hb``: a field's value."""
    from trainhealth.wire import Heartbeat

    (root,), defs = _components(Heartbeat)
    defs["MemorySample"]["oneOf"] = [{"required": ["cuda"]}, {"required": ["cuda_absent"]}]
    gpu = defs["GpuSample"]
    gpu["required"] = []
    gpu["oneOf"] = [{"required": ["absent"], "maxProperties": 1},
                    {"required": ["device"], "not": {"required": ["absent"]}}]
    return _document("trainhealth heartbeat", "The value of a field of th:{run}:hb (field = the rank): the rank's "
                     "heartbeat, rewritten every 5 s by its collector.", root, defs)


def step_records_schema() -> dict[str, Any]:
    """``th:{run}:steps``: an entry's ``recs``."""
    from trainhealth.wire import GPU_PREFIX, MAX_RANKS, MAX_STEP, SECTION_PREFIX, StepRecord

    (_,), defs = _components(StepRecord)
    rec = defs["StepRecord"]
    props = rec["properties"]
    sections, gpu = props.pop("sections"), props.pop("gpu")
    required = [name for name, f in StepRecord.__dataclass_fields__.items()
                if f.default is f.default_factory is dataclasses.MISSING]
    rec["required"] = required
    for name in list(props):
        props[name] = _not_null(props[name])
    for name in ("skipped", "loss_missing"):  # log_step(skipped=True) goes as it is: a JSON true
        props[name] = {"enum": [0, 1, False, True], "description": props[name]["description"]}
    props["rank"].update(minimum=0, maximum=MAX_RANKS - 1)
    props["step"].update(minimum=-MAX_STEP, maximum=MAX_STEP)
    rec["patternProperties"] = {
        f"^{re.escape(SECTION_PREFIX)}": {"type": "number", "description": "`sec.<name>`: " + sections["description"]},
        f"^{re.escape(GPU_PREFIX)}": {"type": "number", "description": "`gpu.<name>`: " + gpu["description"]},
    }
    rec["title"] = "StepRecord (wire)"
    rec["description"] += (" On the wire: a missing value is left out (never null); the sections as `sec.<name>`"
                           " keys, the GPU times as `gpu.<name>`.")
    return _document("trainhealth step records", "The `recs` field of a th:{run}:steps entry: a JSON list of one "
                     "rank's step records, oldest first (NaN/Infinity kept as JSON5-style tokens).",
                     {"type": "array", "items": _ref("StepRecord")}, defs)


def event_schema() -> dict[str, Any]:
    """``th:{run}:events``: an entry's fields."""
    from trainhealth.wire import EVENT_KINDS, Event

    (_,), defs = _components(Event)
    ev = defs["Event"]
    props = ev["properties"]
    extra = props.pop("extra")
    for name, pattern in (("rank", _RANK_TEXT), ("step", _INT_TEXT)):
        props[name] = {"type": "string", "pattern": pattern, "description": props[name]["description"]}
    for name in ("t", "inc", "seconds"):
        props[name] = {"type": "string", "pattern": _FLOAT_TEXT, "description": props[name]["description"]}
    props["kind"] = {"enum": list(EVENT_KINDS), "description": props["kind"]["description"]}
    ev["required"] = ["kind", "rank", "t"]  # what decode_event requires (inc defaults to 0)
    ev["additionalProperties"] = {"type": "string", "description": extra["description"]}
    ev["title"] = "Event (stream fields)"
    ev["description"] += " As Redis returns the entry's fields: every value a string."
    return _document("trainhealth event", "The fields of a th:{run}:events entry (every value a string, as Redis "
                     "returns it); the fields of each kind: docs/architecture.md.", _ref("Event"), defs)


def skip_schema() -> dict[str, Any]:
    """``trainhealth advise RUN --format skip-json``: the exact skip of a rollback."""
    from trainhealth.samples import SkipDocument

    (root,), defs = _components(SkipDocument)
    return _document("trainhealth skip", "The exact data a rollback skips (`trainhealth advise RUN --format "
                     "skip-json`, the dashboard card's `skip.json`; docs/advisor.md): step, consumed-sample and "
                     "batch-index ranges, and the sample indices the skipped steps consumed.", root, defs)


def analyze_report_schema() -> dict[str, Any]:
    """``trainhealth analyze --json``."""
    from trainhealth.commands.analyze_report import AnalyzeReport

    (root,), defs = _components(AnalyzeReport)
    return _document("trainhealth analyze report", "The JSON report of `trainhealth analyze --json` (docs/analyze.md)."
                     " NaN/±Inf numbers in an anomaly's evidence are written as Python's json writes them (`NaN`).",
                     root, defs)


def webhook_payload_schema() -> dict[str, Any]:
    """The JSON webhook sink's body."""
    from trainhealth.alerts.intake import AlertRecommendation
    from trainhealth.alerts.sinks.webhook import WebhookPayload
    from trainhealth.alerts.watchdog import ServiceDownAnomaly
    from trainhealth.anomaly import Anomaly, StoredFields

    (root, *_), defs = _components(WebhookPayload, ServiceDownAnomaly, Anomaly, StoredFields, AlertRecommendation)
    alerted = _stored_anomaly(defs, defs)
    # The alert's copy: its recommendation with the summary the intake adds.
    _as_recommendations(defs, "AlertRecommendation")
    alerted["properties"]["recommendation"] = {**_ref("AlertRecommendation"),
                                               "description": defs["AlertRecommendation"]["description"]}
    alerted["title"] = "AlertedAnomaly"
    alerted["description"] = ("An anomaly as an alert carries it: as the detector service stored it "
                              "(`th:{run}:anomalies`), its recommendation with the summary the alert worker adds.")
    defs["AlertedAnomaly"] = alerted
    alert = defs["WebhookAlert"]["properties"]
    alert["anomaly"] = {"anyOf": [_ref("AlertedAnomaly"), _ref("ServiceDownAnomaly")],
                        "description": alert["anomaly"]["description"]}
    return _document("trainhealth webhook payload", "The body of the JSON webhook sink's POST, payload version 1 "
                     "(docs/alerts.md, JSON webhook).", root, defs)


#: Every published document: file stem → its builder.
DOCUMENTS: dict[str, Callable[[], dict[str, Any]]] = {
    "analyze-report": analyze_report_schema,
    "webhook-payload": webhook_payload_schema,
    "step-records": step_records_schema,
    "event": event_schema,
    "heartbeat": heartbeat_schema,
    "anomaly": anomaly_schema,
    "recommendation": recommendation_schema,
    "incident": incident_schema,
    "job-state": job_state_schema,
    "ledger-snapshot": ledger_snapshot_schema,
    "skip": skip_schema,
}


def build() -> dict[str, dict[str, Any]]:
    """Every schema, ``{name: schema}`` (the file of ``name`` is ``<name>.json``).

    Raises ``ModuleNotFoundError`` for msgspec when the ``server`` extra is not installed.
    """
    return {name: make() for name, make in DOCUMENTS.items()}


def dumps(schema: dict[str, Any]) -> str:
    """A schema as its file holds it (2-space indent, a final newline)."""
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"


def stale(directory: Path, schemas: dict[str, dict[str, Any]] | None = None) -> list[str]:
    """The files of ``directory`` that differ from :func:`build`'s (missing ones included), and ``*.json`` files there
    that are no schema; empty when all are current."""
    schemas = build() if schemas is None else schemas
    out = [f"{n}.json" for n, s in schemas.items()
           if not (directory / f"{n}.json").is_file() or (directory / f"{n}.json").read_text() != dumps(s)]
    out += sorted(p.name for p in directory.glob("*.json") if p.stem not in schemas)
    return out


# -- the command --------------------------------------------------------------------------------------
def register(sub: Any) -> None:
    """Add ``schemas`` to the ``trainhealth`` sub-parsers."""
    c = command(sub, "schemas", "Print the JSON Schemas (draft 2020-12) of the JSON trainhealth writes: the analyze "
                                "report, the webhook payload, the Redis records. --write DIR writes one file each.")
    group = c.add_mutually_exclusive_group()
    group.add_argument("--write", metavar="DIR", type=Path,
                       help=f"write <name>.json per document into DIR (the repository's: {DEFAULT_DIR})")
    group.add_argument("--check", metavar="DIR", type=Path,
                       help="exit 1 when a file in DIR differs from the generated schema (names them)")
    c.add_argument("--name", choices=sorted(DOCUMENTS), help="only this document (printed)")
    c.set_defaults(func=run, extra="server")


def run(args: argparse.Namespace) -> int:
    """Print, write or check the schemas; 0, or 1 when ``--check`` finds a stale file."""
    if args.check is not None:
        bad = stale(args.check)
        for name in bad:
            print(f"{args.check / name}: not the generated schema (trainhealth schemas --write {args.check})")
        return 1 if bad else 0
    schemas = build()
    if args.name is not None:
        schemas = {args.name: schemas[args.name]}
    if args.write is not None:
        args.write.mkdir(parents=True, exist_ok=True)
        for name, schema in schemas.items():
            (args.write / f"{name}.json").write_text(dumps(schema))
            print(args.write / f"{name}.json")
        return 0
    print(json.dumps(schemas if args.name is None else schemas[args.name], indent=2, ensure_ascii=False))
    return 0
