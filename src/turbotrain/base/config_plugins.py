"""A plugin's settings: its own type, read only when the run selects the plugin (docs/architecture.md
"Plugins"): a *variant* of a run section (``GPTSettings(ModelConfig)``: ``config.model`` *is* one in
a GPT run) or a *table* of its own (``[moe]``). The keys of a plugin the run did not select are
dropped when read from a file and refused in one line as flags. Its start-of-run decisions are
hooks too (:func:`register_start`), called in one place, :func:`turbotrain.app.prepare.start`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from .config_fields import range_text, setting

if TYPE_CHECKING:  # the rules read the whole run config
    from _typeshed import DataclassInstance

    from .config import RunConfig

T = TypeVar("T", bound="DataclassInstance")


@dataclass(frozen=True)
class Registration:
    """One plugin's settings (see :func:`turbotrain.base.config.register_settings`)."""

    section: str  # the run section it is a variant of ("model", "precision"), or its own table ("moe")
    cls: type
    when: tuple[str, str, tuple[str, ...]]  # selected when config.<section>.<key> is one of the values
    names: tuple[str, ...]  # the keys it declared (a variant: beyond its section's own)
    check: Callable[[RunConfig], None] | None = None
    unused: Callable[[RunConfig, Sequence[str]], str] | None = None
    table: bool = False  # a table of its own (else a variant of a run section)

    def selected(self, config: Any) -> bool:
        """Whether ``config`` (a run config, or a mapping of built sections) selects this plugin."""
        return selects(self.when, config)

    def unused_line(self, config: RunConfig, given: Sequence[str]) -> str:
        """The one line for its keys ``given`` where they would do nothing ("" where they apply)."""
        if self.unused is not None:
            return self.unused(config, given)
        if self.selected(config):
            return ""
        section, key, values = self.when
        now = getattr(getattr(config, section), key)
        one = len(given) == 1
        return (
            f"{', '.join(f'{self.section}.{k}' for k in given)} configure{'s' if one else ''} "
            f"{section}.{key} = {' or '.join(map(repr, values))} and this run is {section}.{key} = {now!r}: "
            f"{'it' if one else 'they'} would do nothing; drop {'it' if one else 'them'}, or add "
            f"{setting(f'{section}.{key}', values[0])}"
        )


REGISTERED: list[Registration] = []
"""Every plugin's settings, in registration order."""


def selects(when: tuple[str, str, tuple[str, ...]], config: Any) -> bool:
    """Whether ``config`` (a run config, or a mapping of built sections) is one ``when`` selects."""
    section, key, values = when
    owner = config[section] if isinstance(config, dict) else getattr(config, section)
    return getattr(owner, key) in values


@dataclass(frozen=True)
class Start:
    """A run at its start, as a plugin's start hooks see it (:func:`register_start`)."""

    config: RunConfig  # its settings so far
    run_dir: Path
    device: torch.device
    resume_step: Callable[[], int] = lambda: 0  # the step of the checkpoint a resume loads (0: none)
    # once the model is built (``settle``): the model, an example micro-batch of a config, the loss
    model: nn.Module | None = None
    example: Callable[[RunConfig], Any] | None = None
    loss_fn: Callable[[nn.Module, Any], Any] | None = None


@dataclass(frozen=True)
class StartHook:
    """A plugin's start-of-run decisions: ``build`` the model's config, ``settle`` the run's settings."""

    when: tuple[str, str, tuple[str, ...]]
    build: Callable[[Start], RunConfig] | None = None
    settle: Callable[[Start], tuple[RunConfig, dict[str, Any]]] | None = None


START_HOOKS: dict[str, StartHook] = {}
"""Every plugin's start hooks, by the name it registered them under."""


def register_start(
    name: str,
    when: str,
    *,
    build: Callable[[Start], RunConfig] | None = None,
    settle: Callable[[Start], tuple[RunConfig, dict[str, Any]]] | None = None,
) -> None:
    """Declare a plugin's start-of-run decisions for the runs ``when`` selects (again: replaced)."""
    START_HOOKS[name] = StartHook(parse_when(when), build, settle)


def start_hooks(config: RunConfig) -> list[StartHook]:
    """The start hooks of the plugins ``config`` selects, in registration order."""
    return [h for h in START_HOOKS.values() if selects(h.when, config)]


def parse_when(when: str) -> tuple[str, str, tuple[str, ...]]:
    """``"model.arch=gpt,moe"`` -> ``("model", "arch", ("gpt", "moe"))``."""
    target, sep, values = when.partition("=")
    section, dot, key = target.partition(".")
    if not (sep and dot and section and key and values):
        raise ValueError(f"when={when!r}: write the selector as 'section.key=value' (or value,value)")
    return section, key, tuple(v.strip() for v in values.split(","))


def declared(cls: type, base: type | None = None) -> tuple[str, ...]:
    """The fields ``cls`` declares beyond ``base``'s, each a ``knob``, else a TypeError."""
    if not (is_dataclass(cls) and cls.__dataclass_params__.frozen):  # type: ignore[attr-defined]
        raise TypeError(f"{cls.__name__}: settings are a @dataclass(frozen=True) of knob(...) fields")
    if base is not None and not issubclass(cls, base):
        raise TypeError(
            f"{cls.__name__}: settings that live in a run section subclass its class, {base.__name__}"
        )
    inherited = {f.name for f in fields(base)} if base is not None else set()
    out = []
    for f in fields(cls):
        if f.name in inherited:
            continue
        numeric = isinstance(f.default, (int, float)) and not isinstance(f.default, bool)
        if "doc" not in f.metadata or (numeric and not range_text(f)):
            raise TypeError(
                f"{cls.__name__}.{f.name}: declare it with knob(default, help, ...), a number with its range (min=, max=)"
            )
        out.append(f.name)
    return tuple(out)


def variants(section: str) -> list[Registration]:
    """The plugins whose settings are variants of run section ``section``."""
    return [r for r in REGISTERED if r.section == section and not r.table]


def tables() -> list[Registration]:
    """The plugins with a table of their own."""
    return [r for r in REGISTERED if r.table]


def variant_class(section: str, base: type, values: Any) -> type:
    """The class ``[section]`` is read into: the variant ``values`` selects, else ``base``."""
    for r in variants(section):
        key = r.when[1]
        value = values.get(key, getattr(base(), key)) if isinstance(values, dict) else getattr(values, key)
        if value in r.when[2]:
            return r.cls
    return base


def other_keys(section: str, cls: type) -> set[str]:
    """Keys of ``section``'s variants that ``cls`` does not have (dropped from a file)."""
    own = {f.name for f in fields(cls)}
    return {name for r in variants(section) for name in r.names} - own


def same_fields(cls: type, obj: object) -> dict[str, Any]:
    """The fields of the dataclass ``cls`` that ``obj`` holds under the same name, with its values."""
    return {f.name: getattr(obj, f.name) for f in fields(cls) if hasattr(obj, f.name)}


def recast(obj: Any, cls: type[T]) -> T:
    """``obj`` (a section) as a ``cls``: shared fields keep ``obj``'s values, the others their defaults."""
    return obj if type(obj) is cls else cls(**same_fields(cls, obj))
