"""Tokenizers: bytes, a byte-level BPE trained offline, a tokenizer.json the user brings."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import signal
import subprocess
import threading

import numpy as np
import pytest
from conftest import tiny_overrides

from turbotrain.base.errors import TurbotrainError
from turbotrain.base.rundir import TOKENIZER_FILE
from turbotrain.cli import main
from turbotrain.parts.data import open_tokens, stdlib_files
from turbotrain.parts.data import tokenizer as tk

TEXT = ("def add(a, b):\n    return a + b\n\n" * 40 + "naïve café — ünïcode 😀\n").encode()


def test_bytes_round_trip():
    t = tk.ByteTokenizer()
    ids = t.encode([TEXT])[0]
    assert len(ids) == len(TEXT) and ids.max() < 256 and t.decode(ids) == TEXT.decode()


def test_bpe_trains_offline_compresses_and_round_trips(tmp_path):
    pytest.importorskip("tokenizers")
    src = tmp_path / "a.py"
    src.write_bytes(TEXT)
    bad = tmp_path / "latin1.py"
    bad.write_bytes("caf\xe9 = 1\n".encode("latin-1"))  # not UTF-8: read with replacement, not a crash
    t = tk.build_tokenizer(
        "bpe", train_files=[src, bad], vocab_size=300, cache_dir=tmp_path / "cache", key="k"
    )
    assert t.vocab_size <= 300 and (tmp_path / "cache" / "bpe-k-300.json").is_file()
    ids = t.encode([TEXT])[0]
    assert len(ids) < len(TEXT) / 2  # merges learned from the repeated function
    assert t.decode(ids) == TEXT.decode()
    again = tk.build_tokenizer(
        str(tmp_path / "cache" / "bpe-k-300.json"),
        train_files=[],
        vocab_size=0,
        cache_dir=tmp_path,
        key="unused",
    )
    assert again.name == t.name and list(again.encode([TEXT])[0]) == list(ids)  # a user's tokenizer.json
    assert tk.load_run_tokenizer(tmp_path).name == "bytes"


def test_mistakes_are_one_line(tmp_path, monkeypatch):
    with pytest.raises(TurbotrainError, match="is not 'bytes', 'bpe' or the path of a tokenizer.json"):
        tk.build_tokenizer("gpt5", train_files=[], vocab_size=0, cache_dir=tmp_path, key="k")
    with pytest.raises(TurbotrainError, match="more than 256 tokens and at most 65536"):
        tk.train_bpe([], 70000, tmp_path / "x.json")
    garbage = tmp_path / "tokenizer.json"
    garbage.write_text("{not json")
    pytest.importorskip("tokenizers")
    with pytest.raises(TurbotrainError, match="is not a tokenizer.json the tokenizers package can read"):
        tk.JsonTokenizer(garbage)
    real = importlib.import_module

    def missing(name, *args, **kwargs):
        if name == "tokenizers":
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib, "import_module", missing)
    with pytest.raises(
        TurbotrainError, match=r"pip install tokenizers \(or pip install 'turbotrain\[bpe\]'\)"
    ):
        tk.build_tokenizer("bpe", train_files=[], vocab_size=0, cache_dir=tmp_path, key="k")


# ---------------------------------------------------------------- wired into data, train, sample


def _folder(tmp_path):
    """A small text folder: two files of Python-like text (~30 KB)."""
    folder = tmp_path / "text"
    folder.mkdir()
    for n in range(2):
        (folder / f"m{n}.py").write_text(
            "".join(f"def f{i}(x):\n    return x * {i} + {n}\n\n" for i in range(600))
        )
    return folder


def _train_args(tmp_path, data, *extra):
    o = tiny_overrides(tmp_path, data={"path": str(data)}, model={"vocab_size": 512})
    o["monitor"].pop("progress")
    return [
        "train",
        "--no-progress",
        *(f"--{s}.{k}={v}" for s, vals in o.items() for k, v in vals.items()),
        *extra,
    ]


@pytest.mark.slow
def test_bpe_run_trains_resumes_and_samples_with_its_own_tokenizer(tmp_path, capsys, monkeypatch):
    pytest.importorskip("tokenizers")
    folder = _folder(tmp_path)
    assert main(_train_args(tmp_path, folder, "--data.tokenizer=bpe", "--train.stop_after_steps=3")) == 0
    run = tmp_path / "runs" / "t"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "stopped" and summary["resolved"]["vocab_size"] == 512
    assert "tokens, json-" in summary["resolved"]["data"]
    saved = tk.JsonTokenizer(run / TOKENIZER_FILE)
    assert 256 < saved.vocab_size <= 512
    # the resume encodes with the run's copy: the cache (tokenizer and tokens) may be gone
    shutil.rmtree(tmp_path / "cache")
    monkeypatch.setattr(tk, "train_bpe", lambda *a, **k: pytest.fail("a resume must not train another BPE"))
    assert main(["train", "--resume", str(run), "--train.stop_after_steps=0", "--no-progress"]) == 0
    assert json.loads((run / "summary.json").read_text())["steps"] == 6
    capsys.readouterr()
    assert main(["sample", str(run), "--tokens", "20", "--prompt", "def f1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("def f1") and len(out) > len("def f1") + 20  # subword tokens: more than a byte each


def test_text_tokenized_with_bpe_is_cached_and_reused(tmp_path, monkeypatch):
    pytest.importorskip("tokenizers")
    folder = _folder(tmp_path)
    first = open_tokens(
        str(folder), val_fraction=0.1, cache_dir=str(tmp_path / "c"), tokenizer="bpe", vocab_size=400
    )
    n_bytes = sum(f.stat().st_size for f in folder.iterdir())
    assert first.vocab_size == 400 and len(first.train) + len(first.val) < n_bytes / 2
    assert first.tokenizer.decode(first.train.array()[:40].tolist()).startswith("def f0(x):")
    monkeypatch.setattr(tk, "train_bpe", lambda *a, **k: pytest.fail("the cached BPE must be reused"))
    monkeypatch.setattr(
        tk.JsonTokenizer, "encode", lambda *a: pytest.fail("the cached tokens must be reused")
    )
    again = open_tokens(
        str(folder), val_fraction=0.1, cache_dir=str(tmp_path / "c"), tokenizer="bpe", vocab_size=400
    )
    assert again.train.path == first.train.path and again.tokenizer.name == first.tokenizer.name
    # another vocabulary is another tokenizer: never the same cache entry
    monkeypatch.undo()
    other = open_tokens(
        str(folder), val_fraction=0.1, cache_dir=str(tmp_path / "c"), tokenizer="bpe", vocab_size=300
    )
    assert other.train.path != first.train.path and other.vocab_size == 300
    # bytes keep their own cache entries, as before
    assert open_tokens(
        str(folder), val_fraction=0.1, cache_dir=str(tmp_path / "c")
    ).train.path.name.startswith("bytes-")


def test_a_users_tokenizer_json_is_used_and_padded(tmp_path):
    pytest.importorskip("tokenizers")
    folder = _folder(tmp_path)
    path = tk.train_bpe([folder / "m0.py"], 300, tmp_path / "mine" / "tokenizer.json", progress=False)
    src = open_tokens(str(folder), val_fraction=0.1, cache_dir=str(tmp_path / "c"), tokenizer=str(path))
    assert src.tokenizer.file == path and src.vocab_size == 320  # 300 rounded up to a multiple of 64
    ids = src.train.array()[:200]
    assert int(ids.max()) < 300 and src.tokenizer.decode(ids.tolist()).startswith("def f0(x):")
    with pytest.raises(TurbotrainError, match="already tokens"):
        bin_path = tmp_path / "t.bin"
        np.arange(100, dtype=np.uint16).tofile(bin_path)
        open_tokens(str(bin_path), val_fraction=0.1, tokenizer="bpe")


def test_bad_tokenizer_values_and_a_missing_package_are_one_line(tmp_path, capsys, monkeypatch):
    folder = _folder(tmp_path)
    assert main(_train_args(tmp_path, folder, "--data.tokenizer=gpt2")) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "data.tokenizer" in err and "bytes, bpe, PATH/tokenizer.json" in err
    real = importlib.import_module

    def missing(name, *args, **kwargs):
        if name == "tokenizers":
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib, "import_module", missing)
    assert main(_train_args(tmp_path, folder, "--data.tokenizer=bpe")) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "pip install 'turbotrain[bpe]'" in err
    assert not (tmp_path / "runs" / "t").exists()  # nothing left behind


def test_ctrl_c_while_a_bpe_trains_ends_the_trainer_at_once_and_leaves_nothing(tmp_path, monkeypatch):
    pytest.importorskip("tokenizers")

    class Stop(KeyboardInterrupt):
        pass

    def handler(signum, frame):
        raise Stop()

    children = []
    popen = subprocess.Popen

    def spy(*args, **kwargs):  # Ctrl-C half a second into the trainer's work
        children.append(popen(*args, **kwargs))
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        return children[-1]

    monkeypatch.setattr(subprocess, "Popen", spy)
    out, files = tmp_path / "cache" / "bpe.json", stdlib_files()  # 30 MB: seconds of work
    previous = signal.signal(signal.SIGINT, handler)
    try:
        with pytest.raises(Stop):
            tk.train_bpe(files, 8192, out, progress=False)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert children and children[0].poll() is not None  # the trainer is gone, not finishing in the background
    assert list((tmp_path / "cache").iterdir()) == []  # no tokenizer, no partial file
