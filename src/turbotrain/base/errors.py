"""Exceptions that mean "the user asked for something that cannot work".

The CLI turns every :class:`TurbotrainError` into a one-line message and exit code 2, so each
message must say what to change, not just what went wrong.
"""

from __future__ import annotations


class TurbotrainError(Exception):
    """A user-facing error: bad config, bad data path, unusable checkpoint."""


class ConfigError(TurbotrainError, ValueError):
    """A config field has an unknown name, a wrong type or an invalid value."""


class PlacementError(TurbotrainError, RuntimeError):
    """A parameter or batch tensor is not on the engine's device."""


class NonFiniteError(TurbotrainError, FloatingPointError):
    """Training produced non-finite losses or gradients and the policy says stop."""


class LossError(TurbotrainError, TypeError):
    """What the model or loss function returned is not a scalar loss."""
