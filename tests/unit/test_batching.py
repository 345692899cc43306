"""Dynamic batching (data.batching = 'tokens'): one document per row, batches within the token
budget (padding counted), no target taken across a document boundary, every token of every
document seen in an epoch, batch k a function of (seed, k), and the GPT loss skipping padding."""

from __future__ import annotations

import string
from pathlib import Path

import numpy as np
import pytest
import torch

from turbotrain import load_config
from turbotrain.app.resume import check_epochs_batch
from turbotrain.base.errors import ConfigError, TurbotrainError
from turbotrain.parts.data import Position, open_tokens, resolve_loader_settings
from turbotrain.parts.data.batching import (
    IGNORE_INDEX,
    PieceRows,
    TokenBudgetSampler,
    build_budget_loader,
    plan_epoch,
    resume_start,
)
from turbotrain.parts.data.documents import GPT2_END_OF_TEXT, open_documents, separator_ends
from turbotrain.parts.models.gpt import GPT, GPTConfig

SEQ = 16
LETTERS = string.ascii_letters  # document i is made of letter i only


@pytest.fixture
def folder(tmp_path: Path) -> tuple[Path, dict[int, int]]:
    """A folder of 40 text files of 2 to 90 bytes (some longer than a row), each of one letter."""
    rng = np.random.default_rng(0)
    root = tmp_path / "docs"
    root.mkdir()
    sizes = {}
    for i in range(40):
        n = int(rng.integers(2, 91))
        (root / f"{i:02d}.txt").write_text(LETTERS[i] * n)
        sizes[ord(LETTERS[i])] = n
    return root, sizes


def _rows(folder: Path, tmp_path: Path) -> PieceRows:
    source = open_tokens(str(folder), val_fraction=0.0, cache_dir=str(tmp_path / "cache"))
    train, val = open_documents(str(folder), source)
    assert len(train) == 40 and len(val) == 0  # one document per file
    return PieceRows(train, SEQ)


@pytest.mark.parametrize("max_tokens", [SEQ, 40, 64])
def test_batches_keep_the_budget_and_documents_apart_and_see_every_token(folder, tmp_path, max_tokens):
    root, sizes = folder
    rows = _rows(root, tmp_path)
    targets: dict[int, int] = {}
    batches = plan_epoch(rows.pieces.inputs, max_tokens, SEQ, seed=3, epoch=0)
    assert sorted(np.concatenate(batches).tolist()) == list(range(len(rows)))  # every piece once
    for idx in batches:
        x, y = rows.__getitems__(idx.tolist())
        assert x.numel() <= max_tokens  # padding counted
        for xr, yr in zip(x, y):
            real = yr != IGNORE_INDEX
            n = int(real.sum())
            assert bool(real[:n].all()) and not bool(real[n:].any())  # padding only at the end
            letters = set(xr[:n].tolist()) | set(yr[:n].tolist())
            assert len(letters) == 1, letters  # no input or target from another document (nor the separator)
            letter = letters.pop()
            targets[letter] = targets.get(letter, 0) + n
    # every token after a document's first is a target exactly once: the whole document is seen
    assert targets == {letter: n - 1 for letter, n in sizes.items()}


def test_bucketing_keeps_padding_low(folder, tmp_path):
    rows = _rows(folder[0], tmp_path)
    real = padded = 0
    for idx in plan_epoch(rows.pieces.inputs, 64, SEQ, seed=0, epoch=0):
        x, y = rows.__getitems__(idx.tolist())
        real, padded = real + int((y != IGNORE_INDEX).sum()), padded + y.numel()
    assert 1 - real / padded < 0.25


