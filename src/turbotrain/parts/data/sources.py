"""Where tokens come from: a ``.bin`` token file, text (a file or a folder), or the built-in corpus
(the Python standard library's own ``.py`` files: on every machine, no download).

Text is tokenized once (bytes by default, or ``data.tokenizer``) and cached as a uint16 ``.bin``
keyed by the tokenizer and the paths, sizes and modification times of the files as they were
read. A file that cannot be read is an error naming it, never silently left out (a cache missing
it would outlive the fix); a cache entry whose length does not match its sources is rebuilt.
Token files are read with ``pread``, not a memory map: a file truncated while training gives an
error that says so instead of a bus error that kills the process without a word.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import sys
import sysconfig
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import numpy as np

from ...base.atomic import atomic_write, clean_stale_temps, make_dirs
from ...base.errors import TurbotrainError
from .tokenizer import (
    BYTE_VOCAB,
    CACHE_HINT,
    GPT2_VOCAB,
    MAX_VOCAB,
    SEPARATOR,
    ByteTokenizer,
    JsonTokenizer,
    Tokenizer,
    build_tokenizer,
    padded_vocab,
)

if TYPE_CHECKING:
    from rich.progress import Progress

log = logging.getLogger(__name__)

LLMC_MAGIC = 20240520  # llm.c token files start with a 256 x int32 header
CACHE_VERSION = 2  # part of every cache key: bump it when what a cache entry holds changes
# text handed to a subword tokenizer per call (~1 s; Ctrl-C is seen between calls)
ENCODE_CHUNK_BYTES = 8 << 20
TEXT_SUFFIXES = set(".txt .py .md .rst .c .h .js .ts .java .go .rs .json .toml .html .css".split())


class DataReadError(TurbotrainError):
    """Data that cannot be read (any more). A DataLoader worker re-raises an error from its
    process with the worker's traceback folded into the message; this keeps the one line."""

    def __init__(self, message: str) -> None:
        if message.startswith("Caught ") and "Traceback" in message:  # re-raised from a worker process
            message = message.rstrip().splitlines()[-1].split(": ", 1)[-1]
        super().__init__(message)


class PreadFile:
    """A token file opened on first use for ``pread`` (reads at an offset, no file position, so a
    forked DataLoader worker may share the descriptor), left out when pickled (a worker started
    by spawn opens its own). A file that cannot be opened is a one-line :class:`DataReadError`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: BinaryIO | None = None

    def fd(self) -> int:
        """The open file's descriptor."""
        if self._file is None:
            try:
                self._file = open(self.path, "rb", buffering=0)
            except OSError as exc:
                raise DataReadError(
                    f"cannot read {self.path} ({exc.strerror}); put it back, then continue with --resume"
                ) from None
        return self._file.fileno()

    def close(self) -> None:
        """Close the file (the run's data is done with it); a later read opens it again."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_file": None}


@dataclass(frozen=True)
class TokenSplit:
    """A read-only view of tokens: the file and the [start, stop) token range."""

    path: Path
    offset_bytes: int  # header size
    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start

    def array(self) -> np.ndarray:
        """The range as a read-only memory map (for inspection: a file truncated while it is
        mapped kills the process on access; training reads through :meth:`read_rows`)."""
        mm = np.memmap(self.path, dtype=np.uint16, mode="r", offset=self.offset_bytes)
        return mm[self.start : self.stop]

    def read_rows(self, fd: int, offsets: np.ndarray, length: int) -> np.ndarray:
        """Tokens ``[o, o + length)`` of the range for each offset ``o``, (rows, length) uint16, one
        ``pread`` per row from ``fd``; a short read (the file shrank) raises :class:`DataReadError`."""
        row_bytes = 2 * length
        out = bytearray(len(offsets) * row_bytes)
        view = memoryview(out)
        base = self.offset_bytes + 2 * self.start
        for i, offset in enumerate(offsets.tolist()):
            if os.preadv(fd, [view[i * row_bytes : (i + 1) * row_bytes]], base + 2 * offset) != row_bytes:
                needed, size = self.offset_bytes + 2 * self.stop, os.fstat(fd).st_size
                raise DataReadError(
                    f"{self.path} shrank to {size:,} bytes while in use (this run needs {needed:,}); "
                    "put the complete file back, then continue with --resume"
                )
        return np.frombuffer(out, dtype=np.uint16).reshape(len(offsets), length)

    def max_token(self, limit: int | None = None) -> int:
        """The largest token id among the first ``limit`` tokens of the range (all when None;
        -1 when empty), read in chunks of 16 M tokens (~30 ms for 30 M tokens from the page cache)."""
        n = len(self) if limit is None else min(limit, len(self))
        chunk, top = 1 << 24, -1
        with open(self.path, "rb", buffering=0) as f:
            for i in range(0, n, chunk):
                rows = self.read_rows(f.fileno(), np.array([i]), min(chunk, n - i))
                top = max(top, int(rows.max()))
        return top


@dataclass(frozen=True)
class TokenSource:
    """Train and validation token ranges plus the vocabulary size they imply."""

    train: TokenSplit
    val: TokenSplit
    vocab_size: int
    description: str
    tokenizer: Tokenizer = field(default_factory=ByteTokenizer)  # what made the tokens (bytes for a .bin)


FULL_SCAN_TOKENS = 1 << 28  # scan token files up to 256 M tokens whole (well under a second from cache)


def check_vocab(source: TokenSource, vocab_size: int) -> None:
    """Refuse data whose token ids do not fit the model's embedding (an index error on CPU, a
    device-side assert that kills the process on CUDA). Byte-tokenized text fits any vocabulary
    of 256 or more by construction; a token file is scanned whole up to FULL_SCAN_TOKENS, and
    beyond that its first FULL_SCAN_TOKENS tokens per split, so start-up stays bounded."""
    if source.vocab_size == BYTE_VOCAB and vocab_size >= BYTE_VOCAB:
        return
    top = max(source.train.max_token(FULL_SCAN_TOKENS), source.val.max_token(FULL_SCAN_TOKENS))
    if top >= vocab_size:
        raise TurbotrainError(
            f"{source.description} holds token id {top}, but the model's vocabulary is {vocab_size}; "
            f"set --model.vocab_size={top + 1} or more (or fix vocab_size in the .bin's meta.json)"
        )


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "turbotrain"


def stdlib_files() -> list[Path]:
    """The standard library's .py files in a fixed order (no site-packages), walked once per process."""
    return list(_stdlib_files())


