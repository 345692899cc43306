"""``turbotrain sample RUN``: generate text from a run's latest checkpoint (``--best``: its best
checkpoint, kept with ``--best.checkpoint=true``), encoding the prompt and decoding the output with
the run's own tokenizer (its ``tokenizer.json``; bytes for runs without one)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import cast

import torch

from ..base.config import RunConfig
from ..base.errors import TurbotrainError
from ..base.rundir import CHECKPOINTS, CONFIG_FILE, find_run_dir, resume_config
from ..loop.best_checkpoint import load_best_weights
from ..loop.checkpoint import load_latest_weights
from ..parts.data.tokenizer import BYTE_VOCAB, ByteTokenizer, Tokenizer, load_run_tokenizer
from ..parts.models.registry import spec_for
from ..parts.models.spec import ModelSpec, TextGenerator
from .options import Options, add_command, number, switch

OPTIONS: Options = {
    "run_dir": "run directory or name under runs/ (default: latest)",
    "--prompt": {"default": "def ", "help": "text to continue (default: 'def ')"},
    "--tokens": number(400, "tokens to generate (default 400)"),
    "--temperature": {"type": float, "default": 0.8},
    "--top-k": number(40, "sample from the k most likely tokens (default 40; 0 = all)"),
    "--seed": {},
    "--best": switch("the run's best checkpoint (checkpoints/best/, by best.metric) instead of its latest"),
    "--out-dir": {},
}


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return add_command(
        subparsers, main_sample, "print text generated from a run's latest checkpoint", OPTIONS
    )


def newest_generating_run(out_dir: str) -> tuple[Path, RunConfig]:
    """The newest run under ``out_dir`` whose model generates text, with its config (a newer
    ``--model`` run is passed over, not refused)."""
    runs = sorted(
        (p for p in Path(out_dir).glob("*") if (p / CONFIG_FILE).is_file()),
        key=lambda p: (p / CONFIG_FILE).stat().st_mtime,
        reverse=True,
    )
    for run in runs:
        try:
            config = resume_config(run)
        except TurbotrainError:  # a run this version cannot read: not the one to sample
            continue
        if spec_for(config).generates:
            return run, config
    raise TurbotrainError(
        f"no run under {out_dir}/ generates text ({len(runs)} run(s) of models that do not, or none); "
        "train one with `turbotrain train` (gpt-tiny), or name a run: turbotrain sample RUN"
    )


def main_sample(args: argparse.Namespace, extra: list[str]) -> int:
    if args.tokens < 0 or args.top_k < 0 or not args.temperature > 0:
        raise TurbotrainError(
            f"--tokens ({args.tokens}) and --top-k ({args.top_k}) must be >= 0 and --temperature ({args.temperature}) > 0"
        )
    if args.run_dir:
        run_dir = find_run_dir(args.out_dir, args.run_dir)
        config = resume_config(run_dir)
    else:
        run_dir, config = newest_generating_run(args.out_dir)
        print(
            f"sampling {run_dir} (the newest run that generates text; name another: turbotrain sample RUN)",
            file=sys.stderr,
        )
    spec = spec_for(config)
    if not spec.generates:
        raise TurbotrainError(
            f"{run_dir} trained {config.model.workload or spec.name}, a {spec.name} model that does not generate "
            "text; sample reads checkpoints of language-model runs (--preset gpt-tiny, gpt2-small, moe-tiny, llama-tiny)"
        )
    model, tokenizer = _load_model(run_dir, config, spec, args.best)
    torch.manual_seed(args.seed)
    prompt = tokenizer.encode([args.prompt.encode("utf-8") or b"\n"])[0]
    if len(prompt) == 0:  # a tokenizer may encode some text to nothing
        prompt = tokenizer.separator()
    idx = torch.tensor([prompt.tolist()], dtype=torch.long)
    out = model.generate(idx, args.tokens, temperature=args.temperature, top_k=args.top_k or None)
    sys.stdout.write(tokenizer.decode(out[0].tolist()) + "\n")
    return 0


def _load_model(
    run_dir: Path, config: RunConfig, spec: ModelSpec, best: bool
) -> tuple[TextGenerator, Tokenizer]:
    """The run's model with its latest (or best) weights, in eval mode, and its tokenizer."""
    path, weights = load_best_weights(run_dir) if best else load_latest_weights(run_dir / CHECKPOINTS)
    embedding = weights.get("wte.weight") if isinstance(weights, dict) else None
    if not isinstance(embedding, torch.Tensor) or embedding.dim() != 2:
        raise TurbotrainError(
            f"{path} holds no GPT token embedding (model.wte.weight, as the GPT and Llama families name it); sample reads checkpoints of `turbotrain train` runs"
        )
    vocab = embedding.shape[0]
    tokenizer = load_run_tokenizer(run_dir)
    if tokenizer.name == ByteTokenizer.name and vocab != BYTE_VOCAB:
        raise TurbotrainError(
            f"{run_dir} was trained on {vocab}-token ids and holds no tokenizer.json to decode them "
            "(runs trained with --data.tokenizer=bpe or PATH keep one); copy the tokenizer.json "
            f"that made its data into {run_dir}/"
        )
    if tokenizer.vocab_size > vocab:
        raise TurbotrainError(
            f"{run_dir}/tokenizer.json has {tokenizer.vocab_size} tokens but the model only {vocab}"
        )
    model = spec.build_model(config, vocab)
    try:
        model.load_state_dict(weights)
    except RuntimeError as exc:
        detail = " ".join(str(exc).split())[:200]
        raise TurbotrainError(f"{path} does not fit the model in {run_dir}/config.toml ({detail})") from None
    model.eval()
    return cast(TextGenerator, model), tokenizer  # the caller checked spec.generates
