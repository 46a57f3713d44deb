"""All exceptions trainhealth raises, in one flat module."""

from __future__ import annotations


class TrainHealthError(Exception):
    """Base class of every trainhealth error."""


class ConfigError(TrainHealthError, ValueError):
    """A setting or argument has a bad value; the message names the field and the value."""


class RedisUnavailableError(TrainHealthError):
    """No Redis server could be reached or started."""


class InputFormatError(TrainHealthError, ValueError):
    """An input file (log, trainer_state.json) is malformed; the message names file, place and field."""