@functools.cache
def _stdlib_files() -> tuple[Path, ...]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file()]
    return tuple(sorted(files, key=lambda p: p.relative_to(root).as_posix()))


def _unreadable(path: Path | str, exc: OSError) -> DataReadError:
    return DataReadError(
        f"cannot read {path} ({exc.strerror}); fix its permissions or move it out of the data folder"
    )


def _raise_unreadable(exc: OSError) -> None:
    raise _unreadable(exc.filename, exc)


BUILTIN_VAL_EVERY = 20  # the built-in corpus: every 20th stdlib file (sorted) is validation


def builtin_split(files: list[Path]) -> tuple[list[Path], list[Path]]:
    """(train, validation) files of the built-in corpus: every ``BUILTIN_VAL_EVERY``-th file in
    sorted order is validation, so the validation text is whole modules the model never saw."""
    return [f for i, f in enumerate(files) if i % BUILTIN_VAL_EVERY], files[::BUILTIN_VAL_EVERY]


def text_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = [
        Path(folder) / name
        # an unreadable subfolder is named too
        for folder, _, names in os.walk(path, onerror=_raise_unreadable)
        for name in names
        if Path(name).suffix.lower() in TEXT_SUFFIXES and (Path(folder) / name).is_file()
    ]
    return sorted(files, key=lambda p: p.relative_to(path).as_posix())


FileKey = tuple[str, int, int]  # (path, size in bytes, modification time in ns)


def _listed(f: Path) -> FileKey:
    try:
        st = f.stat()
    except OSError as exc:
        raise _unreadable(f, exc) from None
    return str(f), st.st_size, st.st_mtime_ns


def _read(f: Path) -> tuple[bytes, FileKey]:
    """The file's bytes and the key of what was read (its size and time after reading)."""
    try:
        with open(f, "rb") as fh:
            data = fh.read()
            st = os.fstat(fh.fileno())
    except OSError as exc:
        raise _unreadable(f, exc) from None
    return data, (str(f), len(data), st.st_mtime_ns)


def _files_key(keys: list[FileKey]) -> str:
    h = hashlib.blake2b(digest_size=12)
    h.update(f"v{CACHE_VERSION}\n".encode())
    for name, size, mtime_ns in keys:
        h.update(f"{name}\0{size}\0{mtime_ns}\n".encode())
    return h.hexdigest()


