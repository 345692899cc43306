"""The GPT's spec: token data (random windows or token-budget batches), the model from the run's
``model`` section, tokens as the unit of throughput, and text generation."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, cast

from torch import nn

from ....base.config import RunConfig
from ....base.config_plugins import same_fields
from ....base.rundir import TOKENIZER_FILE
from ...data import TokenSource, TokenWindows, build_loader, check_vocab, fixed_batches, open_tokens
from ...data.batching import BudgetData, build_budget_data, resume_start
from ...data.loader import LoaderSettings, Position, PreadRows
from ...data.tokenizer import save_run_tokenizer
from ..spec import ModelSpec, RunData, SpeedHint
from .model import GPT, GPTConfig
from .settings import GPTSettings, gpt_settings, speed_choices


class TokenData(RunData):
    """A token source in ``model.block_size`` windows or in token-budget batches (``data.batching``)."""

    def __init__(self, c: RunConfig, source: TokenSource) -> None:
        self.source, self.block_size = source, gpt_settings(c).block_size
        self.train = TokenWindows(source.train, self.block_size)
        self.val = TokenWindows(source.val, self.block_size) if len(source.val) > self.block_size else None
        self.positions = self.train.positions
        self.description = source.description
        self.split_invariant = c.data.batching == "windows"
        self.facts = {}
        self._budget: BudgetData | None = None

    def loader(
        self, c: RunConfig, settings: LoaderSettings, start: int, rank: int, world: int
    ) -> Iterable[Any]:
        at = Position(start, rank, world, c.batch.accumulation)
        if c.data.batching == "tokens":  # documents kept apart, batches by token budget
            self._budget = build_budget_data(
                c.data.path,
                self.source,
                gpt_settings(c).block_size,
                c.batch.max_tokens or int(c.batch.micro) * gpt_settings(c).block_size,
                c.run.seed,
                settings,
                at=at,
                # validation: eval_batches x accumulation x world stream batches, for any split
                eval_batches=c.train.eval_batches * c.batch.accumulation,
            )
            self.facts = {"batching": self._budget.description}
            return self._budget.loader
        # step s: micro x accumulation x world rows from (seed, s); this rank its chunks of them
        return build_loader(self.train, int(c.batch.micro), c.run.seed, settings, at)

    def val_batches(self, c: RunConfig, rank: int, world: int) -> list[Any]:
        if self._budget is not None:
            return self._budget.val_batches
        if self.val is None:
            return []
        at = Position(0, rank, world, c.batch.accumulation)
        return fixed_batches(self.val, int(c.batch.micro), c.train.eval_batches, c.run.seed + 1, at)

    def example(self, c: RunConfig) -> Any:
        if self._budget is not None:
            return self._budget.example
        return fixed_batches(self.train, int(c.batch.micro), 1, seed=c.run.seed)[0]

    def steps_per_epoch(self, c: RunConfig, world: int) -> int:
        """The steps whose windows hold as many tokens as the training split."""
        tokens_per_step = int(c.batch.micro) * c.batch.accumulation * world * gpt_settings(c).block_size
        return max(1, len(self.source.train) // tokens_per_step)

    def start_after(self, saved_batches: int, step: int, c: RunConfig, saved_world: int, world: int) -> int:
        if c.data.batching == "tokens":  # the stream's position holds only with the same batches per step
            return resume_start(saved_batches, step, saved_world, world, c.batch.accumulation)
        return step * c.batch.accumulation

    def save(self, run_dir: Path) -> None:
        save_run_tokenizer(self.source.tokenizer, run_dir)  # what `turbotrain sample` decodes with

    def close(self) -> None:
        budget_rows = cast(PreadRows, self._budget.loader.dataset) if self._budget is not None else None
        for rows in (self.train, self.val, budget_rows):
            if rows is not None:
                rows.close()


def gpt_config(m: GPTSettings, vocab_size: int) -> GPTConfig:
    """The GPT a run's ``model`` section describes; ``vocab_size`` when the section leaves it 0."""
    return GPTConfig(**{**same_fields(GPTConfig, m), "vocab_size": m.vocab_size or vocab_size})


class GPTSpec(ModelSpec):
    """The decoder-only transformer on token data."""

    name = "gpt"
    unit = "tokens"
    generates = True
    memory_estimate = True

    def open_data(self, c: RunConfig, run_dir: Path, *, show: bool) -> TokenData:
        source = open_tokens(
            c.data.path,
            val_fraction=c.data.val_fraction,
            cache_dir=c.data.cache_dir,
            progress=show,
            tokenizer=c.data.tokenizer,
            vocab_size=gpt_settings(c).vocab_size,
            saved_tokenizer=run_dir / TOKENIZER_FILE,
        )
        return TokenData(c, source)

    def build_model(self, c: RunConfig, vocab_size: int) -> GPT:
        return GPT(gpt_config(gpt_settings(c), vocab_size))

    def build(self, c: RunConfig, data: RunData) -> nn.Module:
        assert isinstance(data, TokenData)
        model = self.build_model(c, data.source.vocab_size)
        check_vocab(data.source, model.cfg.vocab_size)
        return model

    def seq_len(self, c: RunConfig) -> int:
        return gpt_settings(c).block_size

    def vocab_size(self, c: RunConfig) -> int:
        return gpt_settings(c).vocab_size

    def speed_choices(self, cuda: bool) -> dict[str, tuple[str, ...]]:
        return speed_choices(cuda)

    def speed_hints(self, c: RunConfig) -> list[SpeedHint]:
        if gpt_settings(c).attention != "masked":
            return []
        return [
            SpeedHint(
                {"model": {"attention": "sdpa"}},
                "attention with an explicit mask cannot use the flash kernels",
                "SDPA is_causal dispatches to flash attention",
                1.15,
            )
        ]

    def facts(self, c: RunConfig, model: nn.Module) -> dict[str, Any]:
        assert isinstance(model, GPT)
        return {
            "attention": "sdpa is_causal" if gpt_settings(c).attention == "sdpa" else "sdpa + cached mask",
            "vocab_size": model.cfg.vocab_size,
            "params": model.num_params(non_embedding=False),
        }

    def experts(self, c: RunConfig) -> int | None:
        return 0  # dense

    def weight_count(self, c: RunConfig) -> int:
        """Embeddings of at least 256 tokens, attention and MLPs."""
        m = gpt_settings(c)
        d, vocab = m.d_model, max(m.vocab_size, 256)
        return vocab * d + m.block_size * d + m.n_layer * 12 * d * d
