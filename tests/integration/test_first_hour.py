"""A new user's first hour at the command line (issue 32, items 9 and 10): what `turbotrain train`
prints in a process of its own, where Python's warning machinery is not pytest's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import inprocess
from conftest import HANG_S

TINY = [
    "--model.n_layer=1",
    "--model.n_head=2",
    "--model.d_model=32",
    "--model.block_size=32",
    "--batch.micro=4",
    "--train.max_steps=2",
    "--train.eval_every=2",
    "--train.eval_batches=1",
    "--monitor.progress=false",
    "--data.num_workers=0",
    "--run.device=cpu",
    "--run.name=first",
]


def _train(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "turbotrain", "train", *args], capture_output=True, text=True, timeout=HANG_S
    )


def test_a_short_bf16_run_warns_in_one_clean_line_and_its_resume_says_it_is_complete(
    tmp_path: Path, text_file: Path
) -> None:
    common = [
        *TINY,
        f"--run.out_dir={tmp_path / 'runs'}",
        f"--data.path={text_file}",
        f"--data.cache_dir={tmp_path / 'cache'}",
    ]
    done = _train(*common, "--precision.mode=bf16-mixed")
    assert done.returncode == 0, done.stderr
    warned = [line for line in done.stderr.splitlines() if "WARNING" in line or "Warning" in line]
    # no source line, no default warm-up warning
    assert warned == [
        "WARNING turbotrain: precision.mode = 'bf16-mixed' on CPU: without bf16 units this is often many "
        "times slower than fp32"
    ], done.stderr
    # the resume's line is the CLI's, not the warning machinery's: in this process
    again = inprocess.train(["--resume", str(tmp_path / "runs" / "first")])
    assert again.returncode == 0, again.stderr
    assert (
        "is complete (step 2 of 2): nothing to train; to train on, resume with a larger train.max_steps, e.g. "
        "--train.max_steps=4" in again.stderr
    )
    assert "Traceback" not in done.stderr + again.stderr


def test_turbotrain_train_in_a_plain_script_opens_with_the_clis_line(tmp_path: Path, text_file: Path) -> None:
    """``python -c "import turbotrain; turbotrain.train(...)"`` with no logging set up (issue 47):
    the same opening line as ``turbotrain train``, and no traceback."""
    sections = {
        "model": {"n_layer": 1, "n_head": 2, "d_model": 32, "block_size": 32},
        "batch": {"micro": 4},
        "train": {"max_steps": 2, "eval_every": 2, "eval_batches": 1},
        "monitor": {"progress": False},
        "data": {"num_workers": 0, "path": str(text_file), "cache_dir": str(tmp_path / "cache")},
        "run": {"device": "cpu", "name": "first", "out_dir": str(tmp_path)},
    }
    script = f"import turbotrain; turbotrain.train(**{sections!r})"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr
    opening = [
        line for line in done.stderr.splitlines() if line.startswith("INFO turbotrain.loop.monitor.hook")
    ]
    assert opening, done.stderr
    assert opening[0].startswith("INFO turbotrain.loop.monitor.hook: training "), opening
    assert (
        " params: device cpu (" in opening[0] and "precision fp32; compile off; 2 steps; run " in opening[0]
    )
    assert opening[0].endswith(str(tmp_path / "first")), opening
    assert "Traceback" not in done.stderr


def test_the_hugging_face_example_prints_no_library_noise(tmp_path: Path) -> None:
    """``python examples/hf_trainer.py`` as the docs run it (issue 47): torchao's extension load
    failures and torch's pytree deprecation (transformers imports torchao) and transformers'
    ``loss_type=None`` line are not on the screen; the Trainer's own lines are."""
    example = Path(__file__).resolve().parents[2] / "examples" / "hf_trainer.py"
    done = subprocess.run(
        [sys.executable, str(example), str(tmp_path), "--steps", "2"],
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert done.returncode == 0, done.stderr
    screen = done.stdout + done.stderr
    for noise in ("Failed to load", "is an Enum subclass", "loss_type", "Traceback"):
        assert noise not in screen, screen
    assert "'train_runtime'" in screen and f"run directory: {tmp_path}/turbotrain" in screen
