"""Docs that cannot rot (issue 32 item 5): every shell command and every Python snippet in README.md
and docs/*.md, as written, in the order written, in one scratch directory per page (so a
``--resume`` continues the run the command above it trained).

Each command is one test case, in one of three kinds:

- ``run``: executed. ``turbotrain ...`` goes through the CLI's ``main`` in this process (the same
  code as the console script, without a ~3 s interpreter start per command); its exit status must
  be 0 and no traceback may appear. ``python -c`` runs its code.
- ``check`` (listed in CHECKED, with why it is not run): the command line is parsed by the CLI's
  own parser and, for ``train``, its config resolved and validated, so an unknown flag, field or
  value still fails. Used for commands that take minutes here and for commands that differ from a
  run one only in their arguments (sampled).
- ``skip`` (listed in SKIPPED, with the reason): reported as a skipped case (``pytest -rs``
  lists them with their reasons).

A command in none of the tables runs. A table entry that matches no command fails (so the tables
follow the docs).

The one switch: ``TT_DOCS_STEPS`` (default 2) shortens what runs: a ``turbotrain train`` gets
``--train.max_steps=N`` (an explicit larger value is lowered to N; an epochs run gets
``--train.stop_after_steps=N``; a ``--resume`` continues to 2N) and ``--train.eval_batches=1``
unless it sets it (20 validation batches of gpt-tiny cost more than its 2 steps). ``TT_DOCS_STEPS=0``
runs every command at its written length (minutes). Nothing else is rewritten.
"""

from __future__ import annotations

import os
import re
import shlex
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from turbotrain.app.prepare import default_preset
from turbotrain.base.config import load_config, parse_overrides
from turbotrain.base.errors import ConfigError
from turbotrain.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
STEPS = int(os.environ.get("TT_DOCS_STEPS", "2"))

# Command prefix -> why it is not run here.
SKIPPED = {
    "python3 -m venv .venv": "creates the environment: .ci/run installs exactly as the README says",
    ". .venv/bin/activate": "the suite already runs inside the environment",
    "pip install": "installs packages (no network here): .ci/run runs the README's install",
    "python -m pytest -q": "the test suite itself",
    "mkdocs serve": "serves the site until stopped; .ci/run builds it (mkdocs build --strict) and tests/unit/test_docs_reference.py checks its generated pages",
    "PORT=": "a shell variable for the two-node torchrun commands below it",
    "torchrun --standalone --nproc-per-node 2 tests/distributed/dp_worker.py": "tests/distributed/test_data_parallel.py "
    "launches this worker",
    "turbotrain train --resume runs/shard": "needs the torchrun fsdp run above it",
    "ls runs/shard/checkpoints": "needs the torchrun fsdp run above it",
    "turbotrain sample runs/shard": "needs the torchrun fsdp run above it",
    "turbotrain train --resume runs/my-run": "runs/my-run stands for a run of the user's",
    "turbotrain train --data.tokenizer=bpe": "trains a BPE tokenizer on the 31 MB corpus first (about a minute on "
    "2 cores); tests/unit/test_tokenizer.py trains one on a small text",
    "turbotrain sample bpe-demo": "needs bpe-demo, the BPE run above it",
    "turbotrain train --preset gpt2-small": "a 124M GPT-2 meant for a GPU (seconds a step on a CPU)",
    "turbotrain train --data my_texts/ --data.tokenizer=gpt2/tokenizer.json": "needs a Hugging Face tokenizer file of the user's",
    "turbotrain profile": "a profiler window and --verify's measured runs take minutes; tests/integration/test_profile.py",
    "turbotrain tune": "Optuna trials take minutes; tests/integration/test_tune.py",
    "turbotrain train --preset fastest.toml": "needs fastest.toml, written by the tune above it",
    "turbotrain bench": "contenders in separate processes; tests/integration/test_bench_compare.py",
    "python benchmarks/checkpoint_stall.py": "a benchmark (timed rounds of checkpoint writes)",
    "python benchmarks/distributed_overhead.py": "a benchmark of torchrun launches (minutes)",
    "python examples/hf_trainer.py": "tests/integration/test_integrations.py runs it (5 steps)",
    "python examples/lightning_module.py": "tests/integration/test_integrations.py runs it (5 steps)",
    "python examples/accelerate_loop.py": "tests/integration/test_integrations.py runs it (5 steps)",
    "python benchmarks/integration_overhead.py": "a benchmark (interleaved Trainer runs, minutes)",
    "python examples/bert_classifier.py": "tests/integration/test_integrations_encoder.py trains its model and "
    "data with the Trainer and in an Accelerate loop (6 steps each)",
    "turbotrain train --resume s3://": "needs the S3 store of the run above it; tests/integration/test_remote_store.py "
    "resumes from a moto server",
    "python examples/ray_train.py": "starts a Ray cluster and its workers (minutes on 2 shared cores); "
    "tests/distributed/test_ray_train.py trains under TorchTrainer on a local Ray cluster",
}

