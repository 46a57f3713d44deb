"""Rank, world size and host of this process, read from the launcher's environment.

Order follows the launchers' own variables: torchrun/torchelastic (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``), Slurm (``SLURM_PROCID``, ``SLURM_NTASKS``), Open MPI
(``OMPI_COMM_WORLD_RANK``/``_SIZE``), MPICH/Intel MPI/PMI (``PMI_RANK``, ``PMI_SIZE``).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

from trainhealth.exceptions import ConfigError

RANK_VARS = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
WORLD_VARS = ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
LOCAL_RANK_VARS = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")


def _first_int(env: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, int] | None:
    for name in names:
        raw = env.get(name)
        if raw is None or raw == "":
            continue
        try:
            return name, int(raw)
        except ValueError:
            raise ConfigError(f"environment {name}={raw!r} is not an integer") from None
    return None


def detect(
    rank: int | None = None,
    world_size: int | None = None,
    env: Mapping[str, str] | None = None,
) -> tuple[int, int, int]:
    """Return ``(rank, world_size, local_rank)``, explicit arguments first, then the environment.

    Defaults to a single process ``(0, 1, 0)``.

    Raises
    ------
    ConfigError
        When a value is not an integer, ``world_size < 1`` or ``rank`` is outside ``[0, world_size)``.

    >>> detect(env={"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "3"})
    (3, 8, 3)
    >>> detect(rank=1, world_size=2, env={})
    (1, 2, 0)
    """
    env = os.environ if env is None else env
    if rank is None:
        found = _first_int(env, RANK_VARS)
        rank = found[1] if found else 0
    if world_size is None:
        found = _first_int(env, WORLD_VARS)
        world_size = found[1] if found else 1
    found = _first_int(env, LOCAL_RANK_VARS)
    local_rank = found[1] if found else 0
    if not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size={world_size!r} must be an integer >= 1")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ConfigError(f"rank={rank!r} must be an integer in [0, world_size={world_size})")
    return rank, world_size, local_rank


def hostname() -> str:
    """This machine's host name (as ``socket.gethostname()``), used to name slow nodes."""
    return socket.gethostname()
