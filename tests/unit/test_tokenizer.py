"""Tokenizers: bytes, a byte-level BPE trained offline, a tokenizer.json the user brings."""

from __future__ import annotations

import importlib

import pytest

from turbotrain.data import tokenizer as tk
from turbotrain.errors import TurbotrainError

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
    t = tk.build_tokenizer("bpe", train_files=[src, bad], vocab_size=300, cache_dir=tmp_path / "cache", key="k")
    assert t.vocab_size <= 300 and (tmp_path / "cache" / "bpe-k-300.json").is_file()
    ids = t.encode([TEXT])[0]
    assert len(ids) < len(TEXT) / 2  # merges learned from the repeated function
    assert t.decode(ids) == TEXT.decode()
    again = tk.build_tokenizer(str(tmp_path / "cache" / "bpe-k-300.json"), train_files=[], vocab_size=0,
                               cache_dir=tmp_path, key="unused")
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
    with pytest.raises(TurbotrainError, match=r"pip install tokenizers \(or pip install 'turbotrain\[bpe\]'\)"):
        tk.build_tokenizer("bpe", train_files=[], vocab_size=0, cache_dir=tmp_path, key="k")
