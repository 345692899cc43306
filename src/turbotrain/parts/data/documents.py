"""Documents: where each document starts and ends inside a token source's ranges, so token-budget
batches keep documents apart. The boundaries come from the token files themselves: for text
tokenized as bytes one document per file (the files' sizes must add up to the token file's length,
else they changed since it was cached); for a tokenizer with an end-of-text token or a GPT-2
``.bin`` (``<|endoftext|>`` = 50256) a document ends at each separator, kept as its last target;
anything else is refused in one line. The train/validation split may cut a document in two.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...base.errors import TurbotrainError
from .sources import TokenSource, TokenSplit, builtin_split, stdlib_files, text_files
from .tokenizer import SEPARATOR

GPT2_END_OF_TEXT = 50256  # <|endoftext|> in GPT-2's vocabulary: the separator of GPT-2-style .bin files


@dataclass(frozen=True)
class Documents:
    """The documents of one token range: ``starts`` and ``lengths`` relative to its start, in order."""

    split: TokenSplit
    starts: np.ndarray  # int64
    lengths: np.ndarray  # int64

    def __len__(self) -> int:
        return len(self.starts)

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())


def _clip(split: TokenSplit, starts: np.ndarray, lengths: np.ndarray) -> Documents:
    """Documents given in token-file coordinates, cut to ``split`` and made relative to it."""
    lo = np.maximum(starts, split.start)
    hi = np.minimum(starts + lengths, split.stop)
    keep = hi > lo
    return Documents(split, (lo[keep] - split.start).astype(np.int64), (hi[keep] - lo[keep]).astype(np.int64))


def _from_sizes(split: TokenSplit, sizes: list[int]) -> Documents:
    """One document per file of a byte-tokenized stream: file i's bytes, then the separator."""
    gap = len(SEPARATOR)
    lengths = np.asarray(sizes, dtype=np.int64)
    ends = np.cumsum(lengths + gap)
    total = split.offset_bytes // 2 + int(ends[-1]) if len(ends) else 0
    tokens = split.path.stat().st_size // 2
    if total != tokens:
        raise TurbotrainError(
            f"the files behind {split.path} changed since it was cached ({tokens:,} tokens, the files now make "
            f"{total:,}); run again to rebuild the cache"
        )
    return _clip(split, ends - lengths - gap, lengths)


# tokens compared with the separator at a time (a bool each: 16 MB, not one per token of the file)
SCAN_CHUNK = 1 << 24


def separator_ends(split: TokenSplit, sep: int, chunk: int = SCAN_CHUNK) -> np.ndarray:
    """Positions just after each ``sep`` token of ``split``, scanned ``chunk`` tokens at a time."""
    tokens = split.array()
    found = [
        np.flatnonzero(tokens[lo : lo + chunk] == sep).astype(np.int64) + (lo + 1)
        for lo in range(0, len(tokens), chunk)
    ]
    return np.concatenate(found) if found else np.zeros(0, dtype=np.int64)


def _from_separator(split: TokenSplit, ends: np.ndarray) -> Documents:
    """Documents ending at each separator (kept as their last token); the tail makes the last one."""
    if not len(ends) or ends[-1] != len(split):
        ends = np.append(ends, len(split))
    starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    lengths = ends - starts
    keep = lengths > 0
    return Documents(split, starts[keep], lengths[keep])


def _no_boundaries(source: TokenSource, why: str = "") -> TurbotrainError:
    return TurbotrainError(
        f"data.batching = 'tokens' keeps documents apart, but {source.description} has no document boundaries "
        f"turbotrain can find{why} (a text folder gives one document per file; a .bin of GPT-2 tokens is split at "
        "<|endoftext|>; a tokenizer.json needs an <|endoftext|> token); use --data.batching=windows"
    )


def open_documents(path: str, source: TokenSource) -> tuple[Documents, Documents]:
    """The train and validation documents of ``source`` (what ``open_tokens(path, ...)`` returned)."""
    tok = source.tokenizer
    is_bin = bool(path) and Path(path).suffix == ".bin"
    if tok.name == "bytes" and not is_bin:
        # the built-in corpus: (train, val) token files; a text file or folder: one, split by position
        train_files, val_files = (
            builtin_split(stdlib_files()) if not path else [text_files(Path(path).expanduser())] * 2
        )
        sizes = [[f.stat().st_size for f in files] for files in (train_files, val_files)]
        return _from_sizes(source.train, sizes[0]), _from_sizes(source.val, sizes[1])
    sep = tok.separator()
    if tok.name != "bytes" and len(sep) == 1 and not np.array_equal(sep, tok.encode([SEPARATOR])[0]):
        end = int(sep[0])  # the tokenizer's end-of-text, between files
    elif is_bin and source.vocab_size > GPT2_END_OF_TEXT:
        end = GPT2_END_OF_TEXT
    else:
        raise _no_boundaries(source)
    train_ends, val_ends = separator_ends(source.train, end), separator_ends(source.val, end)
    if not len(train_ends) and not len(val_ends):  # one document of the whole file: refuse rather than guess
        raise _no_boundaries(source, f" (no separator token {end} in it)")
    return _from_separator(source.train, train_ends), _from_separator(source.val, val_ends)
