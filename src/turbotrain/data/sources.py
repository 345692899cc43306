"""Where tokens come from: a ``.bin`` token file, text (a file or a folder), or the built-in corpus.

Text is byte-tokenized (vocabulary 256) once and cached as a uint16 ``.bin`` keyed by a hash of
the paths, sizes and modification times of the files as they were read, so later runs start at
once. A file that cannot be read is an error naming it, never silently left out (a cache missing
it would outlive the fix); a cache entry whose length does not match its sources is rebuilt. The
built-in corpus is the Python standard library's own ``.py`` files: on every machine, no download.

Token files are read with ``pread``, not a memory map: a file truncated while training gives an
error that says so instead of a bus error that kills the process without a word.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..atomic import atomic_write, clean_stale_temps
from ..errors import TurbotrainError

LLMC_MAGIC = 20240520  # llm.c token files start with a 256 x int32 header
GPT2_VOCAB = 50304  # GPT-2's 50257 padded to a multiple of 64
BYTE_VOCAB = 256
MAX_VOCAB = 1 << 16  # token ids are uint16
CACHE_VERSION = 2  # part of every cache key: bump it when what a cache entry holds changes
SEPARATOR = b"\n\n"  # between files in the byte stream
TEXT_SUFFIXES = {".txt", ".py", ".md", ".rst", ".c", ".h", ".js", ".ts", ".java", ".go", ".rs", ".json", ".toml", ".html", ".css"}


class DataReadError(TurbotrainError):
    """Data that cannot be read (any more). A DataLoader worker re-raises an error from its
    process with the worker's traceback folded into the message; this keeps the one line."""

    def __init__(self, message: str) -> None:
        if message.startswith("Caught ") and "Traceback" in message:  # re-raised from a worker process
            message = message.rstrip().splitlines()[-1].split(": ", 1)[-1]
        super().__init__(message)