# Command prefix -> why it is parsed and its config validated, not run.
CHECKED = {
    "torchrun": "several processes; the turbotrain part is checked, the launches themselves are tests/distributed's "
    "(test_torchrun_train.py: ddp, fsdp, two nodes, --max-restarts, expert parallelism)",
    "turbotrain train --preset gpt-tiny --train.max_steps 300 --precision.mode=fp32": "sampled: `turbotrain train` runs",
    "turbotrain train --data my_tokens.bin": "a token file of the user's; tests/unit/test_data.py reads .bin files",
    "turbotrain train --model examples/hf_causal_lm.py:make": "imports transformers and builds a GPT-2 (tens of seconds); "
    "tests/integration/test_train_model.py",
    "turbotrain memory --model examples/hf_causal_lm.py:make": "imports transformers and measures each checkpointing mode",
    "turbotrain train --model examples/bert_classifier.py:make": "imports transformers and builds a BERT; "
    "tests/integration/test_integrations_encoder.py trains it (slow: three runs)",
    "turbotrain train --compile.scope=model": "torch.compile takes 40-125 s on this CPU",
    "turbotrain train --preset gpt-tiny --choose.measure=always": "measures torch.compile (30-90 s on this CPU); "
    "tests/integration/test_choose_train.py measures the eager candidates",
    "turbotrain train --train.max_steps 20 --memory.max_fraction": "sampled: the --monitor.log_every one runs",
    "turbotrain train --train.max_steps 20 --run.deterministic": "sampled: the --monitor.log_every one runs",
    "turbotrain train --optim.schedule=plateau": "sampled; tests/integration/test_lr_adaptive_train.py trains it",
    "turbotrain train --batch.micro=auto": "the batch-size search takes minutes on a CPU",
    "turbotrain train --preset gpt-tiny --train.max_steps 20 --monitor.mlflow=true": "trackio writes to $TRACKIO_DIR "
    "(the user's cache here); tests/integration/test_trackers.py trains with all three trackers and reads them back",
    "turbotrain train --preset gpt-tiny --train.max_steps 20 --monitor.wandb=true": "W&B's offline service starts "
    "(~10 s here); tests/integration/test_trackers.py trains with all three trackers and reads them back",
    "turbotrain train --preset moe-tiny": "two steps of moe-tiny take 10-30 s on 2 cores; the MoE classifier "
    "example below runs, tests/distributed/test_torchrun_train.py trains moe-tiny",
    "turbotrain train --data.batching=tokens --batch.max_tokens=4096": "token batching indexes the corpus's 1,790 "
    "documents; tests/integration/test_token_batching_train.py",
    "turbotrain train --data path/to/folder --data.batching=tokens": "a folder of the user's; "
    "tests/integration/test_token_batching_train.py",
    "turbotrain train --preset gpt-tiny --nproc 2": "starts processes through torchrun's launcher; "
    "tests/distributed/test_torchrun_train.py runs --nproc 2",
    "turbotrain train --preset gpt-tiny --run.name=gpt --run.remote=s3://": "needs an S3 store; "
    "tests/integration/test_remote_store.py trains against a moto server",
}

