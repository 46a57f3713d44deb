"""The layout is the architecture (docs/architecture.md): checked against every import in the code.

- The ground floor (the modules directly in ``trainhealth/``) imports nothing of the project above it.
- The parts (``collectors``, ``detectors``, ``alerts``, ``dashboard``) import the ground floor and themselves,
  never each other: producers and consumers meet only through Redis and the contract.
- The commands (``commands/``) are the only modules that import several parts; nothing imports a command.
- The collectors, imported inside every rank of a training job, load nothing beyond redis-py and the
  standard library; the installed package names nothing top-level but ``trainhealth``.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent
#: Repository folder → installed package (pyproject.toml's package-dir).
FOLDERS = {"trainhealth": "trainhealth", "collectors": "trainhealth.collectors", "detectors": "trainhealth.detectors",
           "alerts": "trainhealth.alerts", "dashboard": "trainhealth.dashboard", "commands": "trainhealth.commands"}
PARTS = ("collectors", "detectors", "alerts", "dashboard")
#: The package's own facade: ``from trainhealth import Monitor`` (lazy) and ``python -m trainhealth``.
FACADE = {"trainhealth", "trainhealth.__main__"}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = [FOLDERS[rel.parts[0]], *rel.parts[1:]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def floor(module: str) -> str:
    """``ground``, one of :data:`PARTS`, or ``commands``."""
    bits = module.split(".")
    return bits[1] if len(bits) > 1 and bits[1] in (*PARTS, "commands") else "ground"


def project_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of ``trainhealth...`` in the file, ``from X import y`` as ``X.y`` too."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out += [(node.lineno, node.module)] + [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return [(line, m) for line, m in out if m == "trainhealth" or m.startswith("trainhealth.")]


def sources() -> list[Path]:
    files = []
    for folder in FOLDERS:
        for p in sorted((ROOT / folder).rglob("*.py")):
            files.append(p)
    return files


def violation(src: str, dst: str) -> str | None:
    a, b = floor(src), floor(dst)
    if dst == "trainhealth" or a == b:
        return None
    if b == "commands":
        return "nothing imports a command"
    if a == "ground":
        return "the ground floor imports nothing above it"
    if a in PARTS and b in PARTS:
        return "a part imports only the ground floor and itself"
    return None


def test_every_module_keeps_to_its_floor() -> None:
    bad = []
    for path in sources():
        src = module_name(path)
        if src in FACADE:
            continue
        for line, dst in project_imports(path):
            why = violation(src, dst)
            if why:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {src} imports {dst}: {why}")
    assert bad == []


@pytest.mark.parametrize(("src", "dst", "why"), [
    ("trainhealth.keys", "trainhealth.detectors.anomaly", "the ground floor imports nothing above it"),
    ("trainhealth.dashboard.cards", "trainhealth.detectors.advisor", "a part imports only the ground floor and itself"),
    ("trainhealth.dashboard.pages.alerts", "trainhealth.alerts.config", "a part imports only the ground floor and "
                                                                         "itself"),
    ("trainhealth.detectors.offline", "trainhealth.collectors.importers", "a part imports only the ground floor and "
                                                                          "itself"),
    ("trainhealth.detectors.service", "trainhealth.commands.serve", "nothing imports a command"),
    ("trainhealth.commands.analyze", "trainhealth.detectors.offline", None),
    ("trainhealth.alerts.worker", "trainhealth.loop", None),
    ("trainhealth.collectors.sender", "trainhealth.collectors.spill", None),
])
def test_the_rules_themselves(src: str, dst: str, why: str | None) -> None:
    assert violation(src, dst) == why


def test_every_folder_is_an_installed_package() -> None:
    """A new sub-folder must be listed in pyproject.toml, or a wheel would ship without it."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert cfg["package-dir"] == {v: k for k, v in FOLDERS.items()}
    folders = {module_name(p.parent / "__init__.py") for f in FOLDERS for p in (ROOT / f).rglob("__init__.py")}
    assert folders == set(cfg["packages"])
    assert (ROOT / "dashboard" / "pages" / "__init__.py").exists() is False  # pages are files Streamlit runs


def test_the_collectors_load_only_redis_and_the_standard_library() -> None:
    code = ("import sys; before = set(sys.modules); import trainhealth.collectors, trainhealth.collectors.importers; "
            "from trainhealth import Monitor; "
            "import json; print(json.dumps(sorted({m.partition('.')[0] for m in set(sys.modules) - before})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    loaded = set(json.loads(out.stdout))
    # (redis-py itself imports hiredis when it is installed: not ours to avoid.)
    heavy = {"numpy", "pandas", "sklearn", "streamlit", "plotly", "msgspec", "httpx", "tqdm", "torch",
             "tensorboard"}
    assert loaded & heavy == set()
    assert "redis" in loaded and "trainhealth" in loaded


def test_installed_top_level_names_are_only_trainhealth() -> None:
    # From outside the repository: what a training job's own `collectors/` or `dashboard/` folder would shadow.
    code = "import importlib.util as u; print([n for n in ('collectors', 'detectors', 'dashboard', 'alerts', " \
           "'commands') if u.find_spec(n)])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.strip() == "[]"
