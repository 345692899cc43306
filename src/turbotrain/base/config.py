"""Run configuration: collects, parses, validates and describes every setting, once, when the config
is built. Sources, later wins: field defaults < a TOML preset < ``--section.key=value`` overrides.
The run's own sections are in :mod:`.config_sections`; a plugin's registered with :func:`register_settings`.
"""

from __future__ import annotations

import dataclasses
import tomllib
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields, is_dataclass
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar, get_type_hints

from .config_fields import (  # noqa: F401 (the valid-value lists and sections are read from here too)
    AUTO,
    MAX_STEPS,
    PRECISION_MODES,
    Names,
    audience,
    check_value,
    choice_error,
    field_notes,
    knob,
    range_text,
    setting,
)
from .config_plugins import (
    REGISTERED,
    Registration,
    declared,
    other_keys,
    parse_when,
    recast,
    tables,
    variant_class,
    variants,
)
from .config_sections import (  # noqa: F401 (the valid-value lists and sections are read from here too)
    ARCHS,
    BATCH_PICKS,
    BEST_MODES,
    CHECKPOINTING_MODES,
    COMPILE_MODES,
    COMPILE_SCOPES,
    DIST_STRATEGIES,
    LR_SCALINGS,
    OOM_POLICIES,
    OPTIM_IMPLEMENTATIONS,
    SCHEDULES,
    BatchConfig,
    BestConfig,
    ChooseConfig,
    CompileConfig,
    DataConfig,
    DistributedConfig,
    MemoryConfig,
    ModelConfig,
    MonitorConfig,
    OptimConfig,
    PrecisionConfig,
    RunSection,
    TrainConfig,
    check_run,
)
from .errors import ConfigError, TurbotrainWarning

T = TypeVar("T")