def test_batch_k_depends_on_seed_and_k_only_so_a_resume_is_exact(folder, tmp_path):
    rows = _rows(folder[0], tmp_path)
    inputs = rows.pieces.inputs
    per_epoch = len(plan_epoch(inputs, 40, SEQ, seed=5, epoch=0))
    straight = TokenBudgetSampler(inputs, 40, SEQ, seed=5)
    stream = [straight.batch(k) for k in range(2 * per_epoch + 3)]  # across two epoch boundaries
    start = per_epoch - 2
    resumed = iter(TokenBudgetSampler(inputs, 40, SEQ, seed=5, at=Position(start=start)))
    assert [next(resumed) for _ in range(len(stream) - start)] == stream[start:]
    assert stream[:per_epoch] != stream[per_epoch : 2 * per_epoch]  # each epoch is shuffled anew
    settings = resolve_loader_settings(torch.device("cpu"), 0, False, 2)
    a, b = (
        iter(build_budget_loader(rows, 40, 5, settings)),
        iter(build_budget_loader(rows, 40, 5, settings, at=Position(start=3))),
    )
    for _ in range(3):
        next(a)
    for _ in range(4):
        (xa, ya), (xb, yb) = next(a), next(b)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    ranks = [TokenBudgetSampler(inputs, 40, SEQ, seed=5, at=Position(rank=r, world=2)) for r in (0, 1)]
    assert [ranks[k % 2].batch(k // 2) for k in range(6)] == stream[:6]  # ranks share one stream


def test_gpt_loss_skips_padded_targets():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, n_layer=1, n_head=2, d_model=16, block_size=8))
    x = torch.randint(0, 32, (2, 8))
    y = torch.randint(0, 32, (2, 8))
    y[1, 5:] = IGNORE_INDEX  # row 1 holds 5 real targets
    loss = model(x, y)
    logits = model(x).float()
    ce = torch.nn.functional.cross_entropy
    per_token = torch.cat(
        [ce(logits[0], y[0], reduction="none"), ce(logits[1, :5], y[1, :5], reduction="none")]
    )
    assert torch.allclose(loss, per_token.mean(), atol=1e-6)


def test_gpt2_style_bin_files_split_at_end_of_text(tmp_path):
    docs = [[GPT2_END_OF_TEXT, 1, 2, 3], [GPT2_END_OF_TEXT, 4, 5], [GPT2_END_OF_TEXT, 6, 7, 8, 9]]
    path = tmp_path / "tokens.bin"
    np.array([t for d in docs for t in d], dtype=np.uint16).tofile(path)
    source = open_tokens(str(path), val_fraction=0.0, cache_dir=str(tmp_path / "cache"))
    train, _ = open_documents(str(path), source)
    tokens = source.train.array()
    got = [tokens[s : s + n].tolist() for s, n in zip(train.starts, train.lengths)]
    # each document keeps the end-of-text after it as its last target (the first one stands alone)
    assert got == [[GPT2_END_OF_TEXT], [1, 2, 3, GPT2_END_OF_TEXT], [4, 5, GPT2_END_OF_TEXT], [6, 7, 8, 9]]


