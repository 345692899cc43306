"""Every host-device synchronisation of a training step, located to the file and line that made it
(docs/profile-tune.md). Each event goes to the innermost Python frame outside PyTorch and this
module; on a CPU run every read is counted and marked with whether it would wait on a GPU
(:func:`is_sync`). Compiled code runs eagerly under the locator: a compiled graph breaks at a sync
anyway, so eager shows the same syncs and the ones a graph hides.
"""

from __future__ import annotations

import contextlib
import linecache
import sys
import warnings
from collections import Counter
from collections.abc import Iterator
from itertools import cycle, islice
from types import FrameType
from typing import Any, TextIO, TypeGuard

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ...core.engine import Engine, default_loss
from ...core.graphs import SHAPE_SYNC_OPS
from ...core.meter.trial import copy_on
from ...loop.fit import fit
from ...loop.hooks import FitContext, Hook
from ...parts.workload import Workload

_HERE = __file__.replace("\\", "/")
READ = "read to the host"  # .item(), float(), bool(), an if on a tensor
COPY = "copy to the host"  # .cpu(), .tolist(), .numpy(), .to("cpu")
PRINT = "print/format"  # print(tensor), f"{tensor:.3f}"
SHAPE = "data-dependent shape"  # nonzero, boolean masks, unique
CUDA_CALL = "synchronising CUDA call"  # reported by torch.cuda.set_sync_debug_mode

_API = {
    **dict.fromkeys(("item", "__bool__", "__float__", "__int__", "__index__"), READ),
    **dict.fromkeys(("tolist", "cpu", "numpy", "__array__"), COPY),
    **dict.fromkeys(("__repr__", "__str__", "__format__"), PRINT),
}


def _is_cpu(device: Any) -> bool:
    return device is not None and torch.device(device).type == "cpu"


def classify_frame(path: str) -> str | None:
    """The kind of a host read made in this file ('user', 'monitor', 'guard', 'optimizer', 'clock',
    'turbotrain'), or None for other packages' frames, skipped to find the caller (torch.optim's
    are kept: its implementation makes the read)."""
    norm = path.replace("\\", "/")
    if "torch/optim/" in norm:
        return "optimizer"
    if "/torch/" in f"/{norm}" or "site-packages/" in norm or norm.startswith("<"):
        return None
    if "turbotrain/" in norm:
        module = norm.rsplit("turbotrain/", 1)[1]
        if module.startswith("core/precision/"):  # the non-finite guard lives in the precision package
            return "guard"
        # the measuring kit (its clock, app/measure.py's wrapper around the step) measures, it is not the step
        kinds = {"loop/monitor/hook.py": "monitor", "core/meter/clock.py": "clock", "app/measure.py": "clock"}
        return kinds.get(module, "turbotrain")
    return "user"


def is_sync(kind: str, device_type: str) -> bool:
    """Whether a read of this kind makes the host wait for the device: not torch.optim's step
    counters (host tensors), nor the CPU guard's reads (CPU only, where there is no device queue);
    every other read would on a GPU."""
    if kind in ("optimizer", "clock"):
        return False
    return kind != "guard" or device_type == "cuda"


