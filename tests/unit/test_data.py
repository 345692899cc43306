import builtins
import contextlib
import errno
import io
import os
import pickle
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
import torch

from turbotrain.base.errors import TurbotrainError
from turbotrain.parts.data import (
    DevicePrefetcher,
    Position,
    RandomWindowSampler,
    TokenWindows,
    build_loader,
    default_num_workers,
    fixed_batches,
    open_tokens,
    resolve_loader_settings,
)
from turbotrain.parts.data.batching import PieceRows
from turbotrain.parts.data.documents import Documents
from turbotrain.parts.data.epochs import EpochSampler
from turbotrain.parts.data.sources import LLMC_MAGIC

CPU = torch.device("cpu")


def test_bin_file_windows_are_shifted_targets(tmp_path: Path):
    tokens = np.arange(1000, dtype=np.uint16)
    path = tmp_path / "toks.bin"
    tokens.tofile(path)
    src = open_tokens(str(path), val_fraction=0.1)
    assert (len(src.train), len(src.val), src.vocab_size) == (900, 100, 50304)
    x, y = TokenWindows(src.train, 16).__getitems__([5, 100])
    assert x.dtype == torch.int64 and x.shape == (2, 16)
    assert torch.equal(x[0], torch.arange(5, 21)) and torch.equal(y[0], torch.arange(6, 22))


def test_llmc_header_and_meta_vocab(tmp_path: Path):
    header = np.zeros(256, dtype=np.int32)
    header[:3] = (LLMC_MAGIC, 1, 500)
    path = tmp_path / "train.bin"
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.arange(500, dtype=np.uint16).tobytes())
    (tmp_path / "meta.json").write_text('{"vocab_size": 600}')
    src = open_tokens(str(path), val_fraction=0.2)
    assert src.vocab_size == 600 and len(src.train) == 400
    assert int(src.train.array()[0]) == 0  # header skipped


def test_odd_sized_bin_is_rejected(tmp_path: Path):
    path = tmp_path / "bad.bin"
    path.write_bytes(b"\x00" * 11)
    with pytest.raises(TurbotrainError, match="whole number of uint16 tokens"):
        open_tokens(str(path), val_fraction=0.1)


@pytest.mark.parametrize("make", ["missing", "empty_dir", "empty_file"])
def test_missing_or_empty_paths_are_rejected(tmp_path: Path, make: str):
    path = tmp_path / "data"
    if make == "empty_dir":
        path.mkdir()
    elif make == "empty_file":
        path = tmp_path / "empty.txt"
        path.write_text("")
    with pytest.raises(TurbotrainError, match="--data"):
        open_tokens(str(path), val_fraction=0.1)


def test_text_is_byte_tokenized_once_and_cached(tmp_path: Path, text_file: Path):
    cache = tmp_path / "cache"
    a = open_tokens(str(text_file), val_fraction=0.1, cache_dir=str(cache))
    b = open_tokens(str(text_file), val_fraction=0.1, cache_dir=str(cache))
    assert a.vocab_size == 256 and a.train.path == b.train.path and len(list(cache.iterdir())) == 1
    text = text_file.read_bytes()
    assert bytes(a.train.array()[:20].astype(np.uint8)) == text[:20]
    text_file.write_text("changed")  # the key follows the source: a new cache entry
    c = open_tokens(str(text_file), val_fraction=0.1, cache_dir=str(cache))
    assert c.train.path != a.train.path


def test_builtin_corpus_is_python_and_split_deterministically(tmp_path: Path):
    a = open_tokens("", val_fraction=0.05, cache_dir=str(tmp_path))
    b = open_tokens("", val_fraction=0.05, cache_dir=str(tmp_path))
    assert a.vocab_size == 256 and a.train.path == b.train.path and a.val.path == b.val.path
    assert len(a.train) > 1_000_000 and len(a.val) > 50_000
    sample = bytes(a.train.array()[:5000].astype(np.uint8))
    assert b"def " in sample or b"import " in sample


