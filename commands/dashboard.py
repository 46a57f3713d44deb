"""``trainhealth dashboard``: the Streamlit dashboard, on 127.0.0.1 unless ``--host`` says otherwise, usage
statistics off.

Who can change what through it (silences, dead-letter resends, recommendation decisions) is in
docs/security.md: ``--read-only`` removes every button that writes, an ``[auth]`` section in Streamlit's
``.streamlit/secrets.toml`` makes every page require an OIDC login (``st.login``), and a non-loopback
``--host`` without either prints a warning on stderr.
"""

from __future__ import annotations

import argparse
import ipaddress
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import quote

from trainhealth import defaults
from trainhealth.commands._shared import (
    check_port,
    child_env,
    command,
    dashboard_command,
    ignore_signals,
    interrupt_on_signals,
    release_embedded,
    resolve,
    with_url,
)
from trainhealth.exceptions import ConfigError
from trainhealth.keys import validate_run_id

#: The default ``--host``: this machine only.
DEFAULT_HOST = "127.0.0.1"
#: Keys the dashboard's ``st.login()`` (the default provider, no name) needs in ``[auth]``.
AUTH_KEYS = ("redirect_uri", "cookie_secret", "client_id", "client_secret", "server_metadata_url")


def register(sub: Any) -> None:
    """Add ``dashboard`` to the ``trainhealth`` sub-parsers."""
    b = with_url(command(sub, "dashboard", "Run the Streamlit dashboard (usage statistics off)."))
    b.add_argument("--port", type=int, default=defaults.DASHBOARD_PORT,
                   help=f"TCP port (default {defaults.DASHBOARD_PORT})")
    b.add_argument("--host", default=DEFAULT_HOST,
                   help=f"address to listen on (default {DEFAULT_HOST}: this machine only); another one lets "
                        "whoever reaches it in, so add a login or --read-only (docs/security.md)")
    b.add_argument("--read-only", action="store_true",
                   help="no buttons that change anything: silences, dead-letter resends and recommendation "
                        "decisions are left to the CLI")
    b.add_argument("--run", help="open on this run: the address printed ends in ?run=RUN")
    b.set_defaults(func=run, extra="server")


def is_loopback(host: str) -> bool:
    """True for an address of this machine only: ``localhost``, 127.0.0.0/8, ``::1``.

    Any other name or address (``0.0.0.0`` and ``::`` listen everywhere) counts as reachable from elsewhere.

    >>> [is_loopback(h) for h in ("127.0.0.1", "localhost", "::1", "[::1]", "0.0.0.0", "10.0.0.5", "box")]
    [True, True, True, True, False, False, False]
    """
    name = host.strip().removeprefix("[").removesuffix("]")
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def exposure_warning(host: str, port: int, read_only: bool, login: bool) -> str | None:
    """The one-line warning for a dashboard bound to a non-loopback address without protection, else None.

    >>> exposure_warning("127.0.0.1", 8501, False, False) is None
    True
    >>> exposure_warning("0.0.0.0", 8501, True, False) is None, exposure_warning("0.0.0.0", 8501, False, True) is None
    (True, True)
    """
    if is_loopback(host) or read_only or login:
        return None
    return (f"trainhealth dashboard: WARNING: listening on {host}:{port} with no login and not read-only: anyone "
            "who reaches it can add silences, resend dead letters and acknowledge, apply or dismiss "
            "recommendations. Configure [auth] in .streamlit/secrets.toml, pass --read-only, or keep "
            "--host 127.0.0.1 behind an authenticating proxy (docs/security.md).")


def secrets_files() -> list[Path]:
    """The ``secrets.toml`` files Streamlit will read for the dashboard, in its order (later ones win).

    Streamlit's own option ``secrets.files`` (default: ``~/.streamlit/secrets.toml``, then
    ``.streamlit/secrets.toml`` of the working directory, which is the dashboard's too).
    """
    from streamlit import config

    return [Path(p) for p in config.get_option("secrets.files") if str(p).endswith(".toml")]


def auth_section(files: list[Path]) -> tuple[dict | None, Path | None]:
    """The ``[auth]`` table Streamlit will use and the file it is in (``(None, None)`` without one).

    Streamlit merges the files' top-level tables, so the last file that has ``[auth]`` supplies all of it.
    Raises :class:`ConfigError` for a file that is not valid TOML (naming it; values are never shown).
    """
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10 (tomli comes with the 'server' extra)
        import tomli as tomllib

    found: tuple[dict | None, Path | None] = (None, None)
    for path in files:
        if not path.is_file():
            continue
        try:
            doc = tomllib.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"{path}: cannot read it as TOML ({exc}); Streamlit would ignore its [auth] and "
                              "the dashboard would run without a login") from None
        if isinstance(doc.get("auth"), dict):
            found = (doc["auth"], path)
    return found if found[0] else (None, None)


