"""Your own model for ``bench``, ``profile``, ``tune`` and ``train``: ``--model FILE.py:FUNC`` (or
``package.module:FUNC``), where FUNC takes no arguments and returns a :class:`Workload` (or a dict
with its keys). Bench rows, tune trials and profile's verification runs call FUNC again in each
run, so FUNC must build everything fresh (turbotrain seeds torch before calling it).
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import sys
import traceback
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, RandomSampler

from ..base.errors import TurbotrainError, quiet_imports
from ..base.failure import first_line


@dataclass
class Workload:
    """A model and its data, ready for turbotrain's tools (``--model FILE.py:FUNC``)::

        def make():
            loader = DataLoader(MyImages(), batch_size=64, shuffle=True)
            return Workload(model=MyNet(), train_loader=loader)

    ``optimizer`` None: AdamW from the run's ``optim`` section; ``loss_fn(model, batch)`` None: the
    model returns the loss (``model(*batch)``, ``model(**batch)`` for a mapping);
    ``metrics_fn(model, batch)``: validation metrics besides the loss, ``{"accuracy": tensor}``
    (0-d tensors averaged over the eval batches, logged as ``val_accuracy``)."""

    model: nn.Module
    train_loader: Iterable[Any]
    optimizer: torch.optim.Optimizer | None = None
    loss_fn: Callable[[nn.Module, Any], Any] | None = None
    eval_loader: Iterable[Any] | None = None
    metrics_fn: Callable[[nn.Module, Any], Mapping[str, torch.Tensor]] | None = None
    source: str = ""  # the FILE.py:FUNC it came from ("" when built in Python)

    def describe(self) -> str:
        """One line: the model, its size, the loader and the loss."""
        params = sum(p.numel() for p in self.model.parameters())
        loss = (
            "the model returns it" if self.loss_fn is None else getattr(self.loss_fn, "__name__", "loss_fn")
        )
        optimizer = (
            "AdamW from the optim section" if self.optimizer is None else type(self.optimizer).__name__
        )
        where = f"{self.source}: " if self.source else ""
        return f"{where}{type(self.model).__name__} ({params:,} params); data {loader_summary(self.train_loader)}; loss: {loss}; optimizer: {optimizer}"


FIELDS = tuple(f.name for f in fields(Workload) if f.name != "source")


def loader_summary(loader: Iterable[Any]) -> str:
    """``DataLoader(batch_size=64, num_workers=0, pin_memory=False)`` or the iterable's type."""
    if isinstance(loader, DataLoader):
        return (
            f"DataLoader(batch_size={loader.batch_size}, num_workers={loader.num_workers}, "
            f"pin_memory={loader.pin_memory})"
        )
    return type(loader).__name__


def as_workload(obj: Any, where: str = "the workload function") -> Workload:
    """``obj`` (a :class:`Workload` or a dict of its keys) checked field by field, a wrong one one line."""
    expected = "return turbotrain.Workload(model=..., train_loader=...) or a dict with those keys"
    if isinstance(obj, Workload):
        w = obj
    elif isinstance(obj, Mapping):
        unknown = sorted(set(obj) - set(FIELDS))
        if unknown:
            raise TurbotrainError(
                f"{where} returned a dict with unknown key {unknown[0]!r}; valid keys: {', '.join(FIELDS)}"
            )
        missing = [k for k in ("model", "train_loader") if k not in obj]
        if missing:
            raise TurbotrainError(f"{where} returned a dict without {missing[0]!r}; {expected}")
        w = Workload(**obj)
    else:
        raise TurbotrainError(f"{where} returned {_what(obj)}; {expected}")
    if not isinstance(w.model, nn.Module):
        raise TurbotrainError(f"{where}: model is {_what(w.model)}, not a torch.nn.Module")
    if isinstance(w.train_loader, (str, bytes)) or not isinstance(w.train_loader, Iterable):
        raise TurbotrainError(
            f"{where}: train_loader is {_what(w.train_loader)}; give an iterable of batches (a DataLoader, a list)"
        )
    optional: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
        ("eval_loader", lambda v: isinstance(v, Iterable), "an iterable of batches or None"),
        (
            "optimizer",
            lambda v: isinstance(v, torch.optim.Optimizer),
            "a torch.optim.Optimizer over the model's parameters, or None",
        ),
        ("metrics_fn", callable, "a function (model, batch) -> {name: scalar tensor}, or None"),
        ("loss_fn", callable, "a function (model, batch) -> scalar loss, or None"),
    )
    for name, ok, want in optional:
        value = getattr(w, name)
        if value is not None and not ok(value):
            raise TurbotrainError(f"{where}: {name} is {_what(value)}; give {want}")
    return w


def _what(obj: Any) -> str:
    if obj is None:
        return "None"
    return f"a {type(obj).__module__}.{type(obj).__qualname__}".replace("builtins.", "")


def copy_workload(w: Workload) -> Workload:
    """A copy with a new model and optimizer (one deepcopy of both); loaders and functions shared."""
    model, optimizer = copy.deepcopy((w.model, w.optimizer))
    return Workload(model, w.train_loader, optimizer, w.loss_fn, w.eval_loader, w.metrics_fn, w.source)