def test_loader_stream_resumes_at_any_batch(tmp_path: Path, text_file: Path):
    src = open_tokens(str(text_file), val_fraction=0.1, cache_dir=str(tmp_path))
    ds = TokenWindows(src.train, 16)
    settings = resolve_loader_settings(CPU, 0, True, 2)
    full = [b for _, b in zip(range(6), build_loader(ds, 4, seed=3, settings=settings))]
    tail = [b for _, b in zip(range(3), build_loader(ds, 4, seed=3, settings=settings, at=Position(start=3)))]
    for (x1, y1), (x2, y2) in zip(full[3:], tail):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(full[0][0], full[1][0])


def _step_rows(micro: int, accumulation: int, world: int, steps: int = 4) -> list[list[list[int]]]:
    """Each optimizer step's micro-batches (window offsets), over every rank and micro-step."""
    ranks = [
        RandomWindowSampler(5000, micro, 11, Position(rank=r, world=world, accumulation=accumulation))
        for r in range(world)
    ]
    return [
        [ranks[r].batch(s * accumulation + j) for j in range(accumulation) for r in range(world)]
        for s in range(steps)
    ]


def test_the_rows_of_a_step_depend_only_on_the_seed_the_step_and_the_global_batch():
    """Any micro x accumulation x world of global batch 8: the same rows in the same steps."""
    reference = [sorted(sum(step, [])) for step in _step_rows(8, 1, 1)]
    for micro, accumulation, world in [(4, 2, 1), (4, 1, 2), (2, 2, 2), (1, 4, 2), (2, 1, 4)]:
        assert [sorted(sum(step, [])) for step in _step_rows(micro, accumulation, world)] == reference
    # the same micro: the very same micro-batches (what a per-forward loss, e.g. MoE's load balancing, sees)
    assert _step_rows(4, 2, 1) == _step_rows(4, 1, 2) and _step_rows(2, 2, 2) == _step_rows(2, 4, 1)
    # accumulation 1 keeps the order of earlier versions: step s = global micro-batch s, rank r its slice
    offsets = torch.randint(5000, (8,), generator=torch.Generator().manual_seed(11 * 1_000_003 + 3)).tolist()
    assert RandomWindowSampler(5000, 4, 11, Position(rank=1, world=2)).batch(3) == offsets[4:]
    # a resume after step s starts at s x accumulation, whatever the split
    resumed = RandomWindowSampler(5000, 2, 11, Position(start=2 * 4, accumulation=4))
    assert [b for _, b in zip(range(4), resumed)] == _step_rows(2, 2, 2)[2]


def test_validation_batches_are_the_same_rows_for_any_split(tmp_path: Path, text_file: Path):
    val = TokenWindows(open_tokens(str(text_file), val_fraction=0.1, cache_dir=str(tmp_path)).val, 16)
    one = fixed_batches(val, 8, 3, seed=5)
    split = [
        fixed_batches(val, 4, 3, seed=5, at=Position(rank=r, world=2, accumulation=a))
        for r, a in [(0, 1), (1, 1)]
    ]
    accumulated = fixed_batches(val, 4, 3, seed=5, at=Position(accumulation=2))
    assert len(one) == 3 and len(accumulated) == 6 and all(len(b) == 3 for b in split)
    rows = sorted(map(tuple, torch.cat([x for x, _ in one]).tolist()))
    assert sorted(map(tuple, torch.cat([x for x, _ in accumulated]).tolist())) == rows
    assert sorted(map(tuple, torch.cat([x for b in split for x, _ in b]).tolist())) == rows


def test_batch_larger_than_data_is_rejected(tmp_path: Path):
    path = tmp_path / "small.bin"
    np.arange(40, dtype=np.uint16).tofile(path)
    src = open_tokens(str(path), val_fraction=0.0)
    ds = TokenWindows(src.train, 16)
    with pytest.raises(TurbotrainError, match="batch.micro"):
        build_loader(ds, 64, 0, resolve_loader_settings(CPU, 0, True, 2))
    with pytest.raises(TurbotrainError, match="block_size"):
        TokenWindows(src.train, 64)


def test_loader_defaults_follow_device_and_cores():
    assert default_num_workers(torch.device("cuda"), cores=16) == 8
    assert default_num_workers(torch.device("cuda"), cores=2) == 1
    assert default_num_workers(CPU, cores=2) == 0
    assert resolve_loader_settings(CPU, -1, True, 4).pin_memory is False  # pinning helps only CUDA copies
    assert resolve_loader_settings(torch.device("cuda"), 3, True, 4).pin_memory is True


