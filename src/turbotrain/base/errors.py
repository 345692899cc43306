"""Exceptions that mean "the user asked for something that cannot work".

The CLI turns every :class:`TurbotrainError` into a one-line message and exit code 2, so each
message must say what to change, not just what went wrong.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


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


class TurbotrainWarning(UserWarning):
    """A warning about the user's own settings (slow here, for tests only): ``turbotrain`` commands
    print it as one line, ``WARNING turbotrain: ...``, without Python's source line."""


# optional CUDA extensions not loaded; Enum pytree deprecation
NOISY_IMPORT_LOGGERS = (
    "torchao",
    "torch.utils._pytree",
)


@contextlib.contextmanager
def quiet_imports() -> Iterator[None]:
    """Within the block, importing torchao (directly, or through transformers) logs no warnings:
    one per optional CUDA extension it cannot load (all of them on a CPU), one that triton is
    missing, and torch's deprecation notice for the Enums it registers. Noise at every import, not
    news; errors still show. Only these loggers, only for the block."""
    loggers = [logging.getLogger(name) for name in NOISY_IMPORT_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
