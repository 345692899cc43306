"""Dynamic batching (``data.batching = 'tokens'``, docs/data.md): batches by token budget, with
length bucketing, whose rows never mix documents. Pieces of a document overlap by one token, so
every token after a document's first is a target exactly once per epoch; padded lengths are
multiples of 8 (fewer shapes for kernels and ``torch.compile``). Batch ``k`` of the stream is a
function of (seed, k); rank ``r`` of ``world`` reads stream batches ``k * world + r``, so a resume
that changes ``accumulation x world`` would train on other batches: :func:`resume_start` refuses it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader

from ...base.errors import TurbotrainError
from .documents import Documents, open_documents
from .loader import START, LoaderSettings, Position, PreadRows, StreamSampler, sampled_loader
from .sources import PreadFile, TokenSource

log = logging.getLogger(__name__)

IGNORE_INDEX = -100  # targets the loss skips (torch.nn.functional.cross_entropy's default ignore_index)
PAD_MULTIPLE = 8  # padded row lengths are multiples of this (capped at block_size)
BUCKET_BATCHES = 64  # about this many batches' rows are sorted by length together


@dataclass(frozen=True)
class Pieces:
    """Rows cut from documents: piece i is tokens ``[offsets[i], offsets[i] + lengths[i])`` of the split."""

    offsets: np.ndarray  # int64, relative to the split
    lengths: np.ndarray  # int64, >= 2

    def __len__(self) -> int:
        return len(self.offsets)

    @property
    def inputs(self) -> np.ndarray:
        """Input tokens of each row (its length - 1)."""
        return self.lengths - 1


def cut_pieces(docs: Documents, seq_len: int) -> Pieces:
    """Each document in pieces of <= ``seq_len + 1`` tokens overlapping by one; one-token ones left out."""
    n = docs.lengths
    count = np.where(n >= 2, -(-(n - 1) // seq_len), 0)  # ceil((n - 1) / seq_len) pieces
    doc = np.repeat(np.arange(len(n)), count)
    first = np.cumsum(count) - count  # index of each document's first piece
    j = np.arange(len(doc)) - np.repeat(first, count)  # piece number within its document
    offsets = docs.starts[doc] + j * seq_len
    lengths = np.minimum(seq_len + 1, n[doc] - j * seq_len)
    return Pieces(offsets.astype(np.int64), lengths.astype(np.int64))


def padded_length(inputs: int, seq_len: int) -> int:
    """The row length a batch whose longest row has ``inputs`` input tokens is padded to."""
    return min(seq_len, -(-inputs // PAD_MULTIPLE) * PAD_MULTIPLE)


def plan_epoch(inputs: np.ndarray, max_tokens: int, seq_len: int, seed: int, epoch: int) -> list[np.ndarray]:
    """The batches of one epoch, as arrays of piece indices: every piece exactly once, each batch
    within ``max_tokens`` (rows x padded length), in an order drawn from (seed, epoch)."""
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(inputs))
    bucket = BUCKET_BATCHES * max(1, max_tokens // seq_len)
    batches: list[np.ndarray] = []
    for lo in range(0, len(order), bucket):
        chunk = order[lo : lo + bucket]
        chunk = chunk[np.argsort(-inputs[chunk], kind="stable")]  # longest first
        i = 0
        while i < len(chunk):
            rows = max(1, max_tokens // padded_length(int(inputs[chunk[i]]), seq_len))
            batches.append(chunk[i : i + rows])
            i += rows
    return [batches[i] for i in rng.permutation(len(batches))]


class TokenBudgetSampler(StreamSampler):
    """Token-budget batches (piece indices): rank ``r`` of ``world`` takes stream batches ``k * world + r``."""

    def __init__(
        self, inputs: np.ndarray, max_tokens: int, seq_len: int, seed: int, at: Position = START
    ) -> None:
        if not len(inputs):
            raise TurbotrainError("the data holds no document of two tokens or more; nothing to train on")
        super().__init__(max_tokens, seed, at)
        self.inputs, self.seq_len = inputs, seq_len
        self._sizes: list[int] = []  # batches in each epoch planned so far

    def _epoch(self, epoch: int) -> list[np.ndarray]:
        return self.drawn(
            epoch, lambda e: plan_epoch(self.inputs, self.batch_size, self.seq_len, self.seed, e)
        )

    def batch(self, k: int) -> list[int]:
        """Batch ``k`` of this rank's stream: a function of (seed, k) only."""
        index, epoch = k * self.at.world + self.at.rank, 0
        while True:
            if epoch == len(self._sizes):
                self._sizes.append(len(self._epoch(epoch)))
            if index < self._sizes[epoch]:
                return self._epoch(epoch)[index].tolist()
            index -= self._sizes[epoch]
            epoch += 1