@dataclass(frozen=True)
class RunConfig:
    """The whole run, one attribute per concern (``--help-config``): ``model`` and ``precision`` hold
    the variant their selector picks, ``tables`` the plugins' own (``config.table(MoESettings)``)."""

    preset: str = knob("gpt-tiny", "the preset this config started from")
    run: RunSection = field(default_factory=RunSection)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    best: BestConfig = field(default_factory=BestConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    choose: ChooseConfig = field(default_factory=ChooseConfig)
    tables: tuple[Any, ...] = ()  # the plugins' own tables (``[moe]``), in --help-config order

    def __post_init__(self) -> None:
        for name, base in OWN_SECTIONS.items():
            section = getattr(self, name)
            wanted = variant_class(name, base, section)
            if type(section) is not wanted:
                object.__setattr__(self, name, recast(section, wanted))
        have = {type(t): t for t in self.tables}
        for r in tables():
            if r.cls not in have and r.selected(self):
                have[r.cls] = r.cls()
        order = [r.cls for r in tables()]
        settled = tuple(
            sorted(have.values(), key=lambda t: order.index(type(t)) if type(t) in order else len(order))
        )
        if settled != self.tables:
            object.__setattr__(self, "tables", settled)

    def table(self, cls: type[T]) -> T:
        """A plugin's own table (``config.table(MoESettings)``): as read, else its defaults."""
        for t in self.__dict__.get("tables", ()):
            if type(t) is cls:
                return t
        return cls()

    def __getattr__(self, name: str) -> Any:
        """A plugin's own table by its name (``config.moe``), for code written before it was a table."""
        reg = next((r for r in tables() if r.section == name), None)
        if reg is None or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return self.table(reg.cls)

    def to_dict(self) -> dict[str, Any]:
        """The config as nested tables (as TOML gives them): ``from_dict`` reads it back."""
        out: dict[str, Any] = {"preset": self.preset}
        own = {r.cls: r.section for r in tables()}
        present = {own[type(t)]: t for t in self.tables if type(t) in own}
        for name in SECTIONS:
            section = getattr(self, name) if name in OWN_SECTIONS else present.get(name)
            if section is not None:
                out[name] = asdict(section)
        return out

    def replace(self, **sections: Any) -> RunConfig:
        """Copy with whole sections or ``section={"key": value}`` dicts replaced (validated)."""
        data = self.to_dict()
        for name, value in sections.items():
            if isinstance(value, Mapping) and isinstance(data.get(name), dict):
                data[name].update(value)
            else:
                data[name] = asdict(value) if is_dataclass(value) and not isinstance(value, type) else value
        return from_dict(data)


OWN_SECTIONS: dict[str, type] = {
    f.name: f.default_factory  # type: ignore[misc]
    for f in fields(RunConfig)
    if f.default_factory is not MISSING
}
"""The run's own sections by name, each with its class (a plugin's variant subclasses it)."""

SECTIONS: dict[str, type] = dict(OWN_SECTIONS)
"""Every section by name, in ``--help-config`` order (the plugins' tables after the section they name)."""

MODEL_SECTIONS = Names("model")
"""The sections that decide the model's tensors (a checkpoint fits or not): ``[model]``, ``[moe]``."""

MOVED: dict[str, str] = {}
"""Settings that moved (old ``section.key`` -> new): a file is read with them moved; a new command
line or dict that names the old place gets one line naming the new one."""

DROPPED: dict[str, str] = {
    "memory.inject_oom_at_step": "the tests inject out-of-memory errors themselves",
}
"""Settings that are no more (-> where what it did went): a file loads without them, with one line."""


def register_settings(
    section: str,
    cls: type,
    *,
    when: str,
    after: str | None = None,
    check: Callable[[RunConfig], None] | None = None,
    unused: Callable[[RunConfig, Sequence[str]], str] | None = None,
    moved: Mapping[str, str] | None = None,
    model_shape: bool = False,
) -> None:
    """Declare a plugin's settings ``cls`` (a frozen dataclass of :func:`knob` fields), read only
    when ``when`` (``"model.arch=moe"``, values comma-separated) selects it.

    ``section``: a run section (``cls`` subclasses it) or a new table's name (listed after
    ``after``). ``check(config)`` raises one line for rules that span fields; ``unused(config,
    given)`` returns the one line for settings that would do nothing ("" where they apply);
    ``moved`` maps an old ``section.key`` to its key here; ``model_shape``: resume compares it."""
    selector = parse_when(when)
    variant = section in OWN_SECTIONS
    if variant and selector[0] != section:
        raise ValueError(f"{cls.__name__}: a variant of [{section}] is selected by a key of [{section}]")
    names = declared(cls, OWN_SECTIONS[section] if variant else None)
    registration = Registration(section, cls, selector, names, check, unused, not variant)
    if _registered_again(registration):
        return
    if not variant and section in SECTIONS:
        raise ValueError(f"{cls.__name__}: [{section}] is already a section")
    clash = sorted({n for r in variants(section) for n in r.names if r.cls is not cls} & set(names))
    if clash:
        raise ValueError(f"{cls.__name__}: {section}.{clash[0]} is already another plugin's setting")
    REGISTERED.append(registration)
    if not variant:
        _place(section, cls, after)
    MOVED.update({old: f"{section}.{new}" for old, new in (moved or {}).items()})
    if model_shape:
        MODEL_SECTIONS.add(section)


def _registered_again(new: Registration) -> bool:
    """Join a class registered before (a second family, a reloaded module); False when it is new."""
    key = (new.cls.__module__, new.cls.__qualname__, new.section)
    for i, r in enumerate(REGISTERED):
        if (r.cls.__module__, r.cls.__qualname__, r.section) == key:
            same_key = r.when[:2] == new.when[:2]
            values = tuple(dict.fromkeys((*r.when[2], *new.when[2]))) if same_key else new.when[2]
            REGISTERED[i] = dataclasses.replace(
                new, when=(*new.when[:2], values), check=new.check or r.check, unused=new.unused or r.unused
            )
            return True
    return False


def _place(name: str, cls: type, after: str | None) -> None:
    """Put table ``name`` into :data:`SECTIONS` after section ``after`` (else at the end)."""
    items = list(SECTIONS.items())
    at = len(items) if after not in SECTIONS else [n for n, _ in items].index(after) + 1
    items.insert(at, (name, cls))
    SECTIONS.clear()
    SECTIONS.update(items)


def known_keys(section: str) -> list[str]:
    """Every key ``[section]`` may hold: its own and its variants' (``--help-config`` order)."""
    return [f.name for f in section_fields(section)]


def preset_names() -> list[str]:
    """Names of the TOML presets shipped inside the package."""
    folder = resources.files("turbotrain") / "presets"
    return sorted(p.name[: -len(".toml")] for p in folder.iterdir() if p.name.endswith(".toml"))


def read_preset(name_or_path: str) -> dict[str, Any]:
    """A preset's raw table: a shipped preset name, or a path to a TOML file."""
    path = Path(name_or_path)
    if name_or_path.endswith(".toml") and path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"preset {name_or_path!r} is not UTF-8 text (byte {exc.start}); save it as UTF-8"
            ) from None
    else:
        resource = resources.files("turbotrain") / "presets" / f"{name_or_path}.toml"
        if not resource.is_file():
            raise ConfigError(
                f"unknown preset {name_or_path!r}; valid presets: {', '.join(preset_names())} "
                "(or a path to a .toml file)"
            )
        text = resource.read_text()
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"preset {name_or_path!r} is not valid TOML: {exc}") from None
    table.setdefault("preset", path.stem if path.suffix == ".toml" else name_or_path)
    return migrate(table)