def _cache_path(cache_dir: Path, keys: list[FileKey], tokenizer: str = "bytes") -> Path:
    """``<tokenizer name>-<hash of the files>.bin``: a tokenizer's name is a hash of its
    ``tokenizer.json`` (vocabulary included), so no other tokenizer ever reads this entry."""
    return cache_dir / f"{tokenizer}-{_files_key(keys)}.bin"


def byte_tokenize(files: list[Path], cache_dir: Path, listed: list[FileKey]) -> Path:
    """The files' bytes, a blank line after each, as a cached uint16 token file (``listed``: their
    keys); returns its path. Keyed on the files as they were read, used again only when its size matches."""
    out = _cache_path(cache_dir, listed)
    # the entry's size: every byte and separator as a uint16
    if out.is_file() and out.stat().st_size == 2 * sum(size + len(SEPARATOR) for _, size, _ in listed):
        return out
    chunks, read = [], []
    for f in files:
        data, key = _read(f)
        chunks += [data, SEPARATOR]
        read.append(key)
    out = _cache_path(cache_dir, read)  # a file changed between listing and reading: key what was read
    tokens = np.frombuffer(b"".join(chunks), dtype=np.uint8).astype(np.uint16)
    atomic_write(out, tokens, hint=CACHE_HINT)
    return out


def _batches(files: Sequence[Path], limit: int) -> list[list[Path]]:
    """Consecutive groups of files holding about ``limit`` bytes each."""
    groups: list[list[Path]] = [[]]
    size = 0
    for f in files:
        if groups[-1] and size >= limit:
            groups.append([])
            size = 0
        groups[-1].append(f)
        size += _listed(f)[1]
    return groups


def _encode_progress(total: int, label: str, show: bool) -> Progress:
    """A transient bar in bytes on a terminal when ``show``; nothing otherwise (start and end are logged)."""
    # rich.progress costs ~0.1 s to import: only a run that tokenizes files pays it
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn(label),
        BarColumn(),
        DownloadColumn(),
        TimeElapsedColumn(),
        transient=True,
        disable=not (show and sys.stderr.isatty()),
    )


def tokenize_files(files: list[Path], cache_dir: Path, tokenizer: Tokenizer, progress: bool = False) -> Path:
    """The files' tokens, a separator (end-of-text where the tokenizer has one) after each, as a
    cached uint16 token file; returns its path. A subword entry is used again only when its
    ``.json`` (written after it) says how many tokens it holds and the size agrees. Ctrl-C between
    chunks of ~8 MB leaves nothing behind."""
    make_dirs(cache_dir, hint=CACHE_HINT)
    clean_stale_temps(cache_dir)  # what killed writers left
    listed = [_listed(f) for f in files]
    if tokenizer.name == ByteTokenizer.name:
        return byte_tokenize(files, cache_dir, listed)
    out = _cache_path(cache_dir, listed, tokenizer.name)
    if _complete(out):
        return out
    total = sum(size for _, size, _ in listed)
    log.info(
        "tokenizing %d files (%.1f MB) with %s; cached for later runs",
        len(files),
        total / 1e6,
        tokenizer.name,
    )
    start = time.perf_counter()
    parts, read = _encode_files(files, tokenizer, total, progress, start)
    tokens = np.concatenate(parts) if parts else np.zeros(0, np.uint16)
    # a file changed between listing and reading: key what was read
    out = _cache_path(cache_dir, read, tokenizer.name)
    atomic_write(out, tokens, hint=CACHE_HINT)
    meta = {"vocab_size": padded_vocab(tokenizer.vocab_size), "tokens": int(tokens.size)}
    atomic_write(out.with_suffix(".json"), json.dumps({**meta, "tokenizer": tokenizer.name}), hint=CACHE_HINT)
    log.info(
        "%d files -> %s tokens (%.2f bytes/token) in %.1f s",
        len(files),
        f"{tokens.size:,}",
        sum(k[1] for k in read) / max(1, tokens.size),
        time.perf_counter() - start,
    )
    return out


def _encode_files(
    files: list[Path], tokenizer: Tokenizer, total: int, progress: bool, start: float
) -> tuple[list[np.ndarray], list[FileKey]]:
    """(the token arrays, the keys of the files as read), a bar on a terminal or a log line per chunk."""
    sep = tokenizer.separator()
    parts: list[np.ndarray] = []
    read: list[FileKey] = []
    with _encode_progress(total, f"tokenizing ({tokenizer.name})", progress) as bar:
        task = bar.add_task("encode", total=total)
        for group in _batches(files, ENCODE_CHUNK_BYTES):
            texts = []
            for f in group:
                data, key = _read(f)
                texts.append(data)
                read.append(key)
            for ids in tokenizer.encode(texts):
                parts += [ids, sep]
            bar.advance(task, sum(len(t) for t in texts))
            # no bar (not a terminal): a line per chunk of ~8 MB, so a long encode is never silent
            if bar.disable:
                done = sum(k[1] for k in read)
                log.info(
                    "tokenizing: %.1f of %.1f MB (%.0f%%), %.0f s",
                    done / 1e6,
                    total / 1e6,
                    100 * done / max(1, total),
                    time.perf_counter() - start,
                )
    return parts, read