class PieceRows(PreadRows):
    """Rows of document pieces, fetched a batch at a time with ``pread``: (inputs, targets) int64 of
    shape (rows, padded length), inputs padded with 0 and targets with -100."""

    def __init__(self, docs: Documents, seq_len: int) -> None:
        self.split, self.seq_len = docs.split, seq_len
        self.pieces = cut_pieces(docs, seq_len)
        self._reader = PreadFile(self.split.path)

    def __len__(self) -> int:
        return len(self.pieces)

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        offsets, lengths = self.pieces.offsets[indices], self.pieces.lengths[indices]
        width = padded_length(int(lengths.max()) - 1, self.seq_len)
        rows = np.zeros((len(indices), width + 1), dtype=np.int64)  # tokens, then the padding
        fd = self._reader.fd()
        for row, (offset, n) in enumerate(zip(offsets.tolist(), lengths.tolist())):
            rows[row, :n] = self.split.read_rows(fd, np.array([offset]), n)[0]
        # padded inputs are token 0: any valid id works, no real token attends to it
        x = torch.from_numpy(rows[:, :-1].copy())
        y = torch.from_numpy(rows[:, 1:].copy())
        y[torch.from_numpy(np.arange(width)[None, :] >= (lengths - 1)[:, None])] = IGNORE_INDEX
        return x, y


def build_budget_loader(
    rows: PieceRows, max_tokens: int, seed: int, settings: LoaderSettings, at: Position = START
) -> DataLoader:
    """An endless DataLoader of token-budget (x, y) batches of the seeded stream at ``at``."""
    sampler = TokenBudgetSampler(rows.pieces.inputs, max_tokens, rows.seq_len, seed, at)
    return sampled_loader(rows, sampler, seed, settings)


def fixed_budget_batches(
    rows: PieceRows, max_tokens: int, count: int, seed: int, at: Position = START
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same ``count`` token-budget batches every time (validation), read once on the host."""
    if not len(rows):
        return []
    sampler = TokenBudgetSampler(rows.pieces.inputs, max_tokens, rows.seq_len, seed, at)
    return [rows.__getitems__(sampler.batch(k)) for k in range(count)]


def padding_share(rows: PieceRows, max_tokens: int, seed: int, batches: int = 200) -> float:
    """Share of padding in the first ``batches`` batches of epoch 0 (for the log)."""
    real = padded = 0
    for idx in plan_epoch(rows.pieces.inputs, max_tokens, rows.seq_len, seed, 0)[:batches]:
        real += int(rows.pieces.inputs[idx].sum())
        padded += padded_length(int(rows.pieces.inputs[idx].max()), rows.seq_len) * len(idx)
    return 1.0 - real / padded if padded else 0.0


def resume_start(batches: int, step: int, saved_world: int, world: int, accumulation: int) -> int:
    """This rank's first batch when token batching resumes after ``step`` optimizer steps, each of
    the ``saved_world`` ranks having read ``batches``: exact when the stream batches per step
    (processes x accumulation) are kept, else refused in one line naming what keeps them."""
    if not batches or not saved_world or saved_world == world:
        return batches
    read = batches * saved_world  # stream batches the whole group has trained on
    if step and read == step * accumulation * world:
        return step * accumulation
    per_step = read // step if step and read % step == 0 else 0
    old = (
        f"{per_step} ({processes(saved_world)} x accumulation {per_step // saved_world})"
        if per_step
        else f"{read} in all"
    )
    keep = (
        f"--batch.accumulation={per_step // world}"
        if per_step and per_step % world == 0
        else f"{processes(saved_world)}"
        + (f" (torchrun --nproc-per-node {saved_world})" if saved_world > 1 else " (no torchrun)")
    )
    raise TurbotrainError(
        f"data.batching = 'tokens' resumes exactly only with the same token-budget batches per optimizer step "
        f"(processes x accumulation): the checkpoint's run took {old} and this run takes {world * accumulation} "
        f"({processes(world)} x accumulation {accumulation}); resume with {keep}"
    )


def processes(n: int) -> str:
    """'1 process', '2 processes': how the resume refusals (here and in training) name a world size."""
    return f"{n} process{'es' if n > 1 else ''}"


@dataclass
class BudgetData:
    """What a run trains and validates on with ``data.batching = 'tokens'``."""

    loader: DataLoader
    val_batches: list[tuple[torch.Tensor, torch.Tensor]]
    example: tuple[torch.Tensor, torch.Tensor]  # the stream's first batch (FLOPs are counted on it)
    description: str


def build_budget_data(
    path: str,
    source: TokenSource,
    seq_len: int,
    max_tokens: int,
    seed: int,
    settings: LoaderSettings,
    *,
    at: Position,
    eval_batches: int = 0,
) -> BudgetData:
    """Documents of ``source`` in token-budget batches of at most ``max_tokens``: the training loader
    at ``at``, ``eval_batches`` fixed validation batches (seed + 1), a one-line description."""
    train_docs, val_docs = open_documents(path, source)
    rows, val_rows = PieceRows(train_docs, seq_len), PieceRows(val_docs, seq_len)
    loader = build_budget_loader(rows, max_tokens, seed, settings, at)
    val = fixed_budget_batches(val_rows, max_tokens, eval_batches, seed + 1, at)
    example = fixed_budget_batches(rows, max_tokens, 1, seed)[0]
    description = (
        f"{len(train_docs):,} + {len(val_docs):,} documents in {len(rows):,} + {len(val_rows):,} rows of <= {seq_len} "
        f"tokens; batches of <= {max_tokens} tokens, {100 * padding_share(rows, max_tokens, seed):.1f}% padding"
    )
    log.info("token batching: %s", description)
    return BudgetData(loader, val, example, description)