def migrate(table: dict[str, Any]) -> dict[str, Any]:
    """A file's table with :data:`MOVED` settings moved and :data:`DROPPED` ones dropped (one line each)."""
    for old, why in DROPPED.items():
        section, key = old.split(".")
        if isinstance(table.get(section), dict) and key in table[section]:
            del table[section][key]
            warnings.warn(f"{old} is no longer a setting ({why}); ignored", TurbotrainWarning, stacklevel=2)
    for old, new in MOVED.items():
        (section, key), (to_section, to_key) = old.split("."), new.split(".")
        if isinstance(table.get(section), dict) and key in table[section]:
            value = table[section].pop(key)
            if isinstance(table.setdefault(to_section, {}), dict):
                table[to_section].setdefault(to_key, value)
    return table


def _coerce(section: str, key: str, hint: Any, value: Any) -> Any:
    """Turn ``value`` (from TOML or a command-line string) into the field's type, or raise."""
    where = f"{section}.{key}" if section else key
    allowed = hint.__args__ if hasattr(hint, "__args__") else (hint,)
    if isinstance(value, str):
        text = value.strip()
        if bool in allowed:
            low = text.lower()
            if low in ("true", "1", "yes", "on"):
                return True
            if low in ("false", "0", "no", "off"):
                return False
        for kind in (int, float):
            if kind in allowed:
                try:
                    return kind(text)
                except ValueError:
                    pass
        if str in allowed:
            return value
    elif isinstance(value, bool):  # a bool is not an int here
        if bool in allowed:
            return value
    elif int in allowed and isinstance(value, int):
        return value
    elif float in allowed and isinstance(value, (int, float)):
        return float(value)
    names = " or ".join(t.__name__ for t in allowed)
    raise ConfigError(f"{where} must be {names}, got {value!r}")


def _build_section(name: str, cls: type, table: Mapping[str, Any]) -> Any:
    hints = get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    elsewhere = other_keys(name, cls) if name in OWN_SECTIONS else set()  # another variant's: dropped
    unknown = sorted(set(table) - known - elsewhere)
    moved = [k for k in unknown if f"{name}.{k}" in MOVED]
    if moved:
        new = MOVED[f"{name}.{moved[0]}"]
        raise ConfigError(
            f"{name}.{moved[0]} is now {new} (the family's own section); use {setting(new, table[moved[0]])}"
        )
    if unknown:
        raise ConfigError(
            f"unknown key {name}.{unknown[0]}; valid keys in [{name}]: {', '.join(sorted(known))}"
        )
    values = {k: _coerce(name, k, hints[k], v) for k, v in table.items() if k in known}
    return cls(**values)


