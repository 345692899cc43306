"""Rank 0 speaks for the run: start-up decisions it makes for every rank, and errors reported once.
A reporting rank leaves word in the launcher's store (it outlives the rank), so a rank whose
collective then failed says what happened instead of "a rank was lost".
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from ..base.errors import TurbotrainError
from .process_group import in_group, rank_world

T = TypeVar("T")


class ReportedByAnotherRank(TurbotrainError):
    """Another rank found the error and reports it itself; this rank ends quietly."""


class ReportedByMainRank(ReportedByAnotherRank):
    """Rank 0 failed at a start-up step every rank shares and reports it; the others end with this."""


def _failure_key() -> str:
    return f"turbotrain/reported/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _store() -> Any:
    """The default process group's store, or None (no group, or a torch without it)."""
    if not in_group():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - the store is a courtesy: without it ranks say a peer was lost
        return None


def announce_reported(message: str) -> None:
    """This rank is about to report ``message`` and exit: leave word for the other ranks."""
    store = _store() if _grouped() else None
    if store is None:
        return
    with contextlib.suppress(Exception):
        store.set(_failure_key(), f"rank {dist.get_rank()}: {message}"[:500])


def reported_elsewhere() -> str | None:
    """What another rank reported before it exited, or None; call it when a collective failed."""
    store = _store()
    if store is None:
        return None
    try:
        if not store.check([_failure_key()]):
            return None
        said = store.get(_failure_key()).decode("utf-8", "replace")
    except Exception:  # noqa: BLE001 - the store went with the launcher: nothing to read
        return None
    return None if said.startswith(f"rank {dist.get_rank()}:") else said


def _grouped() -> bool:
    return rank_world()[1] > 1


def decided_by_main(fn: Callable[[], T]) -> T:
    """Rank 0 runs ``fn`` and every rank gets its result (a pickled broadcast: start-up only)."""
    return _on_main(fn, share=True)


def main_first(fn: Callable[[], T]) -> T:
    """``fn`` on rank 0 first, then on the others (e.g. filling a shared cache once)."""
    value = _on_main(fn, share=False)
    return fn() if _grouped() and dist.get_rank() != 0 else value


def _on_main(fn: Callable[[], T], share: bool) -> T:
    if not _grouped():
        return fn()
    box: list[Any] = [None]
    value: Any = None
    if dist.get_rank() == 0:
        try:
            value = fn()
        except BaseException as exc:
            box[0] = ("error", f"{type(exc).__name__}: {exc}")
            dist.broadcast_object_list(box, src=0)
            raise
        box[0] = ("ok", value if share else None)
    dist.broadcast_object_list(box, src=0)
    kind, shared = box[0]
    if kind == "error":
        raise ReportedByMainRank(f"rank 0 failed at start-up ({shared})")
    return value if dist.get_rank() == 0 else shared