@dataclass(frozen=True)
class TokenSplit:
    """A read-only view of tokens: the memory-mapped file and the [start, stop) token range."""

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

    @property
    def needed_bytes(self) -> int:
        """The file size this range needs."""
        return self.offset_bytes + 2 * self.stop

    def shrunk(self, fd: int) -> DataReadError:
        size = os.fstat(fd).st_size
        return DataReadError(
            f"{self.path} shrank to {size:,} bytes while in use (this run needs {self.needed_bytes:,}); "
            "put the complete file back, then continue with --resume"
        )

    def read_rows(self, fd: int, offsets: np.ndarray, length: int) -> np.ndarray:
        """Tokens ``[o, o + length)`` of the range for each offset ``o``, as a (rows, length)
        uint16 array, read from the open file ``fd`` with one ``pread`` per row; a short read
        (the file shrank) raises :class:`DataReadError`."""
        row_bytes = 2 * length
        out = bytearray(len(offsets) * row_bytes)
        view = memoryview(out)
        base = self.offset_bytes + 2 * self.start
        for i, offset in enumerate(offsets.tolist()):
            if os.preadv(fd, [view[i * row_bytes : (i + 1) * row_bytes]], base + 2 * offset) != row_bytes:
                raise self.shrunk(fd)
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
    """The standard library's .py files in a fixed order (site-packages and tests of venvs excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file()]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _unreadable(path: Path | str, exc: OSError) -> DataReadError:
    return DataReadError(f"cannot read {path} ({exc.strerror}); fix its permissions or move it out of the data folder")


def _raise_unreadable(exc: OSError) -> None:
    raise _unreadable(exc.filename, exc)


def _text_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = [
        Path(folder) / name
        for folder, _, names in os.walk(path, onerror=_raise_unreadable)  # an unreadable subfolder is named too
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


def _cache_path(cache_dir: Path, keys: list[FileKey]) -> Path:
    h = hashlib.blake2b(digest_size=12)
    h.update(f"v{CACHE_VERSION}\n".encode())
    for name, size, mtime_ns in keys:
        h.update(f"{name}\0{size}\0{mtime_ns}\n".encode())
    return cache_dir / f"bytes-{h.hexdigest()}.bin"


def _cached_bytes(keys: list[FileKey]) -> int:
    """The size of the cache entry for ``keys``: every byte and separator as a uint16."""
    return 2 * sum(size + len(SEPARATOR) for _, size, _ in keys)


def byte_tokenize(files: list[Path], cache_dir: Path) -> Path:
    """Concatenate the files' bytes (separated by a blank line) into a cached uint16 token file.

    Returns its path. The entry is keyed on the files as they were read and used again only when
    its size matches them; it is written atomically (:func:`turbotrain.atomic.atomic_write`).
    """
    cache_dir.mkdir(parents=True, exist_ok=True)
    clean_stale_temps(cache_dir)
    listed = [_listed(f) for f in files]
    out = _cache_path(cache_dir, listed)
    if out.is_file() and out.stat().st_size == _cached_bytes(listed):
        return out
    chunks, read = [], []
    for f in files:
        data, key = _read(f)
        chunks += [data, SEPARATOR]
        read.append(key)
    out = _cache_path(cache_dir, read)  # a file changed between listing and reading: key what was read
    data = np.frombuffer(b"".join(chunks), dtype=np.uint8).astype(np.uint16)
    atomic_write(out, data.tofile)
    return out


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
            raise TurbotrainError(f"{path}: llm.c header says {n} tokens but the file holds fewer; re-export it")
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
                vocab = json.loads(meta.read_bytes())["vocab_size"]
            except (ValueError, KeyError, TypeError, OSError):
                vocab = None
            if not isinstance(vocab, int) or isinstance(vocab, bool) or not 1 <= vocab <= MAX_VOCAB:
                raise TurbotrainError(f"{meta} must be JSON with a whole-number 'vocab_size' from 1 to {MAX_VOCAB} "
                                      "(token ids are uint16)")
            break
    return offset, n_tokens, vocab


def _split(path: Path, offset: int, n_tokens: int, val_fraction: float) -> tuple[TokenSplit, TokenSplit]:
    n_val = int(n_tokens * val_fraction)
    return TokenSplit(path, offset, 0, n_tokens - n_val), TokenSplit(path, offset, n_tokens - n_val, n_tokens)


def open_tokens(path: str, *, val_fraction: float, cache_dir: str = "") -> TokenSource:
    """Resolve ``data.path`` into train/validation token ranges.

    ``""`` -> built-in corpus; ``*.bin`` -> uint16 tokens (validation = the file's tail, or a
    sibling ``val.bin`` when the file is ``train.bin``); a text file or folder -> bytes, cached.
    """
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    if not path:
        files = stdlib_files()
        if not files:
            raise TurbotrainError("the built-in corpus (Python stdlib sources) was not found; pass --data PATH")
        # Deterministic split by file: every 20th file (in sorted order) is validation, so the
        # validation text is whole modules the model never saw.
        val_files = files[::20]
        train_files = [f for i, f in enumerate(files) if i % 20]
        tp = byte_tokenize(train_files, cache)
        vp = byte_tokenize(val_files, cache)
        return TokenSource(
            TokenSplit(tp, 0, 0, tp.stat().st_size // 2),
            TokenSplit(vp, 0, 0, vp.stat().st_size // 2),
            BYTE_VOCAB,
            f"built-in corpus: {len(train_files)} + {len(val_files)} Python stdlib files",
        )
    p = Path(path).expanduser()
    if not p.exists():
        raise TurbotrainError(f"data path {path!r} does not exist; pass --data with a .bin token file, a text file or a folder")
    if p.is_file() and p.suffix == ".bin":
        offset, n, vocab = _bin_layout(p)
        if n == 0:
            raise TurbotrainError(f"{path} holds no tokens; pass a non-empty .bin file")
        sibling = p.with_name("val.bin")
        if p.name == "train.bin" and sibling.is_file():
            v_offset, v_n, _ = _bin_layout(sibling)
            train, val = TokenSplit(p, offset, 0, n), TokenSplit(sibling, v_offset, 0, v_n)
        else:
            train, val = _split(p, offset, n, val_fraction)
        return TokenSource(train, val, vocab, f"{p} ({n:,} tokens)")
    files = _text_files(p)
    if not files or sum(_listed(f)[1] for f in files) == 0:
        raise TurbotrainError(f"data path {path!r} holds no text; pass --data with a non-empty text file, a folder of text files or a .bin token file")
    tp = byte_tokenize(files, cache)
    n = tp.stat().st_size // 2
    train, val = _split(tp, 0, n, val_fraction)
    return TokenSource(train, val, BYTE_VOCAB, f"{p} ({len(files)} files, {n:,} bytes)")
