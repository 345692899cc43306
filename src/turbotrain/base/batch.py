"""What is in a batch: the one place that walks a batch's structure (a tensor, tuple, list or any
``Mapping``, nested), so placement, counting and the OOM split agree. No device sync: shapes only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

# Keys whose tensor holds one token per element (Hugging Face naming), in order of preference.
TOKEN_KEYS = ("input_ids", "attention_mask")


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``batch`` with ``fn`` applied to every tensor; containers keep their type where they can."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(map_tensors(b, fn) for b in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(b, fn) for b in batch)
    if isinstance(batch, Mapping):
        items = {k: map_tensors(v, fn) for k, v in batch.items()}
        rebuild: Callable[..., Any] = type(batch)  # its constructor may not take the items
        try:
            return rebuild(items)
        except Exception:
            return items
    return batch


def tensors_of(batch: Any) -> list[torch.Tensor]:
    """Every tensor in ``batch``, depth first, in order."""
    out: list[torch.Tensor] = []
    map_tensors(batch, out.append)
    return out


def move_to(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Tensors in ``batch`` moved to ``device``; everything else unchanged."""
    return map_tensors(batch, lambda t: t.to(device, non_blocking=non_blocking))


def _lead(batch: Any) -> torch.Tensor | None:
    """The tensor whose first dimension is the batch: a mapping's ``input_ids``, else the first found."""
    if isinstance(batch, Mapping):
        for key in TOKEN_KEYS:
            if isinstance(batch.get(key), torch.Tensor):
                return batch[key]
    found = tensors_of(batch)
    return next((t for t in found if t.ndim), None)


def batch_size(batch: Any) -> int:
    """Samples in a batch: the leading dimension of its leading tensor (1 when it has none)."""
    lead = _lead(batch)
    return int(lead.shape[0]) if lead is not None else 1


def token_count(batch: Any) -> int:
    """Token positions in a batch from shapes, padding included (what FLOPs count); 0 for other data."""
    lead = _lead(batch)
    if lead is None:
        return 0
    if isinstance(batch, Mapping) and any(isinstance(batch.get(k), torch.Tensor) for k in TOKEN_KEYS):
        return lead.numel() if lead.ndim >= 2 else 0
    return lead.numel() if lead.ndim == 2 and not lead.is_floating_point() else 0


def attention_mask(batch: Any) -> torch.Tensor | None:
    """A mapping's 2-D ``attention_mask`` (1 for a real token, 0 for padding), or None."""
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    return mask if isinstance(mask, torch.Tensor) and mask.ndim == 2 else None


def real_tokens(batch: Any) -> int | torch.Tensor:
    """The tokens that are not padding: the attention mask's sum (on its device: no sync), else shapes."""
    mask = attention_mask(batch)
    if mask is None:
        return token_count(batch)
    total = mask.sum()
    return int(total) if total.device.type == "cpu" else total


class TokenTally:
    """Tokens counted batch by batch (:func:`real_tokens`), device sums read once by :meth:`total`."""

    def __init__(self, start: int = 0) -> None:
        self.counted = start
        self.pending: torch.Tensor | None = None  # masks' sums still on their device

    def add(self, batch: Any) -> None:
        tokens = real_tokens(batch)
        if isinstance(tokens, int):
            self.counted += tokens
        else:
            self.pending = tokens if self.pending is None else self.pending + tokens

    def total(self) -> int:
        """Every token so far (a host-device sync point when masks' sums on a device are pending)."""
        if self.pending is not None:
            self.counted += int(self.pending)  # host-device sync point: read once per record
            self.pending = None
        return self.counted


def split_batch(batch: Any, parts: int) -> list[Any]:
    """``batch`` cut into ``parts`` near-equal pieces along dim 0 (other tensors repeated in each)."""
    n = batch_size(batch)
    pieces: list[list[torch.Tensor]] = []  # per tensor, in tensors_of order

    def cut(t: torch.Tensor) -> torch.Tensor:
        pieces.append(list(torch.tensor_split(t, parts)) if t.ndim and t.shape[0] == n else [t] * parts)
        return t

    map_tensors(batch, cut)
    out = []
    for i in range(parts):
        it = iter([p[i] for p in pieces])
        out.append(map_tensors(batch, lambda _t: next(it)))
    return out


def misplaced(batch: Any, device: torch.device) -> list[str]:
    """Descriptions of the tensors in ``batch`` that are not on ``device``'s type."""
    return [
        f"batch tensor {i} {tuple(t.shape)} ({t.device})"
        for i, t in enumerate(tensors_of(batch))
        if t.device.type != device.type
    ]
