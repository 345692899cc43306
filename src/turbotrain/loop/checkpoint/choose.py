"""Which checkpoint to restore: the newest one a reader accepts, and whether a model fits it."""

from __future__ import annotations

import logging
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from torch import nn

from ...base.config import MODEL_SECTIONS, migrate
from ...base.errors import TurbotrainError

log = logging.getLogger(__name__)


class ShapeMismatch(TurbotrainError):
    """A checkpoint that verifies, but whose model has another shape than the one built here."""


T = TypeVar("T")
RESUME_ADVICE = (
    "move them away and resume to restart this run from step 0, or start a new run without --resume"
)
SHAPE_ADVICE = "resume with the model settings the run was saved with (its config.toml), or start a new run without --resume"


def newest_usable(
    candidates: list[Path],
    folder: Path,
    read: Callable[[Path], T],
    advice: str = RESUME_ADVICE,
    none: str = "start without --resume",
) -> tuple[Path, T]:
    """The newest of ``candidates`` that ``read`` accepts, with what it returned; each refused one is a
    warning, and when none is left the error lists every reason."""
    if not candidates:
        raise TurbotrainError(f"no checkpoint in {folder}; {none}")
    problems, shapes = [], 0
    for path in reversed(candidates):
        try:
            return path, read(path)
        except TurbotrainError as exc:
            log.warning("skipping checkpoint: %s", exc)
            problems.append(str(exc))
            shapes += isinstance(exc, ShapeMismatch)
    if advice and shapes == len(problems):  # every one is another model's: moving them away is not the answer
        advice = SHAPE_ADVICE
    raise TurbotrainError(
        f"no usable checkpoint in {folder} ({'; '.join(problems)})" + (f"; {advice}" if advice else "")
    )


def _plain_name(name: str) -> str:
    """A state-dict key without the wrappers' parts (DDP's ``module.``, torch.compile's ``_orig_mod.``)."""
    return ".".join(part for part in name.split(".") if part not in ("module", "_orig_mod"))


def model_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor ``model``'s state dict holds, by plain names, read from the modules
    (no state-dict hook runs: expert parallelism's is a collective). Modules with load-time hooks
    (MoE layers grow their experts) are left out: theirs to decide."""
    shapes: dict[str, tuple[int, ...]] = {}
    hooked: list[str] = []
    for prefix, module in model.named_modules(remove_duplicate=False):
        if module._load_state_dict_pre_hooks:
            hooked.append(prefix + ".")
        if any((prefix + ".").startswith(h) for h in hooked):
            continue
        tensors = list(module._parameters.items()) + [
            (n, b) for n, b in module._buffers.items() if n not in module._non_persistent_buffers_set
        ]
        for name, tensor in tensors:
            if tensor is not None:
                shapes[_plain_name(f"{prefix}.{name}" if prefix else name)] = tuple(tensor.shape)
    return shapes


def model_settings_changed(saved_toml: Any, current_toml: Any) -> str:
    """The model settings that differ between a checkpoint's config and this run's (``to_toml``
    text), as flags that give back the saved values; '' when unknown or none."""
    try:
        saved, current = (migrate(tomllib.loads(t)) for t in (saved_toml, current_toml))
    except (TypeError, ValueError, AttributeError):
        return ""
    changed = [
        (s, k)
        for s in MODEL_SECTIONS
        for k in saved.get(s, {})
        if k in current.get(s, {}) and saved[s][k] != current[s][k]
    ]
    return " ".join(f"--{s}.{k}={saved[s][k]}" for s, k in changed)


def shape_problem(
    name: str, saved: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], settings: str = ""
) -> str:
    """'' when checkpoint ``name``'s model tensors fit ``expected``, else one line naming the first
    that does not and the ``settings`` that would build the saved model."""
    saved = {_plain_name(k): tuple(v) for k, v in saved.items()}
    missing = [k for k in expected if k not in saved]
    differ = [k for k in expected if k in saved and saved[k] != expected[k]]
    if not missing and not differ:
        return ""
    parts = []
    if differ:
        k = differ[0]
        parts.append(
            f"{len(differ)} tensor(s) of another shape, e.g. {k}: saved {list(saved[k])}, this config builds "
            f"{list(expected[k])}"
        )
    if missing:
        parts.append(f"{len(missing)} tensor(s) this config builds missing, e.g. {missing[0]}")
    again = f"; it was saved with {settings}" if settings else ""
    return f"{name} does not fit the model this config builds: it was saved by a model of another shape ({'; '.join(parts)}){again}"
