"""Keep the next batch's host-to-device copy in flight while the current batch computes."""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch


def move_to(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Tensors in nested tuples/lists/dicts moved to ``device``; everything else unchanged."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to(b, device, non_blocking) for b in batch)
    if isinstance(batch, dict):
        return {k: move_to(v, device, non_blocking) for k, v in batch.items()}
    return batch


def _record_stream(batch: Any, stream: torch.cuda.Stream) -> None:
    if isinstance(batch, torch.Tensor):
        batch.record_stream(stream)
    elif isinstance(batch, (list, tuple)):
        for b in batch:
            _record_stream(b, stream)
    elif isinstance(batch, dict):
        for b in batch.values():
            _record_stream(b, stream)


class DevicePrefetcher:
    """Iterate ``loader`` with each batch already on ``device``.

    On CUDA the copy of batch k+1 is issued on a side stream (from pinned memory, non_blocking)
    before batch k is returned, so it overlaps compute; the compute stream waits on the copy only
    when it takes the batch. On CPU it is a plain pass-through.
    """

    def __init__(self, loader: Iterable[Any], device: torch.device) -> None:
        self.loader, self.device = loader, device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.loader)
        if self.stream is None:
            for batch in it:
                yield move_to(batch, self.device)
            return
        nxt = self._issue(it)
        while nxt is not None:
            batch = nxt
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            _record_stream(batch, torch.cuda.current_stream(self.device))
            nxt = self._issue(it)
            yield batch

    def _issue(self, it: Iterator[Any]) -> Any:
        try:
            host = next(it)
        except StopIteration:
            return None
        with torch.cuda.stream(self.stream):
            return move_to(host, self.device, non_blocking=True)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]