def _table(data: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    table = data.get(name, {})
    if not isinstance(table, Mapping):
        raise ConfigError(f"[{name}] must be a table of keys, got {table!r}")
    return table


def from_dict(data: Mapping[str, Any]) -> RunConfig:
    """Build and validate a :class:`RunConfig` from nested tables (as TOML gives them)."""
    unknown = sorted(set(data) - set(SECTIONS) - {"preset"})
    if unknown:
        raise ConfigError(f"unknown section {unknown[0]!r}; valid sections: {', '.join(SECTIONS)}")
    built: dict[str, Any] = {}
    for name, base in OWN_SECTIONS.items():
        table = _table(data, name)
        built[name] = _build_section(name, variant_class(name, base, dict(table)), table)
    own = tuple(
        _build_section(r.section, r.cls, _table(data, r.section))
        for r in tables()
        if r.section in data or r.selected(built)
    )
    config = RunConfig(preset=str(data.get("preset", "custom")), **built, tables=own)
    validate(config)
    return config


def parse_overrides(args: Iterable[str]) -> dict[str, dict[str, str]]:
    """``["--optim.lr=1e-3", "--train.max_steps", "50"]`` -> ``{"optim": {"lr": "1e-3"}, ...}``."""
    out: dict[str, dict[str, str]] = {}
    items = iter(args)
    for arg in items:
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(f"cannot read argument {arg!r}; overrides look like --section.key=value")
        key, sep, value = arg[2:].partition("=")
        if not sep:
            given = next(items, None)
            if given is None:
                raise ConfigError(f"--{key} needs a value, for example --{key}=VALUE")
            value = given
        section, _, name = key.partition(".")
        out.setdefault(section, {})[name] = value
    return out


def comma_list(text: str) -> list[str]:
    """``"a, b,,c"`` -> ``["a", "b", "c"]``: the items of a comma-separated setting, stripped,
    empties dropped."""
    return [item.strip() for item in text.split(",") if item.strip()]


def flat(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (overrides as ``section.key``; MLflow's params and W&B's
    summary are flat)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flat(value, f"{name}."))
        else:
            out[name] = value
    return out


def load_config(
    preset: str | None = None, overrides: Iterable[str] | Mapping[str, Mapping[str, Any]] = ()
) -> RunConfig:
    """The config for a run: ``preset`` (a name or a .toml path) with ``overrides`` applied."""
    table: dict[str, Any] = read_preset(preset) if preset else {}
    extra = overrides if isinstance(overrides, Mapping) else parse_overrides(overrides)
    for section, values in extra.items():
        if section not in SECTIONS:
            raise ConfigError(f"unknown section {section!r}; valid sections: {', '.join(SECTIONS)}")
        table.setdefault(section, {}).update(values)
    config = from_dict(table)
    given = {section: list(values) for section, values in extra.items()}
    # the run's own settings given (never a file's) where they would do nothing: their one line
    message = _unused_best(config, given) or _unused_trackers(config, given)
    for r in REGISTERED:  # a plugin's settings given where they would do nothing: its one line
        if message:
            break
        mine = [k for k in given.get(r.section, ()) if k in r.names]
        message = r.unused_line(config, mine) if mine else ""
    if message:
        raise ConfigError(message)
    return config


_TRACKER_FIELDS = {
    "wandb_mode": ("wandb",),
    "mlflow_uri": ("mlflow",),
    "project": ("wandb", "mlflow", "trackio"),
}


def _unused_trackers(config: RunConfig, given: Mapping[str, Sequence[str]]) -> str:
    """monitor.wandb_mode, mlflow_uri or project while the trackers they configure are off."""
    m = config.monitor
    idle = [
        k
        for k in given.get("monitor", ())
        if k in _TRACKER_FIELDS and not any(getattr(m, t) for t in _TRACKER_FIELDS[k])
    ]
    if not idle:
        return ""
    on = [t for t in ("wandb", "mlflow", "trackio") if any(t in _TRACKER_FIELDS[k] for k in idle)]
    return (
        f"{', '.join(f'monitor.{k}' for k in idle)} only configure{'s' if len(idle) == 1 else ''} "
        f"{' / '.join(f'monitor.{t}' for t in on)}, off in this run: nothing would use "
        f"{'it' if len(idle) == 1 else 'them'}; add {' or '.join(setting(f'monitor.{t}', 'true') for t in on)}, "
        f"or drop {'it' if len(idle) == 1 else 'them'}"
    )


def _unused_best(config: RunConfig, given: Mapping[str, Sequence[str]]) -> str:
    """best.metric, mode or min_delta while nothing watches the metric."""
    b = config.best
    idle = [k for k in given.get("best", ()) if k in ("metric", "mode", "min_delta")]
    if b.patience or b.checkpoint or not idle:
        return ""
    return (
        f"{', '.join(f'best.{k}' for k in idle)} choose{'s' if len(idle) == 1 else ''} what early stopping "
        "and the best checkpoint watch, "
        f"and neither is on: add {setting('best.patience', 3)} or {setting('best.checkpoint', 'true')}"
    )


def validate(config: RunConfig) -> None:
    """Check every field's choices and bounds, then the run's and each selected plugin's rules."""
    sections = [(name, getattr(config, name)) for name in OWN_SECTIONS]
    own = {r.cls: r.section for r in tables()}
    for name, section in [*sections, *((own.get(type(t), "?"), t) for t in config.tables)]:
        for f in fields(section):
            check_value(f"{name}.{f.name}", f, getattr(section, f.name))
    check_run(config)
    for r in REGISTERED:  # the rules of the plugins the run selects
        if r.check is not None and r.selected(config):
            r.check(config)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def to_toml(config: RunConfig) -> str:
    """The resolved config as TOML, readable back with ``load_config(path)``."""
    lines = [f"preset = {_toml_value(config.preset)}"]
    for name, values in config.to_dict().items():
        if name == "preset":
            continue
        lines.append(f"\n[{name}]")
        docs = {f.name: f.metadata["doc"] for f in fields(getattr(config, name))}
        for key, value in values.items():
            lines.append(f"{key} = {_toml_value(value)}  # {docs[key]}")
    return "\n".join(lines) + "\n"


def section_fields(name: str) -> list[dataclasses.Field]:
    """The fields ``[name]`` lists in ``--help-config`` and the docs: its own, then its variants'."""
    out: dict[str, dataclasses.Field] = {}
    for owner in [SECTIONS[name], *(r.cls for r in variants(name))]:
        out.update({f.name: f for f in fields(owner) if f.name not in out})
    return list(out.values())


def describe() -> str:
    """Every field with its default and documentation, for ``--help-config``."""
    out = []
    for name in SECTIONS:
        out.append(f"[{name}]")
        for f in section_fields(name):
            out.append(f"  --{name}.{f.name}={f.default!r}: {f.metadata['doc']}{field_notes(f)}")
    return "\n".join(out)