def _complete(path: Path) -> bool:
    """Whether a subword cache entry is whole: its ``.json`` names as many tokens as it holds."""
    try:
        tokens = json.loads(path.with_suffix(".json").read_bytes())["tokens"]
        return path.stat().st_size == 2 * int(tokens)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _bin_layout(path: Path) -> tuple[int, int, int]:
    """(header bytes, number of tokens, vocab size) of a .bin token file; validates its size."""
    try:
        size = path.stat().st_size
        header = np.fromfile(path, dtype=np.int32, count=3) if size >= 12 else np.zeros(3, np.int32)
    except OSError as exc:
        raise _unreadable(path, exc) from None
    if size >= 1024 and int(header[0]) == LLMC_MAGIC:
        n = int(header[2])
        if n < 0 or 1024 + 2 * n > size:
            raise TurbotrainError(
                f"{path}: llm.c header says {n} tokens but the file holds fewer; re-export it"
            )
        offset, n_tokens = 1024, n
    else:
        if size % 2:
            raise TurbotrainError(
                f"{path} is {size} bytes, not a whole number of uint16 tokens; "
                "pass a .bin of uint16 tokens (nanoGPT/llm.c layout) or a text file"
            )
        offset, n_tokens = 0, size // 2
    vocab = GPT2_VOCAB
    for meta in (path.with_suffix(".json"), path.parent / "meta.json"):
        if meta.is_file():
            try:
                found: object = json.loads(meta.read_bytes())["vocab_size"]
            except (ValueError, KeyError, TypeError, OSError):
                found = None
            if not isinstance(found, int) or isinstance(found, bool) or not 1 <= found <= MAX_VOCAB:
                raise TurbotrainError(
                    f"{meta} must be JSON with a whole-number 'vocab_size' from 1 to {MAX_VOCAB} "
                    "(token ids are uint16)"
                )
            vocab = found
            break
    return offset, n_tokens, vocab


def _split(path: Path, offset: int, n_tokens: int, val_fraction: float) -> tuple[TokenSplit, TokenSplit]:
    n_val = int(n_tokens * val_fraction)
    return TokenSplit(path, offset, 0, n_tokens - n_val), TokenSplit(path, offset, n_tokens - n_val, n_tokens)


def _tokenizer_for(
    spec: str, train_files: list[Path], vocab_size: int, cache: Path, progress: bool, saved: Path | None
) -> Tokenizer:
    """``data.tokenizer`` for text (a BPE learns from ``train_files``); a resumed run's ``saved`` copy first."""
    if spec == "bytes":
        return ByteTokenizer()
    if saved is not None and saved.is_file():
        return JsonTokenizer(saved)
    key = _files_key([_listed(f) for f in train_files]) if spec == "bpe" else ""
    return build_tokenizer(
        spec, train_files=train_files, vocab_size=vocab_size, cache_dir=cache, key=key, progress=progress
    )


def _text_vocab(spec: str, tokenizer: Tokenizer, vocab_size: int) -> int:
    """The vocabulary text tokenized with ``tokenizer`` implies: 256 for bytes, the BPE's asked-for
    size (50304 when 0), a user's tokenizer.json's rounded up to a multiple of 64."""
    if spec == "bpe":
        return vocab_size or GPT2_VOCAB
    return (
        tokenizer.vocab_size if tokenizer.name == ByteTokenizer.name else padded_vocab(tokenizer.vocab_size)
    )


def check_data_path(path: str) -> Path:
    """``data.path`` as a Path when it names a file or a folder, else one line."""
    p = Path(path).expanduser()
    if not p.exists():
        raise TurbotrainError(
            f"data path {path!r} does not exist; pass --data with a .bin token file, a text file or a folder"
        )
    if not (p.is_file() or p.is_dir()):
        raise TurbotrainError(
            f"data path {path!r} is {_kind(p)}, not a file or a folder; pass --data with a .bin "
            "token file, a text file or a folder of text files"
        )
    return p