def check_auth(auth: dict, path: Path) -> None:
    """Raise :class:`ConfigError` when ``st.login()`` could not work with ``auth`` (from ``path``): Streamlit
    older than 1.42, Authlib missing, a required key missing (keys are named, values never shown)."""
    import streamlit

    if not hasattr(streamlit, "login"):
        raise ConfigError(f"[auth] is set in {path}, but Streamlit {streamlit.__version__} has no st.login: "
                          "pip install 'streamlit>=1.42'")
    try:
        from streamlit.auth_util import is_authlib_installed
    except ImportError:  # another Streamlit layout: Authlib importable is the least st.login needs
        import importlib.util

        def is_authlib_installed() -> bool:
            return importlib.util.find_spec("authlib") is not None

    if not is_authlib_installed():
        raise ConfigError(f"[auth] is set in {path}, but Streamlit's login needs Authlib>=1.3.2: "
                          "pip install 'streamlit[auth]'")
    missing = [k for k in AUTH_KEYS if not auth.get(k)]
    if missing:
        raise ConfigError(f"[auth] in {path} is missing {', '.join(missing)} (the dashboard logs in with "
                          "the default provider, not an [auth.<name>] table); see docs/security.md")


def check_listen(host: str, port: int) -> None:
    """Raise :class:`ConfigError` naming ``--host`` / ``--port`` unless Streamlit can listen there."""
    if host == DEFAULT_HOST:
        check_port(port)
        return
    if not 1 <= port <= 65535:
        raise ConfigError(f"--port={port} is not a TCP port (1-65535)")
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)[0]
    except (OSError, UnicodeError) as exc:
        raise ConfigError(f"--host={host} is not an address of this machine ({exc})") from None
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as exc:
            raise ConfigError(f"--host={host} --port={port}: cannot listen there ({exc.strerror or exc})") from None


def browse_url(host: str, port: int) -> str:
    """The address to open: ``host`` itself, this machine's name when listening on every address."""
    name = host.strip("[]")
    if name in ("0.0.0.0", "::"):
        name = socket.gethostname()
    elif ":" in name:
        name = f"[{name}]"
    return f"http://{name}:{port}/"


def streamlit_command(url: str, port: int, host: str) -> list[str]:
    """The dashboard's streamlit command line (:func:`dashboard_command`), listening on ``host``."""
    cmd = dashboard_command(url, port)
    cmd[cmd.index("--server.address") + 1] = host.strip("[]")
    return cmd


def access_line(read_only: bool, auth_path: Path | None) -> str:
    """What protects the dashboard, one line for stdout."""
    if auth_path is not None:
        mode = f"login required ([auth] in {auth_path})"
    else:
        mode = "no login (changes are recorded as the OS user running it, marked '(no login)')"
    return f"Access: {mode}" + ("; read-only" if read_only else "")


def run(args: argparse.Namespace) -> int:
    """Run Streamlit until it exits, or until SIGTERM / Ctrl-C (130); returns its exit status."""
    import streamlit  # noqa: F401 - fail here, with the extra to install, not in the child process

    from trainhealth.dashboard.common import READ_ONLY_ENV, read_only

    run_id = validate_run_id(args.run) if args.run is not None else None
    host = args.host.strip()
    check_listen(host, args.port)
    auth, auth_path = auth_section(secrets_files())
    if auth is not None and auth_path is not None:
        check_auth(auth, auth_path)
    # --read-only, or the app's own setting already in this environment (which the app would obey anyway).
    locked = bool(args.read_only) or read_only()
    url, embedded = resolve(args)
    env = child_env(url)
    if locked:
        env[READ_ONLY_ENV] = "1"
    link = browse_url(host, args.port) + (f"?run={quote(run_id)}" if run_id else "")
    print(f"Dashboard: {link}", flush=True)
    print(access_line(locked, auth_path), flush=True)
    warning = exposure_warning(host, args.port, locked, auth_path is not None)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    proc = subprocess.Popen(streamlit_command(url, args.port, host), env=env)
    interrupt_on_signals()  # SIGTERM (systemd, kill, a supervisor) cleans up as Ctrl-C does, not orphaning Streamlit
    try:
        return proc.wait()
    except KeyboardInterrupt:
        # Ctrl-C in the terminal reached Streamlit too; a signal to this process alone did not.
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return 130
    finally:
        ignore_signals()  # a second signal must not skip the cleanup
        release_embedded(embedded, url)