# Python snippets: (page, first line) -> (code run before it, code run after it). A snippet that is
# a fragment of a loop gets the objects it names; None = skipped, with the reason.
PYTHON: dict[tuple[str, str], tuple[str, str] | str] = {
    ("own-model.md", "def make() -> Workload:"): (
        "exec(Path('examples/workload_cnn.py').read_text())",
        "batch = next(iter(make().train_loader))",
    ),
    ("own-loop.md", "from turbotrain import Engine"): (
        "import torch\n"
        "class Regressor(torch.nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.lin = torch.nn.Linear(8, 1)\n"
        "    def forward(self, x, y):\n        return torch.nn.functional.mse_loss(self.lin(x), y)\n"
        "model = Regressor()\noptimizer = torch.optim.AdamW(model.parameters())\n"
        "loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randn(32, 1)), batch_size=4)",
        "assert engine.state.step == 2",
    ),
    ("own-loop.md", "from turbotrain import track"): (
        "import torch\nfrom turbotrain import Engine\nengine = Engine()\n"
        "model = torch.nn.Linear(8, 2)\nmodel, optimizer, _ = engine.setup(model, torch.optim.AdamW(model.parameters()))\n"
        "batch = torch.randn(4, 8)",
        "assert Path('runs/mine/summary.json').is_file()",
    ),
    ("moe.md", "from turbotrain import MoE"): (
        "import torch\nfrom torch import nn",
        "assert Net()(torch.randn(4, 784)).shape == (4, 10)",
    ),
    ("integrations.md", "from accelerate import Accelerator"): (
        "import torch\nfrom torch.utils.data import DataLoader\n"
        "from transformers import GPT2Config, GPT2LMHeadModel\n"
        "dataset = [{'input_ids': r, 'labels': r} for r in torch.randint(0, 64, (32, 16))]\n"
        "model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2))",
        "assert run.steps == 2 and Path('runs/acc/summary.json').is_file()",
    ),
    ("early-stopping.md", "from turbotrain.plugins import Checkpointer"): (
        "import torch\nfrom turbotrain import Engine, fit\ntorch.manual_seed(0)\n"
        "class Regressor(torch.nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.lin = torch.nn.Linear(8, 1)\n"
        "    def forward(self, x, y):\n        return torch.nn.functional.mse_loss(self.lin(x), y)\n"
        "engine = Engine()\nplain = Regressor()\n"
        "model, optimizer, _ = engine.setup(plain, torch.optim.SGD(plain.parameters(), lr=0.1))\n"
        "loader = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(400)]\n"
        "val_batches = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(4)]\nrun_dir = Path('runs/best-demo')",
        "from turbotrain.loop.best_checkpoint import load_best_weights\n"
        "model.load_state_dict(load_best_weights(run_dir)[1])\nprint(ctx.stop_reason)",
    ),
    (
        "cluster.md",
        "from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig",
    ): "starts "
    "Ray workers and names an S3 bucket; tests/distributed/test_ray_train.py runs TorchTrainer with train_loop",
    (
        "precision.md",
        "# src/turbotrain/core/precision/fp16_unscaled.py",
    ): "run as the module it says it is by tests/unit/test_precision_fp8.py (test_the_docs_plugin_example...)",
    (
        "precision.md",
        "def test_fp16_unscaled():",
    ): "run by tests/unit/test_precision_fp8.py with the block above",
    **{
        ("plugins.md", f"# {name}"): "a file of the page's plugin: tests/unit/test_plugins_docs.py writes it "
        "where it says and runs the page's commands in a process of their own (registering a plugin here "
        "would change every later config of this process)"
        for name in (
            "fp16_static.py",
            "use_fp16_static.py",
            "regression/settings.py",
            "regression/spec.py",
            "regression/__init__.py",
        )
    },
}

LINKED = ("examples", "benchmarks", "tests", "src")  # the repository's folders a command names


@dataclass(frozen=True)
class Snippet:
    page: str
    line: int
    lang: str
    text: str


def snippets(path: Path) -> list[Snippet]:
    """The fenced code blocks of a page, also those indented inside a list item."""
    text = path.read_text()
    found = []
    for m in re.finditer(r"^( *)```(\w*)\n(.*?)^\1```", text, re.M | re.S):
        body = textwrap.dedent("\n".join(line[len(m[1]) :] for line in m[3].splitlines()))
        found.append(Snippet(path.name, text[: m.start()].count("\n") + 1, m[2], body))
    return found


def commands(snippet: Snippet) -> list[tuple[str, list[str]]]:
    """(the command as written, its words) for each command of a bash block: continuation lines
    joined, quotes spanning lines kept, comments dropped, ``a && b`` split in two."""
    out, pending = [], ""
    for line in snippet.text.replace("\\\n", " ").splitlines():
        pending = f"{pending}\n{line}" if pending else line
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # a quoted argument goes on over the next line (python -c "...")
            continue
        pending = ""
        while words:
            cut = words.index("&&") if "&&" in words else len(words)
            if words[:cut]:
                out.append((shlex.join(words[:cut]), words[:cut]))
            words = words[cut + 1 :]
    assert not pending, f"{snippet.page}:{snippet.line}: a quote is never closed in {pending!r}"
    return out