def split_ref(ref: str) -> tuple[str, str]:
    """``"path/to/file.py:make"`` -> (``"path/to/file.py"``, ``"make"``); likewise ``pkg.mod:make``."""
    module, sep, func = ref.rpartition(":")
    if not sep or not module or not func.isidentifier():
        raise TurbotrainError(
            f"--model {ref!r}: give FILE.py:FUNC or package.module:FUNC (FUNC returns a Workload)"
        )
    return module, func


def _import(ref: str, module: str) -> Any:
    if module.endswith(".py") or "/" in module or "\\" in module:
        path = Path(module).expanduser().resolve()
        if not path.is_file():
            raise TurbotrainError(
                f"--model {ref}: there is no file {module}; give FILE.py:FUNC with an existing file"
            )
        taken = sys.modules.get(path.stem)
        name = (
            path.stem
            if taken is None or getattr(taken, "__file__", None) == str(path)
            else f"turbotrain_workload_{path.stem}"
        )
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        if str(path.parent) not in sys.path:
            sys.path.insert(0, str(path.parent))  # its own sibling imports work, as when run as a script
        sys.modules[name] = mod  # classes defined there can be pickled (DataLoader workers, checkpoints)
        _call(ref, f"importing {path.name}", spec.loader.exec_module, mod)
        return mod
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and module.startswith(exc.name):
            raise TurbotrainError(
                f"--model {ref}: no module named {exc.name!r}; give FILE.py:FUNC or an importable package.module:FUNC"
            ) from None
        return _call(ref, f"importing {module}", importlib.import_module, module)


def _call(ref: str, doing: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``; an exception in the user's code becomes one line naming where it happened."""
    try:
        return fn(*args)
    except TurbotrainError:
        raise
    except Exception as exc:
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if "importlib" not in f.filename]
        at = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
        message = first_line(exc)
        raise TurbotrainError(f"--model {ref}: {doing} raised {type(exc).__name__}{at}: {message}") from exc


def load_workload(ref: str, seed: int | None = 0) -> Workload:
    """Import FILE.py (or package.module), call FUNC after ``torch.manual_seed(seed)`` (None:
    unseeded) and check what it returned. Every mistake is one TurbotrainError line: a missing
    file or module, no such function, an exception in it (with file:line), a wrong return value."""
    module_name, func_name = split_ref(ref)
    with quiet_imports():  # torchao's load warnings, through transformers: noise at every import
        module = _import(ref, module_name)
    func = getattr(module, func_name, None)
    if func is None:
        names = sorted(
            n
            for n, v in vars(module).items()
            if callable(v) and not n.startswith("_") and getattr(v, "__module__", None) == module.__name__
        )
        raise TurbotrainError(
            f"--model {ref}: {module_name} has no function {func_name!r}"
            + (f"; it defines: {', '.join(names)}" if names else "")
        )
    if not callable(func):
        raise TurbotrainError(f"--model {ref}: {func_name} is {_what(func)}, not a function")
    if seed is not None:
        torch.manual_seed(seed)
    w = as_workload(_call(ref, f"calling {func_name}()", func), f"--model {ref}: {func_name}()")
    w.source = ref
    return w


def rebuild_loader(
    loader: Iterable[Any],
    *,
    num_workers: int | None = None,
    batch_size: int | None = None,
    seed: int | None = None,
) -> DataLoader:
    """A DataLoader like ``loader`` (dataset, sampling, collate_fn, drop_last, pin_memory) with
    ``num_workers`` and/or ``batch_size`` changed: how profile and tune change your workload's
    loader (a torch DataLoader only). With ``seed``, shuffling and the workers' base seed draw from
    generators of their own: runs with other settings see the same samples in the same order."""
    if not isinstance(loader, DataLoader):
        raise TurbotrainError(
            f"only a torch DataLoader's settings can be changed, and train_loader is {_what(loader)}"
        )
    workers = loader.num_workers if num_workers is None else num_workers
    kwargs: dict[str, Any] = dict(
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        generator=loader.generator,
        num_workers=workers,
        persistent_workers=workers > 0,
        multiprocessing_context=loader.multiprocessing_context if workers > 0 else None,
    )
    if workers > 0 and loader.prefetch_factor is not None:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    iterable = isinstance(loader.dataset, IterableDataset)
    if loader.batch_size is None and loader.batch_sampler is not None and not iterable:
        if batch_size is not None:
            raise TurbotrainError(
                "this DataLoader batches with a custom batch_sampler; change its batch size in your code"
            )
        kwargs["batch_sampler"] = loader.batch_sampler  # its own batching, kept exactly
    else:
        kwargs.update(batch_size=batch_size or loader.batch_size, drop_last=loader.drop_last)
        if not iterable:
            kwargs["sampler"] = loader.sampler  # the same shuffling (or order)
            if seed is not None and isinstance(loader.sampler, RandomSampler):
                s, g = loader.sampler, torch.Generator().manual_seed(seed)
                kwargs["sampler"] = RandomSampler(s.data_source, s.replacement, s._num_samples, g)
    if seed is not None:
        kwargs["generator"] = torch.Generator().manual_seed(seed)  # the workers' base seed
    return DataLoader(loader.dataset, **kwargs)
