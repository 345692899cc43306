"""The asynchronous checkpoint writer: a copy of the state in host memory, written in a thread
while training goes on (``train.async_checkpoint``)."""

from __future__ import annotations

import collections
import copy
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def _view_key(t: torch.Tensor) -> tuple[Any, ...]:
    """What makes two tensors the same view of the same memory (tied weights): staged once."""
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def stage_to_host(tree: Any, buffers: dict[str, torch.Tensor]) -> Any:
    """A copy of ``tree`` in host memory that training cannot change (CUDA tensors into pinned
    memory; tied weights stay shared). The copies go into ``buffers``, reused by the next call."""
    copies: dict[tuple[Any, ...], torch.Tensor] = {}
    from_cuda = False

    def copy_tensor(x: torch.Tensor, where: str) -> torch.Tensor:
        nonlocal from_cuda
        t = x.detach()
        key = _view_key(t)
        if key not in copies:
            out = buffers.get(where)
            if out is None or out.shape != t.shape or out.dtype != t.dtype:
                out = buffers[where] = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
            out.copy_(t, non_blocking=t.is_cuda)
            from_cuda |= t.is_cuda
            copies[key] = out
        return copies[key]

    def copy_tree(x: Any, where: str) -> Any:
        if isinstance(x, torch.Tensor):
            return copy_tensor(x, where)
        if isinstance(x, dict):
            out: dict[Any, Any] = collections.OrderedDict() if isinstance(x, collections.OrderedDict) else {}
            for key, value in x.items():
                out[key] = copy_tree(value, f"{where}/{key}")
            if hasattr(x, "_metadata"):  # a module state dict's versions, which load_state_dict reads
                out._metadata = copy.deepcopy(x._metadata)  # type: ignore[attr-defined]
            return out
        if isinstance(x, (list, tuple)):
            items = [copy_tree(value, f"{where}/{i}") for i, value in enumerate(x)]
            if isinstance(x, list):
                return items
            return type(x)(*items) if hasattr(x, "_fields") else tuple(items)  # a namedtuple, or a tuple
        return copy.deepcopy(x)

    staged = copy_tree(tree, "")
    if from_cuda:
        torch.cuda.synchronize()  # host-device sync, once per checkpoint: the copies land before the write reads them
    return staged


class BackgroundWrite:
    """At most one checkpoint write in flight, in a thread of its own (the synchronous write, so a
    kill -9 mid-write leaves the previous checkpoint); its failure is raised by :meth:`wait` or
    :meth:`poll`. Not a daemon: an exiting interpreter waits."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._result: Path | None = None
        self._error: BaseException | None = None

    def start(self, write: Callable[[], Path]) -> None:
        self.wait()  # one write at a time: the next waits for the previous (and raises its failure)

        def run() -> None:
            try:
                self._result = write()
            except BaseException as exc:  # noqa: BLE001 - kept for the training thread, raised there
                self._error = exc

        self._thread = threading.Thread(target=run, name="turbotrain-checkpoint-write", daemon=False)
        self._thread.start()

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> Path | None:
        """Block until the write in flight ends: its path (None if none), or its failure raised."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
        return self._result

    def poll(self) -> Path | None:
        """The path or failure of an ended write (:meth:`wait`), else None: never blocks."""
        return None if self._thread is None or self._thread.is_alive() else self.wait()