def table_entry(command: str, table: dict[str, str]) -> str | None:
    return next((k for k in table if command.startswith(k)), None)


def all_commands() -> list[tuple[Snippet, str, list[str]]]:
    return [
        (s, c, w)
        for page in PAGES
        for s in snippets(page)
        if s.lang in ("bash", "sh", "shell")
        for c, w in commands(s)
    ]


def all_python() -> list[Snippet]:
    return [s for page in PAGES for s in snippets(page) if s.lang in ("python", "py")]


def shortened(words: list[str]) -> list[str]:
    """The one switch (TT_DOCS_STEPS): a ``turbotrain train`` shortened to N optimizer steps and
    one validation batch."""
    if STEPS <= 0 or words[:2] != ["turbotrain", "train"]:
        return words
    args = words[2:]
    if not any(a.startswith("--train.eval_batches") for a in args):
        words = [*words, "--train.eval_batches=1"]
    if any(a == "--train.epochs" or a.startswith("--train.epochs=") for a in args):
        return [*words, f"--train.stop_after_steps={STEPS}"]
    args = words[2:]
    target = 2 * STEPS if "--resume" in args else STEPS
    out, i = [], 0
    while i < len(args):  # an explicit max_steps is lowered, never raised
        a = args[i]
        if a == "--train.max_steps" and i + 1 < len(args):
            target, i = min(target, int(args[i + 1])), i + 2
        elif a.startswith("--train.max_steps="):
            target, i = min(target, int(a.split("=", 1)[1])), i + 1
        else:
            out.append(a)
            i += 1
    return [*words[:2], *out, f"--train.max_steps={target}"]


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """One working directory per page, holding links to the repository's folders; the token caches
    the commands write go to a scratch $XDG_CACHE_HOME, not the user's."""
    dirs = {}
    for page in PAGES:
        d = tmp_path_factory.mktemp(page.stem)
        for name in LINKED:
            (d / name).symlink_to(ROOT / name)
        dirs[page.name] = d
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        yield dirs


CASES = all_commands()


def kind(command: str) -> str:
    return "skip" if table_entry(command, SKIPPED) else "check" if table_entry(command, CHECKED) else "run"


@pytest.mark.parametrize(
    "snippet, command, words",
    CASES,  # ids: run|check|skip:page:line:the first two words
    ids=[f"{kind(c)}:{s.page}:{s.line}:{w[0]}-{w[1] if len(w) > 1 else ''}" for s, c, w in CASES],
)
def test_command(snippet: Snippet, command: str, words: list[str], scratch, monkeypatch, capsys):
    skipped = table_entry(command, SKIPPED)
    if skipped:
        pytest.skip(f"{snippet.page}:{snippet.line} `{command}`: {SKIPPED[skipped]}")
    monkeypatch.chdir(scratch[snippet.page])
    checked = table_entry(command, CHECKED)
    if checked:
        check(words)
        return
    if words[0] == "turbotrain":
        code = main(shortened(words)[1:])
    elif words[:2] == ["python", "-c"]:
        exec(compile(words[2], f"{snippet.page}:{snippet.line}", "exec"), {"__name__": "__main__"})
        code = 0
    else:
        raise AssertionError(
            f"{snippet.page}:{snippet.line} `{command}`: this test does not know how to run it; "
            "list it in SKIPPED or CHECKED of tests/integration/test_docs.py with the reason"
        )
    out, err = capsys.readouterr()
    assert code == 0 and "Traceback" not in err, (
        f"{snippet.page}:{snippet.line} `{command}` exit {code}:\n{err[-3000:]}"
    )


def check(words: list[str]) -> None:
    """The command line through the CLI's own parser; a ``train`` command's config resolved (every
    field and value validated) as ``turbotrain train`` resolves a new run's. Under torchrun: the
    part after ``-m turbotrain``."""
    if words[0] == "torchrun":
        words = words[words.index("-m") + 1 :]
    assert words[0] == "turbotrain", words
    args, extra = build_parser().parse_known_args(words[1:])  # a mistake exits 2 (SystemExit fails the test)
    if words[1] != "train":
        assert not extra, f"unrecognized arguments: {extra}"
        return
    overrides = parse_overrides(extra)
    if args.data:
        overrides.setdefault("data", {})["path"] = args.data
    if args.model:
        overrides.setdefault("model", {})["workload"] = args.model
    load_config(args.preset or default_preset(), overrides)


