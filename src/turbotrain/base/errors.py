"""Exceptions that mean "the user asked for something that cannot work".

The CLI turns every :class:`TurbotrainError` into a one-line message and exit code 2, so each
message must say what to change, not just what went wrong.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from collections.abc import Callable, Iterator


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


def format_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    line: str | None = None,
    *,
    python_format: Callable[..., str] = warnings.formatwarning,
) -> str:
    """A :class:`TurbotrainWarning` as one line, like the log's (``WARNING turbotrain: ...``);
    every other warning as Python prints it (source line included: it points at someone's code)."""
    if issubclass(category, TurbotrainWarning):
        return f"WARNING turbotrain: {message}\n"
    return python_format(message, category, filename, lineno, line)


# optional CUDA extensions not loaded; Enum pytree deprecation
NOISY_IMPORT_LOGGERS = (
    "torchao",
    "torch.utils._pytree",
)


class ImportNoise(logging.Filter):
    """Drops two lines importing torchao prints wherever it is imported from (transformers imports
    it through its quantizers): each optional CUDA extension it cannot load, and torch's deprecation
    notice for the Enums it registers. Every other record of these loggers passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)  # unformatted: torchao's is an f-string, pytree's a %s template
        extension = message.startswith("Failed to load ") and ".so: " in message
        return not extension and "is an Enum subclass and is now natively supported" not in message


def filter_import_noise() -> None:
    """Installs :class:`ImportNoise` on torchao's and torch's pytree loggers for the process, once
    (``import turbotrain`` does): a script that imports turbotrain before transformers or torchao
    then shows neither line. The user's own loggers are untouched."""
    for name in NOISY_IMPORT_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, ImportNoise) for f in logger.filters):
            logger.addFilter(ImportNoise())


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


LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"  # the CLI's lines (its logging.basicConfig)


@contextlib.contextmanager
def logging_unless_configured() -> Iterator[None]:
    """For the block, turbotrain's INFO lines go to stderr in the CLI's format when the program has
    set up no logging (no handler on turbotrain's logger or above it): ``turbotrain.train()`` in a
    plain script opens as ``turbotrain train`` does, its warnings one line each as there. A program that configures logging keeps its
    own; the root logger is not touched."""
    logger = logging.getLogger("turbotrain")
    if logger.hasHandlers():
        yield
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    level = logger.level
    logger.setLevel(level or logging.INFO)  # a level the program gave turbotrain's logger stays
    logger.addHandler(handler)
    # turbotrain's warnings in the same one-line format (others as Python prints them), for the block
    previous_format, warnings.formatwarning = warnings.formatwarning, format_warning
    try:
        yield
    finally:
        warnings.formatwarning = previous_format
        logger.removeHandler(handler)
        logger.setLevel(level)