class SyncLocator:
    """Records each sync of the code run while active (a context manager, or :meth:`start` and
    :meth:`stop`); only values on ``device`` count."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.events: Counter[tuple[str, str, str, str]] = Counter()  # (kind, what, where, code)
        self.depth = 0  # > 0 inside an API call already recorded: its own operators are not counted twice
        self._stack = contextlib.ExitStack()  # what start entered, closed by stop

    def _on_device(self, t: Any) -> TypeGuard[torch.Tensor]:
        return isinstance(t, torch.Tensor) and t.device.type == self.device.type

    def record(self, what: str, op: str, frame: FrameType | None) -> None:
        kind, where, code = locate(frame)
        self.events[(kind, f"{op} ({what})", where, code)] += 1

    def counted(self, what: str, op: str, frame: FrameType | None, func: Any, args: Any, kwargs: Any) -> Any:
        """Record one sync and make the call; what the call does inside (its operators, the sync
        CUDA's debug mode reports) is not counted again."""
        self.record(what, op, frame)
        self.depth += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.depth -= 1

    def start(self) -> None:
        stack = self._stack
        stack.enter_context(torch.compiler.set_stance("force_eager"))
        if self.device.type == "cuda" and torch.cuda.is_available():
            stack.enter_context(_cuda_sync_debug(self))
        stack.enter_context(_FunctionLevel(self))
        stack.enter_context(_DispatchLevel(self))

    def stop(self) -> None:
        self._stack.close()

    def __enter__(self) -> SyncLocator:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def sources(self, steps: int) -> list[dict[str, Any]]:
        """One row per (kind, operation, line), most frequent first, with ``per_step`` and ``sync``
        (whether the host waits for the device there: on this device or, on a CPU, on a GPU)."""
        return [
            {"kind": kind, "what": what, "where": where, "code": code, "per_step": n / max(steps, 1)}
            | {"sync": is_sync(kind, self.device.type)}
            for (kind, what, where, code), n in self.events.most_common()
            if kind != "clock"  # turbotrain's own measuring: not a read of the step's
        ]


def locate(frame: FrameType | None) -> tuple[str, str, str]:
    """(kind, 'file.py:LINE (function)', the line's text) of the innermost frame that is not
    PyTorch's or this module's."""
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        if path != _HERE:
            kind = classify_frame(path)
            if kind is not None:
                line = frame.f_lineno
                where = f"{path}:{line} ({frame.f_code.co_name})"
                return kind, where, linecache.getline(frame.f_code.co_filename, line).strip()
        frame = frame.f_back
    return "unknown", "no Python frame (inside the autograd engine or C++)", ""


class _Level:
    def __init__(self, locator: SyncLocator) -> None:
        super().__init__()
        self.loc = locator


class _FunctionLevel(_Level, TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        what = _API.get(name)
        if what is None and name == "to":
            positional = next((a for a in args[1:] if isinstance(a, (str, torch.device))), None)
            what = COPY if _is_cpu(kwargs.get("device", positional)) else None
        if what is None or self.loc.depth or not args or not self.loc._on_device(args[0]):
            return func(*args, **kwargs)
        if name == "to" and args[0].device.type == "cpu":
            return func(*args, **kwargs)  # a host tensor to the host: no copy (a CPU run moving its batches)
        op = f".{name.strip('_')}()" if not name.startswith("__") else name
        return self.loc.counted(what, op, sys._getframe(1), func, args, kwargs)


class _DispatchLevel(_Level, TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        what = None if self.loc.depth else self._what(func, args, kwargs)
        if what is None:
            return func(*args, **kwargs)
        return self.loc.counted(what, f"aten::{func._opname}", sys._getframe(1), func, args, kwargs)

    def _what(self, func: Any, args: Any, kwargs: Any) -> str | None:
        name = func._opname
        first = args[0] if args else None
        if not self.loc._on_device(first):
            return None
        if name == "_local_scalar_dense":
            return READ
        if name in SHAPE_SYNC_OPS:
            return SHAPE
        if name == "repeat_interleave" and kwargs.get("output_size") is None:
            return SHAPE if len(args) < 4 or args[3] is None else None
        if name in ("index", "index_put", "index_put_") and len(args) > 1:
            masks = any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1])
            return SHAPE if masks else None
        if name in ("_to_copy", "to") and first.device.type != "cpu" and _is_cpu(kwargs.get("device")):
            return COPY
        if (
            name == "copy_"
            and first.device.type == "cpu"
            and any(isinstance(t, torch.Tensor) and t.device.type != "cpu" for t in tree_leaves(args[1:]))
        ):
            return COPY
        return None


@contextlib.contextmanager
def _cuda_sync_debug(locator: SyncLocator) -> Iterator[None]:
    """torch.cuda's own sync report: each synchronising CUDA call warns; the warning is taken at
    the call (its Python stack is still there) and recorded unless an API call or operator the
    locator already counted made it."""
    previous = torch.cuda.get_sync_debug_mode()
    show = warnings.showwarning

    def on_warning(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        if "synchronizing" not in str(message):
            show(message, category, filename, lineno, file, line)
        elif not locator.depth:
            frame: FrameType | None = sys._getframe(1)
            while frame is not None and frame.f_code.co_filename == warnings.__file__:
                frame = frame.f_back  # the warnings machinery's own frames: the call is below them
            locator.record(CUDA_CALL, "cuda synchronize", frame)

    with warnings.catch_warnings():
        warnings.filterwarnings("always", message=".*synchronizing")
        warnings.showwarning = on_warning
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)


class StepWindow(Hook):
    """``begin`` after optimizer step ``after``, ``end`` after step ``after + steps`` (or at an
    exception; profile's two windows); ``seen`` counts the steps inside."""

    def __init__(self, after: int, steps: int) -> None:
        self.after, self.steps, self.seen, self.running = after, steps, 0, False

    def begin(self, ctx: FitContext) -> None: ...

    def end(self, ctx: FitContext | None) -> None: ...

    def on_step_end(self, ctx: FitContext) -> None:
        step = ctx.engine.state.step
        self.seen += self.running
        if step == self.after:
            self.begin(ctx)
            self.running = True
        elif step >= self.after + self.steps and self.running:
            self.end(ctx)
            self.running = False

    def on_exception(self, ctx: FitContext, exc: BaseException) -> None:
        if self.running:
            self.end(None)
            self.running = False


class SyncWindow(StepWindow):
    """Locates the syncs of optimizer steps ``after + 1`` to ``after + steps`` (a hook for ``fit``)."""

    def __init__(self, device: torch.device, after: int, steps: int) -> None:
        super().__init__(after, steps)
        self.locator = SyncLocator(device)

    def begin(self, ctx: FitContext) -> None:
        self.locator.start()

    def end(self, ctx: FitContext | None) -> None:
        self.locator.stop()

    def on_fit_end(self, ctx: FitContext) -> None:
        self.on_exception(ctx, None)  # type: ignore[arg-type]

    def report(self) -> dict[str, Any]:
        """``per_step`` (syncs), ``host_reads_per_step`` (every located event), the sources and the steps."""
        sources = self.locator.sources(self.seen)
        return {
            "per_step": sum(s["per_step"] for s in sources if s["sync"]),
            "host_reads_per_step": sum(s["per_step"] for s in sources),
            "sources": sources,
            "located": True,
            "steps": self.seen,
        }


def locate_workload_syncs(workload: Workload, device: str = "cpu", steps: int = 2) -> dict[str, Any]:
    """Train a copy of ``workload`` for 1 + ``steps`` optimizer steps in eager fp32 on ``device``
    (the first, with its one-time work, is not counted) and locate the syncs of the others
    (:meth:`SyncWindow.report`). Your model and optimizer are not touched."""
    engine = Engine({"run": {"device": device}, "compile": {"scope": "off"}, "precision": {"mode": "fp32"}})
    default = lambda params: torch.optim.AdamW(params, lr=1e-4)  # noqa: E731
    model, optimizer = copy_on(engine, workload.model, workload.optimizer or default)
    assert optimizer is not None
    batches = list(islice(cycle(workload.train_loader), (1 + steps) * engine.accumulation))
    window = SyncWindow(engine.device, 1, steps)
    loss_fn = workload.loss_fn or default_loss
    fit(engine, model, optimizer, batches, max_steps=1 + steps, hooks=[window], loss_fn=loss_fn)
    return window.report()


def format_syncs(doc: dict[str, Any]) -> list[str]:
    """The lines ``profile`` and ``doctor`` print: the count per step, then each source with its line."""
    lines = [
        f"- host-device syncs: {doc['per_step']:.1f} per step "
        f"({doc['host_reads_per_step']:.1f} host reads of tensor values per step)"
    ]
    for s in doc["sources"]:
        why = "host-side step counters" if s["kind"] == "optimizer" else "CPU only"
        tag = "sync" if s["sync"] else f"no sync ({why})"
        what = f" {s['what']}" if s.get("what") else ""
        code = f" `{s['code']}`" if s.get("code") else ""
        lines.append(f"  - {s['per_step']:.2f}/step {s['kind']}{what}: {s['where']}{code} — {tag}")
    return lines