def test_worker_processes_yield_the_same_batches(tmp_path: Path, text_file: Path):
    src = open_tokens(str(text_file), val_fraction=0.1, cache_dir=str(tmp_path))
    ds = TokenWindows(src.train, 16)
    inproc = build_loader(ds, 4, 1, resolve_loader_settings(CPU, 0, False, 2))
    workers = build_loader(ds, 4, 1, resolve_loader_settings(CPU, 2, False, 2))
    for (a, _), (b, _), _ in zip(inproc, workers, range(3)):
        assert torch.equal(a, b)


def test_prefetcher_passes_batches_through_on_cpu():
    batches = [(torch.ones(2), torch.zeros(2)) for _ in range(3)]
    out = list(DevicePrefetcher(batches, CPU))
    assert len(out) == 3 and out[0][0].device == CPU


def test_starting_the_loader_leaves_the_global_rng_alone(tmp_path: Path, text_file: Path):
    # A resumed run restores the global RNG and then starts iterating: drawing from it there
    # would shift every later dropout draw against an uninterrupted run.
    windows = TokenWindows(open_tokens(str(text_file), val_fraction=0.1, cache_dir=str(tmp_path)).train, 16)
    loader = build_loader(
        windows, 4, seed=3, settings=resolve_loader_settings(torch.device("cpu"), 0, False, 2)
    )
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    next(iter(loader))
    assert torch.equal(torch.rand(3), expected)


def test_vocab_check_scans_bounded_prefix_and_trusts_bytes(tmp_path: Path, monkeypatch):
    from turbotrain.parts.data import check_vocab, sources

    path = tmp_path / "toks.bin"
    tokens = np.zeros(1000, dtype=np.uint16)
    tokens[900] = 700  # beyond the scanned prefix once the bound is small
    tokens.tofile(path)
    src = open_tokens(str(path), val_fraction=0.0)
    assert src.train.max_token() == 700 and src.train.max_token(limit=800) == 0
    with pytest.raises(TurbotrainError, match="--model.vocab_size=701"):
        check_vocab(src, 512)
    monkeypatch.setattr(sources, "FULL_SCAN_TOKENS", 800)
    check_vocab(src, 512)  # start-up stays bounded on huge files: only the prefix is read


# ----------------------------------------------------------------------------- issue 12: hostile data


