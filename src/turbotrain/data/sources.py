"""Where tokens come from: a ``.bin`` token file, text (a file or a folder), or the built-in corpus.

Text is byte-tokenized (vocabulary 256) once and cached as a uint16 ``.bin`` keyed by a hash of
the sources' paths, sizes and modification times, so later runs start at once. The built-in
corpus is the Python standard library's own ``.py`` files: on every machine, no download.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..atomic import atomic_write
from ..errors import TurbotrainError

LLMC_MAGIC = 20240520  # llm.c token files start with a 256 x int32 header
GPT2_VOCAB = 50304  # GPT-2's 50257 padded to a multiple of 64
BYTE_VOCAB = 256
TEXT_SUFFIXES = {".txt", ".py", ".md", ".rst", ".c", ".h", ".js", ".ts", ".java", ".go", ".rs", ".json", ".toml", ".html", ".css"}


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
        mm = np.memmap(self.path, dtype=np.uint16, mode="r", offset=self.offset_bytes)
        return mm[self.start : self.stop]

    def max_token(self, limit: int | None = None) -> int:
        """The largest token id among the first ``limit`` tokens of the range (all when None;
        -1 when empty), read in chunks of 16 M tokens (~30 ms for 30 M tokens from the page cache)."""
        tokens, chunk = self.array(), 1 << 24
        n = len(tokens) if limit is None else min(limit, len(tokens))
        return max((int(tokens[i : min(i + chunk, n)].max()) for i in range(0, n, chunk)), default=-1)


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


def _text_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = [p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES]
    return sorted(files, key=lambda p: p.relative_to(path).as_posix())


def _fingerprint(files: list[Path]) -> str:
    h = hashlib.blake2b(digest_size=12)
    for f in files:
        st = f.stat()
        h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def byte_tokenize(files: list[Path], cache_dir: Path) -> Path:
    """Concatenate the files' bytes (separated by a blank line) into a cached uint16 token file.

    Returns its path. The cache is written atomically (:func:`turbotrain.atomic.atomic_write`).
    """
    cache_dir.mkdir(parents=True, exist_ok=True)
    out = cache_dir / f"bytes-{_fingerprint(files)}.bin"
    if out.exists():
        return out
    chunks = []
    for f in files:
        try:
            chunks.append(f.read_bytes() + b"\n\n")
        except OSError:
            continue
    data = np.frombuffer(b"".join(chunks), dtype=np.uint8).astype(np.uint16)
    atomic_write(out, data.tofile)
    return out


def _bin_layout(path: Path) -> tuple[int, int, int]:
    """(header bytes, number of tokens, vocab size) of a .bin token file; validates its size."""
    size = path.stat().st_size
    header = np.fromfile(path, dtype=np.int32, count=3) if size >= 12 else np.zeros(3, np.int32)
    if size >= 1024 and int(header[0]) == LLMC_MAGIC:
        n = int(header[2])
        if 1024 + 2 * n > size:
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
                vocab = int(json.loads(meta.read_text())["vocab_size"])
            except (ValueError, KeyError, TypeError):
                raise TurbotrainError(f"{meta} must be JSON with an integer 'vocab_size'") from None
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
    if not files or sum(f.stat().st_size for f in files) == 0:
        raise TurbotrainError(f"data path {path!r} holds no text; pass --data with a non-empty text file, a folder of text files or a .bin token file")
    tp = byte_tokenize(files, cache)
    n = tp.stat().st_size // 2
    train, val = _split(tp, 0, n, val_fraction)
    return TokenSource(train, val, BYTE_VOCAB, f"{p} ({len(files)} files, {n:,} bytes)")
