"""How a config field is declared (:func:`knob`, :class:`Names`) and the one wording of a setting and
of a wrong value; a module of its own so a plugin declares its settings without importing :mod:`.config`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import field
from typing import Any

from .errors import ConfigError

AUTO = "auto"


class Names:
    """A valid-value list that grows as plugins register (``first`` before them), read live."""

    def __init__(self, *first: str, then: Names | None = None) -> None:
        self._own, self._then = list(first), then

    def add(self, name: str) -> None:
        if name not in self._own:
            self._own.append(name)

    def __iter__(self) -> Iterator[str]:
        yield from self._own
        if self._then is not None:
            yield from self._then

    def __contains__(self, name: object) -> bool:
        return any(name == n for n in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return repr(tuple(self))


PRECISION_MODES = Names()  # filled by each Precision subclass's definition (turbotrain.core.precision)
PRECISION_CHOICES = Names(AUTO, then=PRECISION_MODES)


_AUDIENCE = ["python"]  # who reads error messages: "python" (a library caller) or "cli"


@contextlib.contextmanager
def audience(who: str) -> Iterator[None]:
    """Within the block, :func:`setting` speaks to ``who``: "cli" or "python"."""
    previous, _AUDIENCE[0] = _AUDIENCE[0], who
    try:
        yield
    finally:
        _AUDIENCE[0] = previous


def setting(field_name: str, value: Any) -> str:
    """How the reader sets ``section.key``: ``--run.device=cpu``, or ``{"run": {"device": "cpu"}}``."""
    if _AUDIENCE[0] == "cli":
        return f"--{field_name}={value}"
    section, key = field_name.split(".", 1)
    return f"{{{section!r}: {{{key!r}: {value!r}}}}}".replace("'", '"')


def said(cli: str, python: str) -> str:
    """The words of a message that differ by reader: ``cli`` on the command line, else ``python``."""
    return cli if _AUDIENCE[0] == "cli" else python


def choice_error(field_name: str, value: Any, choices: Iterable[Any]) -> ConfigError:
    """The one wording of "not a valid value": the field, the value and every valid value."""
    return ConfigError(
        f"{field_name} = {value!r} is not valid; choose one of: {', '.join(map(str, choices))}"
    )


# Bounds that come from what the code can do (every numeric field declares a range; validate checks it).
MAX_STEPS = 99_999_999  # checkpoint names hold the step in 8 digits (step_00000003.pt), and sort by them
MAX_TIMEOUT_S = 2_147_483  # the largest whole number of milliseconds a C int holds (2**31 - 1 ms, 24.8 days)
MAX_BATCH = 2**20  # sequences per micro-batch, per optimizer step or in a global batch
MAX_SEED = 2**32 - 1  # numpy's seeds are 32 bits


def knob(
    default: Any,
    doc: str,
    *,
    choices: Iterable[Any] | None = None,
    min: float | None = None,
    max: float | None = None,
    below: float | None = None,
) -> Any:
    """A documented config field; a numeric one declares its range (``min``, ``max`` or open ``below``)."""
    live = isinstance(choices, Names)  # read at each use: plugins may add values after this field is defined
    meta = {
        "doc": doc,
        "choices": choices if live or choices is None else tuple(choices),
        "min": min,
        "max": below if below is not None else max,
        "open": below is not None,
    }
    return field(default=default, metadata=meta)


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 2**53 else f"{x:g}"


def range_text(f: dataclasses.Field) -> str:
    """A numeric field's declared range, ``[1, 99999999]`` or ``[0, 1)``; "" for other fields."""
    low, high = f.metadata.get("min"), f.metadata.get("max")
    if low is None and high is None:
        return ""
    low_text = "-inf" if low is None else _number(low)  # one open end (in_range admits it)
    high_text = "inf" if high is None else _number(high)
    return f"[{low_text}, {high_text}{')' if f.metadata.get('open') else ']'}"


def field_notes(f: dataclasses.Field) -> str:
    """What ``--help-config`` adds after a field's doc: its choices and its range, if it has them."""
    choices = f.metadata.get("choices")
    notes = f" (one of: {', '.join(map(str, choices))})" if choices else ""
    return notes + (f" (range {range_text(f)})" if range_text(f) else "")


def in_range(f: dataclasses.Field, value: float) -> bool:
    """Whether ``value`` lies in field ``f``'s declared range (NaN never does)."""
    low, high = f.metadata.get("min"), f.metadata.get("max")
    if low is not None and not value >= low:
        return False
    if high is not None and not (value < high if f.metadata.get("open") else value <= high):
        return False
    return True


def check_value(where: str, f: dataclasses.Field, value: Any) -> None:
    """Raise the one line for a value outside ``f``'s choices or range, or not finite, or past 64 bits."""
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise choice_error(where, value, choices)
    if isinstance(value, float) and not abs(value) < float("inf"):  # NaN or +-inf
        raise ConfigError(f"{where} = {value!r} must be a finite number, e.g. {setting(where, f.default)}")
    if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**63:
        raise ConfigError(
            f"{where} = {value} does not fit a 64-bit integer; e.g. {setting(where, f.default)}"
        )
    if isinstance(value, (int, float)) and not isinstance(value, bool) and not in_range(f, value):
        raise ConfigError(
            f"{where} = {value!r} is outside its range {range_text(f)}, e.g. {setting(where, f.default)}"
        )
