"""Tokenizers for text data: bytes (vocabulary 256, always there), a byte-level BPE trained offline
on the training files (``data.tokenizer = "bpe"``, ``model.vocab_size`` tokens, 50304 when 0,
cached; nothing is downloaded) or a ``tokenizer.json`` the user brings. Every run copies its
tokenizer into its run directory, so ``sample`` and a resume use the same one. The BPE trains in a
child process: the native trainer cannot be interrupted, so Ctrl-C or SIGTERM end the child at once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ...base.atomic import atomic_write, make_dirs
from ...base.errors import TurbotrainError, required_module
from ...base.rundir import TOKENIZER_FILE

log = logging.getLogger(__name__)

BYTE_VOCAB = 256
MAX_VOCAB = 1 << 16  # token ids are stored as uint16
GPT2_VOCAB = 50304  # GPT-2's 50257 padded to a multiple of 64: a .bin's default and bpe's default size
VOCAB_MULTIPLE = 64  # a model vocabulary rounded up to this keeps the output matmul on fast kernel shapes
END_OF_TEXT = "<|endoftext|>"
SEPARATOR = b"\n\n"  # between files in the byte stream, and between documents for a tokenizer without an end-of-text token
INSTALL_HINT = "pip install 'turbotrain[bpe]'"
CACHE_HINT = "choose another folder with --data.cache_dir (or make that one writable)"


class Tokenizer(Protocol):
    name: str  # part of the token cache key: a different tokenizer never reuses a cache entry
    vocab_size: int

    @property
    def file(self) -> Path | None:
        """The tokenizer.json a run copies (None: bytes, nothing to copy)."""

    def encode(self, texts: Sequence[bytes]) -> list[np.ndarray]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def separator(self) -> np.ndarray: ...


class ByteTokenizer:
    """Each byte is a token: no training, no package, no unknown characters."""

    name = "bytes"
    vocab_size = BYTE_VOCAB
    file = None

    def encode(self, texts: Sequence[bytes]) -> list[np.ndarray]:
        return [np.frombuffer(t, dtype=np.uint8).astype(np.uint16) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < BYTE_VOCAB).decode("utf-8", errors="replace")

    def separator(self) -> np.ndarray:
        return self.encode([SEPARATOR])[0]


class JsonTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer, from its ``tokenizer.json``."""

    def __init__(self, path: Path) -> None:
        tokenizers = _tokenizers()
        try:
            self.tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # the package raises its own exception types for a bad file
            raise TurbotrainError(
                f"{path} is not a tokenizer.json the tokenizers package can read ({exc})"
            ) from None
        self.file = path
        self.vocab_size = self.tok.get_vocab_size()
        if self.vocab_size > MAX_VOCAB:
            raise TurbotrainError(
                f"{path} has {self.vocab_size} tokens; token files hold uint16 ids, at most {MAX_VOCAB}"
            )
        self.name = "json-" + hashlib.blake2b(path.read_bytes(), digest_size=8).hexdigest()

    def encode(self, texts: Sequence[bytes]) -> list[np.ndarray]:
        encoded = self.tok.encode_batch(
            [t.decode("utf-8", errors="replace") for t in texts], add_special_tokens=False
        )
        return [np.asarray(e.ids, dtype=np.uint16) for e in encoded]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode([int(i) for i in ids])

    def separator(self) -> np.ndarray:
        """GPT-2's convention: one end-of-text token between documents, where the tokenizer has one."""
        eot = self.tok.token_to_id(END_OF_TEXT)
        return np.array([eot], dtype=np.uint16) if eot is not None else self.encode([SEPARATOR])[0]


def _tokenizers() -> Any:
    return required_module(
        "tokenizers",
        "data.tokenizer = 'bpe' or a tokenizer.json needs the tokenizers package: "
        f"pip install tokenizers (or {INSTALL_HINT})",
    )