def open_tokens(
    path: str,
    *,
    val_fraction: float,
    cache_dir: str = "",
    tokenizer: str = "bytes",
    vocab_size: int = 0,
    progress: bool = False,
    saved_tokenizer: Path | None = None,
) -> TokenSource:
    """``data.path`` as train/validation token ranges: ``""`` the built-in corpus; ``*.bin`` uint16
    tokens (validation its tail, or a sibling ``val.bin`` of a ``train.bin``); a text file or folder
    tokenized and cached. ``tokenizer``: ``data.tokenizer``; ``vocab_size``: ``model.vocab_size``;
    ``progress``: bars on a terminal; ``saved_tokenizer``: a resumed run's copy, used if it exists."""
    cache = Path(cache_dir) if cache_dir else default_cache_dir()

    def make_tokenizer(files: list[Path]) -> Tokenizer:
        return _tokenizer_for(tokenizer, files, vocab_size, cache, progress, saved_tokenizer)

    if not path:
        return _builtin_source(make_tokenizer, tokenizer, vocab_size, cache, progress)
    p = check_data_path(path)
    if p.is_file() and p.suffix == ".bin":
        if tokenizer == "bpe":
            raise TurbotrainError(
                f"data.tokenizer = 'bpe' trains on text, but {path} is already tokens; pass the "
                "tokenizer.json that made it (so sample can decode) or leave data.tokenizer = 'bytes'"
            )
        # kept for decoding: the .bin's ids are its
        return _bin_source(p, path, val_fraction, make_tokenizer([]))
    files = text_files(p)
    if not files or sum(_listed(f)[1] for f in files) == 0:
        raise TurbotrainError(
            f"data path {path!r} holds no text; pass --data with a non-empty text file, a folder of text files or a .bin token file"
        )
    # A BPE learns from the whole text: its split is by token position, after encoding.
    tok = make_tokenizer(files)
    tp = tokenize_files(files, cache, tok, progress)
    n = tp.stat().st_size // 2
    train, val = _split(tp, 0, n, val_fraction)
    unit = "bytes" if tok.name == ByteTokenizer.name else f"tokens, {tok.name}"
    return TokenSource(
        train, val, _text_vocab(tokenizer, tok, vocab_size), f"{p} ({len(files)} files, {n:,} {unit})", tok
    )


def _builtin_source(
    make_tokenizer: Callable[[list[Path]], Tokenizer],
    tokenizer: str,
    vocab_size: int,
    cache: Path,
    progress: bool,
) -> TokenSource:
    """The built-in corpus (Python's stdlib sources), split by file, tokenized and cached."""
    files = stdlib_files()
    if not files:
        raise TurbotrainError("the built-in corpus (Python stdlib sources) was not found; pass --data PATH")
    train_files, val_files = builtin_split(files)
    tok = make_tokenizer(train_files)
    tp = tokenize_files(train_files, cache, tok, progress)
    vp = tokenize_files(val_files, cache, tok, progress)
    return TokenSource(
        TokenSplit(tp, 0, 0, tp.stat().st_size // 2),
        TokenSplit(vp, 0, 0, vp.stat().st_size // 2),
        _text_vocab(tokenizer, tok, vocab_size),
        f"built-in corpus: {len(train_files)} + {len(val_files)} Python stdlib files"
        + ("" if tok.name == ByteTokenizer.name else f", {tok.name} tokens"),
        tok,
    )


def _bin_source(p: Path, path: str, val_fraction: float, tok: Tokenizer) -> TokenSource:
    """A ``.bin`` of tokens: validation is its tail, or a sibling ``val.bin`` beside ``train.bin``."""
    offset, n, vocab = _bin_layout(p)
    if n == 0:
        raise TurbotrainError(f"{path} holds no tokens; pass a non-empty .bin file")
    sibling = p.with_name("val.bin")
    if p.name == "train.bin" and sibling.is_file():
        v_offset, v_n, _ = _bin_layout(sibling)
        train, val = TokenSplit(p, offset, 0, n), TokenSplit(sibling, v_offset, 0, v_n)
    else:
        train, val = _split(p, offset, n, val_fraction)
    return TokenSource(train, val, vocab, f"{p} ({n:,} tokens)", tok)


def _kind(p: Path) -> str:
    """What a path that is neither a regular file nor a folder is, in words."""
    if p.is_fifo():
        return "a named pipe (FIFO)"
    if p.is_char_device() or p.is_block_device():
        return "a device"
    if p.is_socket():
        return "a socket"
    return "not a regular file"
