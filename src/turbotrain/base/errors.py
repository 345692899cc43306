"""Exceptions that mean "the user asked for something that cannot work": the CLI turns each into a
one-line message and exit code 2, so each message must say what to change."""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any


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


def required_module(name: str, missing: str) -> Any:
    """The optional module ``name``, or a :class:`TurbotrainError` of the one line ``missing`` (what
    to install)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        raise TurbotrainError(missing) from None


class TurbotrainWarning(UserWarning):
    """A warning about the user's own settings, printed as one line ``WARNING turbotrain: ...``."""


def format_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    line: str | None = None,
    *,
    python_format: Callable[..., str] = warnings.formatwarning,
) -> str:
    """A :class:`TurbotrainWarning` as one line like the log's; every other warning as Python prints it."""
    if issubclass(category, TurbotrainWarning):
        return f"WARNING turbotrain: {message}\n"
    return python_format(message, category, filename, lineno, line)


NOISY_IMPORT_LOGGERS = ("torchao", "torch.utils._pytree")  # CUDA extensions not loaded; Enum deprecation


class ImportNoise(logging.Filter):
    """Drops the two noise lines importing torchao prints (from anywhere); every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)  # unformatted: torchao's is an f-string, pytree's a %s template
        extension = message.startswith("Failed to load ") and ".so: " in message
        return not extension and "is an Enum subclass and is now natively supported" not in message


def filter_import_noise() -> None:
    """Installs :class:`ImportNoise` on those loggers, once (``import turbotrain`` does)."""
    for name in NOISY_IMPORT_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, ImportNoise) for f in logger.filters):
            logger.addFilter(ImportNoise())


@contextlib.contextmanager
def quiet_imports() -> Iterator[None]:
    """Within the block, importing torchao logs no warnings (noise at every import); errors still show."""
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
    """For the block, turbotrain logs to stderr in the CLI's format unless the program set up logging."""
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