@contextlib.contextmanager
def _unreadable(path: Path, monkeypatch: pytest.MonkeyPatch):
    """``path`` cannot be opened: chmod 000, or where that does not bind (root) every open of it
    fails with EACCES as it would."""
    if os.geteuid() != 0:
        path.chmod(0)
        try:
            yield
        finally:
            path.chmod(0o644)
        return
    real_open = builtins.open

    def deny(file, *args, **kwargs):
        if os.fspath(file) == str(path):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(file, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(builtins, "open", deny)
        m.setattr(io, "open", deny)  # what pathlib opens with
        yield


def test_an_unreadable_file_in_a_data_folder_is_named_and_never_cached(tmp_path: Path, monkeypatch):
    """Defect 7: unreadable files were dropped silently, and the cache (keyed on paths, sizes and
    times) kept the loss after the permissions were fixed."""
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("alpha " * 100)
    secret = folder / "b.txt"
    secret.write_text("BRAVO " * 100)
    cache = tmp_path / "cache"
    with _unreadable(secret, monkeypatch):
        with pytest.raises(TurbotrainError, match=r"cannot read .*b\.txt .*Permission denied.*permissions"):
            open_tokens(str(folder), val_fraction=0.0, cache_dir=str(cache))
    src = open_tokens(str(folder), val_fraction=0.0, cache_dir=str(cache))  # fixed: everything is read
    assert b"BRAVO" in bytes(src.train.array().astype(np.uint8))


def test_a_cache_entry_that_does_not_match_its_sources_is_rebuilt(tmp_path: Path, text_file: Path):
    cache = tmp_path / "cache"
    a = open_tokens(str(text_file), val_fraction=0.0, cache_dir=str(cache))
    whole = a.train.path.read_bytes()
    a.train.path.write_bytes(whole[: len(whole) // 2])  # a cache cut short (a copy, a crash of another tool)
    b = open_tokens(str(text_file), val_fraction=0.0, cache_dir=str(cache))
    assert b.train.path.read_bytes() == whole


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 1])
def test_a_token_file_truncated_while_training_is_an_error_not_a_bus_error(tmp_path: Path, workers: int):
    """Defect 8: the memory map turned a data file truncated mid-run into a bus error that
    killed the process without a word. Reads now notice the short file and say so, in one line
    also from a DataLoader worker."""
    path = tmp_path / "toks.bin"
    np.arange(20_000, dtype=np.uint16).tofile(path)
    windows = TokenWindows(open_tokens(str(path), val_fraction=0.0).train, 16)
    loader = iter(build_loader(windows, 8, seed=0, settings=resolve_loader_settings(CPU, workers, False, 2)))
    next(loader)
    with open(path, "r+b") as f:
        f.truncate(1000)
    with pytest.raises(TurbotrainError) as caught:
        for _ in range(20):
            next(loader)
    message = str(caught.value)
    assert "toks.bin shrank to 1,000 bytes while in use" in message and "--resume" in message
    assert len(message.splitlines()) == 1, message


def test_token_datasets_travel_to_a_worker_without_their_open_file_and_name_a_missing_one(tmp_path: Path):
    path = tmp_path / "toks.bin"
    np.arange(1, 2_001, dtype=np.uint16).tofile(path)
    split = open_tokens(str(path), val_fraction=0.0).train
    windows = TokenWindows(split, 16)
    pieces = PieceRows(Documents(split, np.array([0, 100]), np.array([100, 50])), 16)
    for data in (windows, pieces):
        first = data.__getitems__([0, 1])
        copy = pickle.loads(pickle.dumps(data))  # what a spawned DataLoader worker gets: opens its own file
        assert all(torch.equal(a, b) for a, b in zip(copy.__getitems__([0, 1]), first))
    path.unlink()
    for data in (TokenWindows(split, 16), pickle.loads(pickle.dumps(pieces))):
        with pytest.raises(TurbotrainError, match=r"cannot read .*toks\.bin .*--resume"):
            data.__getitems__([0])


@pytest.mark.parametrize(
    "meta",
    [
        '{"vocab_size": -5}',
        '{"vocab_size": 0}',
        '{"vocab_size": 1.5}',
        '{"vocab_size": true}',
        '{"vocab_size": 99999999}',
        b"\xff\xfe{",
    ],
)
def test_a_bad_vocab_size_in_meta_json_is_refused(tmp_path: Path, meta):
    path = tmp_path / "toks.bin"
    np.arange(100, dtype=np.uint16).tofile(path)
    (tmp_path / "meta.json").write_bytes(meta if isinstance(meta, bytes) else meta.encode())
    with pytest.raises(TurbotrainError, match="whole-number 'vocab_size' from 1 to 65536"):
        open_tokens(str(path), val_fraction=0.1)


def test_an_llmc_header_with_a_negative_token_count_is_refused(tmp_path: Path):
    header = np.zeros(256, dtype=np.int32)
    header[:3] = (LLMC_MAGIC, 1, -7)
    path = tmp_path / "train.bin"
    path.write_bytes(header.tobytes() + np.arange(50, dtype=np.uint16).tobytes())
    with pytest.raises(TurbotrainError, match="llm.c header says -7 tokens"):
        open_tokens(str(path), val_fraction=0.1)


def test_each_micro_batch_of_a_step_gets_its_own_worker_seed_on_every_rank():
    """A DataLoader worker seeds its augmentation from the micro-batch's slot in the step: two
    ranks (or two accumulation micro-steps) never draw the same crops for different samples, and
    a resumed stream (start at step 2) gives the same seeds as the unstopped one."""

    def seeds(rank: int, start: int = 0) -> list[int]:
        sampler = EpochSampler(64, 4, 7, True, Position(start=start, rank=rank, world=2, accumulation=2))
        return [batch.seed for batch in islice(iter(sampler), 6)]  # 3 steps of 2 micro-batches

    rank0, rank1 = seeds(0), seeds(1)
    per_step = [set(rank0[2 * s : 2 * s + 2]) | set(rank1[2 * s : 2 * s + 2]) for s in range(3)]
    assert all(len(slots) == 4 for slots in per_step), (rank0, rank1)
    assert seeds(1, start=4) == rank1[4:] + seeds(1, start=6)[:4]
