"""Whole-step CUDA graphs (``compile.cuda_graphs``, docs/cuda-graphs.md) through
:meth:`Engine.wrap_window`: ``warmup`` eager steps on a side stream (the first watched for host
syncs), then one capture replayed every step. Every refusal is one line and the run goes on eagerly.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..base.batch import map_tensors, tensors_of
from ..base.failure import one_line
from .window import LossFn, MicroBatch, WindowFn

log = logging.getLogger(__name__)


# the ops whose output shape depends on the input's values: the host waits to learn it
SHAPE_SYNC_OPS = frozenset(
    {
        "nonzero",
        "masked_select",
        "unique",
        "_unique",
        "_unique2",
        "unique_dim",
        "unique_consecutive",
        "argwhere",
    }
)
# ops that make the host wait for the device (a value read on the host, a value-dependent shape;
# repeat_interleave without its output_size): never inside a graph. The one list: turbotrain
# profile's sync finder (app/profile/syncs.py) reads it too.
SYNC_OPS = frozenset({"_local_scalar_dense", "repeat_interleave", *SHAPE_SYNC_OPS})
TORCH_DIR = str(Path(torch.__file__).parent)
OWN_DIR = str(Path(__file__).resolve().parents[1])


class HostSyncFinder(TorchDispatchMode):
    """Records the first op of the step that reads a device value on the host, and where."""

    def __init__(self) -> None:
        super().__init__()
        self.found = ""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not self.found and func.__name__.split(".")[0] in SYNC_OPS:
            frames = [f for f in traceback.extract_stack()[:-1] if not f.filename.startswith(TORCH_DIR)]
            user = [f for f in frames if not f.filename.startswith(OWN_DIR)] or frames
            where = f"{Path(user[-1].filename).name}:{user[-1].lineno}" if user else "unknown"
            self.found = f"aten.{func.__name__.split('.')[0]} at {where}"
        return func(*args, **(kwargs or {}))


def unavailable(device_type: str) -> str:
    """Why whole-step CUDA graphs cannot run on a ``device_type`` device, in one line ("" on CUDA)."""
    return "" if device_type == "cuda" else f"CUDA graphs need a CUDA device; this run is on {device_type}"


class CudaGraph:
    """torch.cuda.CUDAGraph behind ``capture(fn)`` (``outputs``: fn's, overwritten) and ``replay()``."""

    def __init__(self) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.outputs: Any = None

    def capture(self, fn: Callable[[], Any]) -> None:
        with torch.cuda.graph(self.graph):
            self.outputs = fn()

    def replay(self) -> None:
        self.graph.replay()


def signature(micro: Sequence[MicroBatch]) -> tuple:
    """What a capture depends on: each micro-batch's tensor shapes, dtypes, devices and weight."""
    return tuple(
        (tuple((tuple(t.shape), t.dtype, str(t.device)) for t in tensors_of(b)), float(w)) for b, w in micro
    )


def make_capturable(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Before the first step (CUDA only): the optimizer capturable, its learning rates device tensors."""
    if device.type != "cuda":
        return
    for group in optimizer.param_groups:
        if "capturable" in group and not group.get("fused"):
            group["capturable"] = True
        if not isinstance(group["lr"], torch.Tensor) and ("capturable" in group or group.get("fused")):
            group["lr"] = torch.tensor(float(group["lr"]), device=device)


class StepGraph:
    """The wrapper for :meth:`Engine.wrap_window`; ``graph_factory``: tests pass a stand-in."""

    def __init__(
        self, device: torch.device, warmup: int = 2, graph_factory: Callable[[], Any] | None = None
    ) -> None:
        self.device, self.warmup = device, max(1, warmup)
        self.graph_factory = graph_factory or (CudaGraph if device.type == "cuda" else None)
        self.refused, self.captures, self.replays = "", 0, 0

    def refuse(self, why: str) -> None:
        if not self.refused:
            self.refused = why
            log.warning("compile.cuda_graphs: %s; the run goes on without CUDA graphs", why)

    def __call__(self, body: WindowFn) -> WindowFn:
        return _Captured(self, body)


class _Captured:
    """One capture of ``body`` (the engine wraps anew when what the body computes changes)."""

    def __init__(self, owner: StepGraph, body: WindowFn) -> None:
        self.owner, self.body = owner, body
        self.calls = 0
        self.graph: Any = None
        self.sig: tuple = ()
        self.static: list[torch.Tensor] = []

    def __call__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, micro: Sequence[MicroBatch], loss_fn: LossFn
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        owner = self.owner
        args = (model, optimizer, micro, loss_fn)
        if owner.refused:
            return self.body(*args)
        if owner.graph_factory is None:
            owner.refuse(unavailable(owner.device.type) or "no CUDA graph for this device")
            return self.body(*args)
        self.calls += 1
        if self.calls == 1 and owner.captures == 0:
            return self._first_step(args)
        if self.calls <= owner.warmup and owner.captures == 0:
            return self._eager(*args)
        sig = signature(micro)
        if self.graph is None:
            try:
                self._capture(args, sig)
            except RuntimeError as exc:  # capture refused by CUDA (an unsupported op, a sync)
                owner.refuse(f"capture failed ({one_line(exc)})")
                optimizer.zero_grad(set_to_none=True)
                return self.body(*args)
        elif sig != self.sig:
            owner.refuse(
                "dynamic shapes: a step's micro-batches changed shape or dtype after capture "
                f"({_first_difference(self.sig, sig)}); pad to one shape or drop the last partial batch"
            )
            return self.body(*args)
        else:
            for dst, src in zip(self.static, [t for b, _ in micro for t in tensors_of(b)]):
                dst.copy_(src, non_blocking=True)
        self.graph.replay()
        owner.replays += 1
        loss_sum, norm = self.graph.outputs
        # the next replay overwrites the outputs: the caller keeps copies
        return loss_sum.clone(), (norm.clone() if norm is not None else None)

    def _first_step(self, args: tuple) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The first warm-up step, watched for host syncs (each one refuses the graph)."""
        make_capturable(args[1], self.owner.device)
        finder = HostSyncFinder()
        with finder:
            out = self._eager(*args)
        if finder.found:
            self.owner.refuse(
                f"the step reads a device value on the host ({finder.found}: .item(), a Python if on a "
                "tensor or other data-dependent control flow), which a graph cannot hold"
            )
        return out

    def _eager(self, *args: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A warm-up step; on CUDA on a side stream, as capture requires."""
        if self.owner.device.type != "cuda":
            return self.body(*args)
        stream = torch.cuda.Stream(self.owner.device)
        stream.wait_stream(torch.cuda.current_stream(self.owner.device))
        with torch.cuda.stream(stream):
            out = self.body(*args)
        torch.cuda.current_stream(self.owner.device).wait_stream(stream)
        return out

    def _capture(self, args: tuple, sig: tuple) -> None:
        model, optimizer, micro, loss_fn = args
        self.static = [t.clone() for b, _ in micro for t in tensors_of(b)]
        pool = list(self.static)
        static_micro = [(map_tensors(b, lambda _: pool.pop(0)), w) for b, w in micro]
        assert self.owner.graph_factory is not None  # __call__ runs uncaptured without one
        graph = self.owner.graph_factory()
        graph.capture(lambda: self.body(model, optimizer, static_micro, loss_fn))
        self.graph, self.sig = graph, sig
        self.owner.captures += 1


def _first_difference(a: tuple, b: tuple) -> str:
    if len(a) != len(b):
        return f"{len(a)} micro-batches captured, {len(b)} now"
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            shapes = lambda s: ", ".join(f"{list(t[0])} {str(t[1]).replace('torch.', '')}" for t in s[0])  # noqa: E731
            return f"micro-batch {i}: captured {shapes(x)}, now {shapes(y)}"
    return "unknown"