def padded_vocab(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`VOCAB_MULTIPLE` (at most :data:`MAX_VOCAB`)."""
    return min(MAX_VOCAB, -(-n // VOCAB_MULTIPLE) * VOCAB_MULTIPLE)


# The trainer runs in a child process: the package's native trainer cannot be stopped, and a
# process holding it (even in a daemon thread) only exits once it has finished. Errors come back
# as one line on stdout; the progress bar goes to the inherited stderr.
_TRAIN_SCRIPT = r"""
import json, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides: Ctrl-C there ends this process
import tokenizers as tk
a = json.load(sys.stdin)
def texts():
    for f in a["files"]:
        try:
            with open(f, "rb") as fh:
                data = fh.read()
        except OSError as exc:
            print(f"cannot read {f} ({exc.strerror})", flush=True)
            sys.exit(3)
        yield data.decode("utf-8", errors="replace")  # as encode() will see it
tok = tk.Tokenizer(tk.models.BPE())
tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = tk.decoders.ByteLevel()
trainer = tk.trainers.BpeTrainer(vocab_size=a["vocab"], special_tokens=[a["eot"]], show_progress=a["progress"],
                                 initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
tok.train_from_iterator(texts(), trainer, length=len(a["files"]))
try:
    tok.save(a["out"])
except Exception as exc:  # the package's own error type; a full disk or a refused write
    print(f"cannot write {a['out']} ({' '.join(str(exc).split())[:200]})", flush=True)
    sys.exit(3)
"""


def train_bpe(files: Sequence[Path], vocab_size: int, out: Path, progress: bool = True) -> Path:
    """Train a byte-level BPE of ``vocab_size`` tokens on ``files`` and write it to ``out``
    (atomically); a signal's exception ends the child and propagates from here."""
    if not BYTE_VOCAB < vocab_size <= MAX_VOCAB:
        raise TurbotrainError(
            f"model.vocab_size = {vocab_size}: a BPE needs more than {BYTE_VOCAB} tokens "
            f"and at most {MAX_VOCAB} (uint16 ids)"
        )
    _tokenizers()  # the one-line install hint, before any child starts
    mb = sum(f.stat().st_size for f in files) / 1e6
    log.info(
        "training a byte-level BPE of %d tokens on %d files (%.1f MB); cached for later runs",
        vocab_size,
        len(files),
        mb,
    )
    start = time.perf_counter()
    make_dirs(out.parent, hint=CACHE_HINT)
    # clean_stale_temps knows the pattern
    partial = out.with_name(f".{out.stem}-train{out.suffix}.tmp{os.getpid()}")
    request = dict(
        files=[str(f) for f in files], vocab=vocab_size, eot=END_OF_TEXT, progress=progress, out=str(partial)
    )
    child = subprocess.Popen(
        [sys.executable, "-c", _TRAIN_SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        said, _ = child.communicate(json.dumps(request))  # a signal handler's exception interrupts the wait
        if child.returncode != 0:
            reason = said.strip().splitlines()[-1] if said.strip() else f"exit code {child.returncode}"
            raise TurbotrainError(f"training the BPE failed: {reason}")
        atomic_write(out, partial.read_bytes(), hint=CACHE_HINT)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        partial.unlink(missing_ok=True)
    log.info("BPE trained in %.1f s: %s", time.perf_counter() - start, out)
    return out


def build_tokenizer(
    spec: str,
    *,
    train_files: Sequence[Path],
    vocab_size: int,
    cache_dir: Path,
    key: str,
    progress: bool = True,
) -> Tokenizer:
    """``data.tokenizer`` -> a tokenizer: ``bytes``; ``bpe`` (cached under ``cache_dir`` as
    ``bpe-<key>-<vocab>.json``, ``key`` naming the files as listed); or a ``tokenizer.json``'s path."""
    if spec == "bytes":
        return ByteTokenizer()
    if spec == "bpe":
        vocab = vocab_size or GPT2_VOCAB
        path = cache_dir / f"bpe-{key}-{vocab}.json"
        if not path.is_file():
            if not vocab_size:
                log.info(
                    "model.vocab_size = 0: the BPE gets %d tokens (GPT-2's 50257 padded to a multiple of 64); "
                    "set model.vocab_size for another size",
                    GPT2_VOCAB,
                )
            train_bpe(train_files, vocab, path, progress=progress)
        return JsonTokenizer(path)
    path = Path(spec).expanduser()
    if not path.is_file():
        raise TurbotrainError(
            f"data.tokenizer = {spec!r} is not 'bytes', 'bpe' or the path of a tokenizer.json"
        )
    return JsonTokenizer(path)


def save_run_tokenizer(tokenizer: Tokenizer, run_dir: Path) -> None:
    """Copy the tokenizer's ``tokenizer.json`` into the run directory (nothing for bytes)."""
    target = run_dir / TOKENIZER_FILE
    if tokenizer.file is not None and tokenizer.file.resolve() != target.resolve():
        atomic_write(target, tokenizer.file.read_bytes())


def load_run_tokenizer(run_dir: Path) -> Tokenizer:
    """The tokenizer a run trained with: its copied ``tokenizer.json``, or bytes when it has none."""
    path = run_dir / TOKENIZER_FILE
    return JsonTokenizer(path) if path.is_file() else ByteTokenizer()
