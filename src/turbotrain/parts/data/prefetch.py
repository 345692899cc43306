"""Keep the next batch's host-to-device copy in flight while the current batch computes."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from ...base.batch import map_tensors, move_to


class DevicePrefetcher:
    """Iterate ``loader`` with each batch already on ``device``: on CUDA with ``side_stream`` batch
    k+1's copy is issued on a side stream before batch k is returned (the compute stream waits on
    it only when it takes the batch); otherwise each batch is moved as it is taken. Apart from
    iteration it behaves like the wrapped loader (``len``, ``dataset``, ``sampler``, ...)."""

    def __init__(
        self,
        loader: Iterable[Any],
        device: torch.device,
        side_stream: bool = True,
        on_batch: Callable[[Any], None] | None = None,
    ) -> None:
        self.loader, self.device = loader, device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" and side_stream else None
        # told of each batch as it is handed out, in its host form (counting it needs no sync)
        self.on_batch = on_batch or (lambda batch: None)

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.loader)
        if self.stream is None:
            for host in it:
                batch = move_to(host, self.device, non_blocking=True)
                self.on_batch(host)
                yield batch
            return
        nxt = self._issue(it)
        while nxt is not None:
            host, batch = nxt
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self.stream)
            map_tensors(batch, lambda t: t.record_stream(current))
            nxt = self._issue(it)
            self.on_batch(host)
            yield batch

    def _issue(self, it: Iterator[Any]) -> tuple[Any, Any] | None:
        """The next batch, as the loader gave it and as issued to the device on the side stream."""
        try:
            host = next(it)
        except StopIteration:
            return None
        with torch.cuda.stream(self.stream):
            return host, move_to(host, self.device, non_blocking=True)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        """Everything else is the user's loader's."""
        if name == "loader":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)