def test_data_without_document_boundaries_is_refused_in_one_line(tmp_path):
    path = tmp_path / "tokens.bin"
    np.arange(100, dtype=np.uint16).tofile(path)
    (tmp_path / "meta.json").write_text('{"vocab_size": 128}')
    source = open_tokens(str(path), val_fraction=0.1, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(TurbotrainError, match="no document boundaries.*data.batching=windows"):
        open_documents(str(path), source)


def test_a_gpt2_bin_without_any_end_of_text_is_refused_not_read_as_one_document(tmp_path):
    path = tmp_path / "tokens.bin"
    np.arange(1, 101, dtype=np.uint16).tofile(path)  # no 50256 anywhere
    (tmp_path / "meta.json").write_text('{"vocab_size": 50304}')
    source = open_tokens(str(path), val_fraction=0.1, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(
        TurbotrainError, match=f"no document boundaries.*{GPT2_END_OF_TEXT}.*data.batching=windows"
    ) as err:
        open_documents(str(path), source)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("chunk", [1, 3, 7, 1 << 24])
def test_separator_scan_in_chunks_finds_every_separator(tmp_path, chunk):
    tokens = np.random.default_rng(0).integers(0, 4, 50).astype(np.uint16)  # separator 3, also at chunk edges
    path = tmp_path / "tokens.bin"
    tokens.tofile(path)
    source = open_tokens(str(path), val_fraction=0.2, cache_dir=str(tmp_path / "cache"))
    for split in (source.train, source.val):
        want = np.flatnonzero(split.array() == 3) + 1
        assert separator_ends(split, 3, chunk=chunk).tolist() == want.tolist()


def test_a_resume_at_another_world_size_keeps_the_batches_per_step_or_is_refused():
    # rank r reads stream batches k * world + r: after 10 batches per rank, 2 ranks have trained
    # stream batches 0..19; with accumulation a, step s is stream batches s*a*world ... (s+1)*a*world - 1
    two = [TokenBudgetSampler(np.full(400, 7), 16, SEQ, seed=0, at=Position(rank=r, world=2)) for r in (0, 1)]
    one = TokenBudgetSampler(np.full(400, 7), 16, SEQ, seed=0)
    assert [one.batch(k) for k in range(20)] == [two[k % 2].batch(k // 2) for k in range(20)]
    # 2 processes, accumulation 1, 10 steps -> one process with accumulation 2 starts at its batch 20
    assert resume_start(10, 10, saved_world=2, world=1, accumulation=2) == 20
    assert one.batch(20) == two[0].batch(10)
    assert resume_start(20, 10, saved_world=1, world=2, accumulation=1) == 10
    with pytest.raises(
        TurbotrainError,
        match=r"took 2 \(2 processes x accumulation 1\) and this run takes 1 "
        r"\(1 process x accumulation 1\); resume with --batch.accumulation=2",
    ) as err:
        resume_start(10, 10, saved_world=2, world=1, accumulation=1)
    assert "\n" not in str(err.value)
    with pytest.raises(TurbotrainError, match="resume with 1 process \\(no torchrun\\)"):
        resume_start(10, 10, saved_world=1, world=2, accumulation=1)  # 1 batch per step cannot split over 2
    assert resume_start(10, 5, saved_world=2, world=2, accumulation=1) == 10  # the same world size: as saved
    assert resume_start(0, 0, saved_world=2, world=1, accumulation=1) == 0  # nothing read yet


def test_token_batching_mistakes_are_one_line_config_errors():
    with pytest.raises(ConfigError, match="max_tokens"):
        load_config(
            overrides={
                "data": {"batching": "tokens"},
                "batch": {"max_tokens": 64},
                "model": {"block_size": 128},
            }
        )
    with pytest.raises(ConfigError, match="max_tokens"):
        load_config(overrides={"data": {"batching": "tokens"}, "batch": {"micro": "auto"}})
    with pytest.raises(ConfigError, match="model.loss"):
        load_config(overrides={"data": {"batching": "tokens"}, "model": {"loss": "chunked"}})
    with pytest.raises(ConfigError, match="windows, tokens"):
        load_config(overrides={"data": {"batching": "rows"}})


def test_an_epochs_run_resumed_at_another_global_batch_is_refused_whatever_the_accumulation():
    """An epochs run's place is a step count at its global batch (micro x accumulation x
    processes): a resume that changes it through the accumulation is refused as one through the
    micro-batch is, with the same world size; any split of the same global batch resumes."""
    saved = "[batch]\nmicro = 4\naccumulation = 2\n"  # trained at 8

    def resume(micro: int, accumulation: int, world: int = 1) -> None:
        c = load_config(
            overrides={"batch": {"micro": micro, "accumulation": accumulation}, "train": {"epochs": 2}}
        )
        check_epochs_batch("step_00000004", saved, 1, c, world)

    for micro, accumulation in ((4, 4), (4, 1), (8, 2)):
        with pytest.raises(
            TurbotrainError, match=r"^train.epochs: step_00000004 was trained at a global batch of 8 "
        ) as err:
            resume(micro, accumulation)
        assert f"this resume at {micro * accumulation} (1 process x {micro} x {accumulation})" in str(
            err.value
        )
    for micro, accumulation, world in ((4, 2, 1), (8, 1, 1), (2, 4, 1), (2, 2, 2)):
        resume(micro, accumulation, world)  # the same global batch