PYTHON_CASES = all_python()


@pytest.mark.parametrize("snippet", PYTHON_CASES, ids=[f"{s.page}:{s.line}" for s in PYTHON_CASES])
def test_python_snippet(snippet: Snippet, scratch, monkeypatch):
    key = next((k for k in PYTHON if k[0] == snippet.page and snippet.text.startswith(k[1])), None)
    entry = PYTHON.get(key, ("", "")) if key else ("", "")
    if isinstance(entry, str):
        pytest.skip(f"{snippet.page}:{snippet.line}: {entry}")
    before, after = entry
    monkeypatch.chdir(scratch[snippet.page])
    namespace: dict = {"__name__": "__main__", "Path": Path}
    exec(compile(before, f"{snippet.page}:{snippet.line} (setup)", "exec"), namespace)
    exec(compile(snippet.text, f"{snippet.page}:{snippet.line}", "exec"), namespace)
    exec(compile(after, f"{snippet.page}:{snippet.line} (check)", "exec"), namespace)


def test_every_table_entry_names_a_command_or_snippet_of_the_docs():
    """The tables follow the docs: an entry for a command or snippet that is gone fails here."""
    written = [c for _, c, _ in CASES]
    stale = [k for k in [*SKIPPED, *CHECKED] if not any(c.startswith(k) for c in written)]
    stale += [
        f"{k}" for k in PYTHON if not any(s.page == k[0] and s.text.startswith(k[1]) for s in PYTHON_CASES)
    ]
    assert not stale, f"no such command or snippet in the docs any more: {stale}"
    both = [k for k in SKIPPED if k in CHECKED]
    assert not both, both


def test_the_shortening_switch_rewrites_only_the_step_count(monkeypatch):
    assert shortened(
        ["turbotrain", "train", "--model", "m.py:make", "--train.max_steps", "64", "--train.eval_every", "16"]
    ) == [
        "turbotrain",
        "train",
        "--model",
        "m.py:make",
        "--train.eval_every",
        "16",
        "--train.eval_batches=1",
        f"--train.max_steps={min(STEPS, 64)}",
    ]
    assert (
        shortened(["turbotrain", "train", "--train.epochs", "2"])[-1] == f"--train.stop_after_steps={STEPS}"
    )
    assert shortened(["turbotrain", "train", "--resume"])[-1] == f"--train.max_steps={2 * STEPS}"
    assert shortened(["turbotrain", "doctor"]) == ["turbotrain", "doctor"]


def test_a_broken_command_fails_in_both_kinds(scratch, monkeypatch, capsys):
    """The test can fail: a field that does not exist fails a checked command (the parser's or the
    config's one-line error) and a run one (exit 2)."""
    monkeypatch.chdir(scratch["README.md"])
    with pytest.raises(ConfigError, match="max_stepz"):
        check(["turbotrain", "train", "--train.max_stepz=3"])
    with pytest.raises(AssertionError, match="no-such-flag"):
        check(["turbotrain", "doctor", "--no-such-flag"])
    assert main(shortened(["turbotrain", "train", "--train.max_stepz=3"])[1:]) == 2
    assert "max_stepz" in capsys.readouterr().err


def test_ci_installs_and_tests_as_the_readme_first_screen_says():
    """.ci/run installs "exactly as the README says": the README's first block's install and test
    commands are .ci/run's (pip's -q and ``python -m`` aside), in the same order, torch first; the
    README's CPU line takes torch from PyTorch's CPU index, CI the CPU wheel on its disk."""
    first = next(s for s in snippets(ROOT / "README.md") if s.lang == "bash")
    readme = [w for _, w in commands(first) if w[0] in ("pip", "python")]

    def plain(words: list[str]) -> list[str]:
        words = words[2:] if words[:3] == ["python", "-m", "pip"] else words
        return [w for w in words if w != "-q" and not w.startswith("--upgrade")]

    ci = [
        plain(shlex.split(m[0]))
        for m in re.finditer(
            r"(?:python -m )?(?:pip install|pytest)(?! -q --upgrade)[^;\n]*",
            (ROOT / ".ci" / "run").read_text(),
        )
    ]
    assert (
        readme[0][:3] == ["pip", "install", "torch"] and "https://download.pytorch.org/whl/cpu" in readme[0]
    ), readme
    assert ci[0][:3] == ["pip", "install", "torch==2.13.0"], ci
    assert [plain(w) for w in readme[1:]] == ci[1:], (readme, ci)
