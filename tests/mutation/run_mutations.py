"""A mutation check you can rerun: break one promised behaviour at a time with a one-line change
to the source and run the tests that should notice; each mutation must make them fail.

    python tests/mutation/run_mutations.py                      # all, report to benchmarks/results/cpu/mutations.json
    python tests/mutation/run_mutations.py --only rng-torch cosine-shape
    python tests/mutation/run_mutations.py --list

It never touches the checkout it runs from: src/, tests/, examples/, docs/, README.md and
pyproject.toml are copied to a temporary folder, the mutation is applied there, and pytest runs
there with PYTHONPATH pointing at that copy's src (subprocesses the tests start inherit it). Each
mutation names the exact original line; when the source has moved and the line is gone (or is
there twice) the script stops with a message naming the mutation, rather than test nothing. The
file is restored after each mutation, also on Ctrl-C (try/finally), and the copy is removed.

Verdicts: ``caught`` (a named test failed), ``survived`` (they all passed: write the test that
catches it), ``error`` (pytest could not run them: a wrong node id; not counted as caught),
``timeout``. The exit status is 0 only when every mutation was caught and the unmutated baseline
passed. Not collected by pytest (no ``test_`` prefix); not run in CI: it takes minutes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COPIED = ("src", "tests", "examples", "docs", "README.md", "pyproject.toml")
DEFAULT_JSON = ROOT / "benchmarks" / "results" / "cpu" / "mutations.json"
TIMEOUT_S = 900  # per mutation's test run: a mutation that hangs training counts as a timeout

RESUME = "tests/integration/test_resume_exact.py::test_a_stopped_and_resumed_run_with_dropout_augmentation_and_accumulation_equals_the_unstopped_one"
ASYNC = "tests/integration/test_resume_exact.py::test_each_background_checkpoint_holds_its_own_steps_weights_while_writes_overlap_training"
EPOCHS = "tests/integration/test_epochs_order.py"
SCHEDULE = "tests/unit/test_schedule_shape.py"
WINDOW = "tests/unit/test_throughput_window.py"


@dataclasses.dataclass(frozen=True)
class Mutation:
    """One behaviour broken by one line: in ``path``, ``original`` (a whole line, indentation
    included, present exactly once) becomes ``mutated``; ``tests`` are the pytest node ids that
    must fail."""

    name: str
    path: str
    original: str
    mutated: str
    tests: tuple[str, ...]
    why: str


MUTATIONS: tuple[Mutation, ...] = (
    # --- exact resume with randomness (issue 31) --------------------------------------------------
    Mutation(
        "rng-torch",
        "src/turbotrain/base/seeds.py",
        '    torch.set_rng_state(state["torch"])',
        "    pass  # mutation: torch's generator not restored",
        (RESUME,),
        "a resume leaves torch's generator (dropout) where the new process put it",
    ),
    Mutation(
        "rng-python",
        "src/turbotrain/base/seeds.py",
        '    random.setstate(_as_tuple(state["python"]))',
        "    pass  # mutation: Python's generator not restored",
        (RESUME,),
        "a resume leaves Python's random where the new process put it",
    ),
    Mutation(
        "rng-numpy",
        "src/turbotrain/base/seeds.py",
        "    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))",
        "    pass  # mutation: numpy's generator not restored",
        (RESUME,),
        "a resume leaves numpy's generator where the new process put it",
    ),
    Mutation(
        "rng-drawn-after-restore",
        "src/turbotrain/app/training.py",
        "    set_rng_state(first_step_draws)",
        "    pass  # mutation: the FLOP count's draws stay in the restored generators",
        (RESUME,),
        "the FLOP count's forward (dropout) draws from the generators a resume just restored",
    ),
    Mutation(
        "run-seeds-torch-only",
        "src/turbotrain/app/training.py",
        "    seed_all(c.run.seed)  # torch, random and numpy: a user's model or loss may draw from any of them",
        "    torch.manual_seed(c.run.seed)  # mutation: random and numpy left unseeded",
        (RESUME,),
        "Python's random and numpy unseeded: two runs with one seed differ",
    ),
    Mutation(
        "worker-stream-not-per-batch",
        "src/turbotrain/parts/data/epochs.py",
        "        if isinstance(batch, Indices) and torch.utils.data.get_worker_info() is not None:",
        "        if False:  # mutation: a worker's augmentation draws from its own stream",
        (RESUME,),
        "an augmentation in a DataLoader worker restarts its stream at a resume",
    ),
    Mutation(
        "resume-ignores-accumulation",
        "src/turbotrain/parts/models/spec.py",
        "        return step * c.batch.accumulation",
        "        return step  # mutation: the data position forgets accumulation",
        (RESUME,),
        "a resume with accumulation re-reads micro-batches already trained on",
    ),
    Mutation(
        "async-staged-before-previous-write-ends",
        "src/turbotrain/loop/checkpoint/__init__.py",
        "            self._finished(ctx, self.background.wait())  # the previous write first (its failure raised here)",
        "            pass  # mutation: the next checkpoint is staged while the previous one is written",
        (ASYNC,),
        "a background checkpoint holds a later step's weights",
    ),
    # --- data order --------------------------------------------------------------------------------
    Mutation(
        "loader-shuffle-ignored",
        "src/turbotrain/parts/data/epochs.py",
        "    sampler = EpochSampler(len(dataset), batch_size, seed, shuffles(loader), start, rank, world, accumulation)  # type: ignore[arg-type]",
        "    sampler = EpochSampler(len(dataset), batch_size, seed, False, start, rank, world, accumulation)  # type: ignore[arg-type]",
        (EPOCHS,),
        "a --model loader with shuffle=True trains in the dataset's order",
    ),
    Mutation(
        "partial-last-batch-kept",
        "src/turbotrain/parts/data/epochs.py",
        "        self.steps_per_epoch = size // self.global_batch",
        "        self.steps_per_epoch = -(-size // self.global_batch)  # mutation: a partial last batch per epoch",
        (
            f"{EPOCHS}::test_an_epochs_run_trains_each_epochs_order_row_by_row_and_drops_the_partial_batch[in_order-False-6]",
        ),
        "each epoch ends with a short batch the docs say is dropped",
    ),
    # --- schedule ----------------------------------------------------------------------------------
    Mutation(
        "cosine-becomes-linear",
        "src/turbotrain/core/optim.py",
        '        shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress',
        "        shape = 1.0 - progress  # mutation: every decay linear",
        (SCHEDULE,),
        "cosine decay is linear",
    ),
    Mutation(
        "warmup-off-by-one",
        "src/turbotrain/core/optim.py",
        "    return (s + 1) / warmup_steps if s < warmup_steps else 1.0",
        "    return s / warmup_steps if s < warmup_steps else 1.0  # mutation: the first step at LR 0",
        (SCHEDULE,),
        "the warmup starts at 0 and ends a step late",
    ),
    # --- throughput --------------------------------------------------------------------------------
    Mutation(
        "samples-per-s-from-run-totals",
        "src/turbotrain/loop/monitor/hook.py",
        '            record["samples_per_s"] = self.world * (samples - last_samples) / dt',
        '            record["samples_per_s"] = self.world * samples / dt  # mutation: all samples over the window',
        (WINDOW,),
        "samples/s (so TFLOP/s, MFU) from the run's total samples",
    ),
    Mutation(
        "tokens-per-s-from-run-totals",
        "src/turbotrain/loop/monitor/hook.py",
        '            record["tokens_per_s"] = self.world * (tokens - last_tokens) / dt',
        '            record["tokens_per_s"] = self.world * tokens / dt  # mutation: all tokens over the window',
        (WINDOW,),
        "tokens/s (so TFLOP/s, MFU) from the run's total tokens",
    ),
    Mutation(
        "window-time-from-run-start",
        "src/turbotrain/loop/monitor/hook.py",
        "        dt = now - t - (side_s - self._side_s)  # evaluation and checkpoint time are not training",
        "        dt = now - self._t0 - side_s  # mutation: the time since the start",
        (WINDOW,),
        "throughput over the time since the start, not the window",
    ),
    Mutation(
        "window-counts-evaluation-time",
        "src/turbotrain/loop/monitor/hook.py",
        "        dt = now - t - (side_s - self._side_s)  # evaluation and checkpoint time are not training",
        "        dt = now - t  # mutation: evaluation and checkpoint time counted as training",
        (WINDOW,),
        "evaluation time lowers the training throughput",
    ),
    # --- behaviours the suite caught before (issue 31's audit) -------------------------------------
    Mutation(
        "accumulation-not-divided",
        "src/turbotrain/core/window.py",
        "        scaled = loss / accumulation if accumulation > 1 else loss",
        "        scaled = loss  # mutation: accumulated gradients k times too large",
        ("tests/unit/test_engine.py::test_k_accumulated_micro_batches_equal_one_k_times_batch",),
        "k accumulated micro-batches sum their gradients instead of averaging",
    ),
    Mutation(
        "fallback-threshold-off-by-one",
        "src/turbotrain/core/nonfinite.py",
        '        if self.mode == "skip" or new < self.max_steps:',
        '        if self.mode == "skip" or new <= self.max_steps:  # mutation',
        ("tests/unit/test_engine.py::test_non_finite_loss_is_skipped_then_falls_back",),
        "the precision fallback comes one non-finite step late",
    ),
    Mutation(
        "checksum-not-compared",
        "src/turbotrain/loop/checkpoint/format.py",
        '    return "" if actual == expected else f"{path.name} does not match its checksum (truncated or corrupt)"',
        '    return "" if True else f"{path.name} does not match its checksum (truncated or corrupt)"  # mutation',
        (
            "tests/unit/test_checkpoint.py::test_corrupt_newest_falls_back_to_the_previous",
            "tests/unit/test_checkpoint.py::test_damaged_checksum_files_and_foreign_payloads_fall_back",
        ),
        "a corrupt checkpoint loads as if it verified",
    ),
    Mutation(
        "finder-without-headroom",
        "src/turbotrain/tools/memory/finder.py",
        "    target = None if limit is None else limit / (1.0 + headroom)  # None: no memory limit was met",
        "    target = None if limit is None else limit  # mutation: no headroom kept",
        (
            "tests/unit/test_memory.py::test_finder_returns_a_size_within_the_headroom_below_the_limit_in_few_trials",
            "tests/unit/test_memory.py::test_finder_never_exceeds_a_memory_cap_and_keeps_headroom_under_it",
        ),
        "the batch-size finder picks a size at the memory limit",
    ),
    Mutation(
        "ddp-always-syncs",
        "src/turbotrain/core/distributed.py",
        "        model.require_backward_grad_sync = sync  # the flag DDP's no_sync() context sets",
        "        model.require_backward_grad_sync = True  # mutation: no no_sync under accumulation",
        (
            "tests/distributed/test_data_parallel.py::test_ddp_accumulation_reduces_gradients_once_per_optimizer_step",
        ),
        "DDP all-reduces at every micro-batch under accumulation",
    ),
    Mutation(
        "errors-print-a-traceback",
        "src/turbotrain/cli/__init__.py",
        '        print(f"turbotrain {name}: error: {exc}", file=sys.stderr)',
        '        __import__("traceback").print_exc(); print(f"turbotrain {name}: error: {exc}", file=sys.stderr)  # mutation',
        (
            "tests/integration/test_train_model.py::test_model_and_resume_together_is_one_line",
            "tests/integration/test_train_cli.py::test_resume_mistakes_give_one_line_errors_and_lose_nothing",
        ),
        "a user's mistake prints a traceback besides its one line",
    ),
    Mutation(
        "scheduler-state-not-saved",
        "src/turbotrain/loop/checkpoint/state.py",
        '        entries["scheduler"] = scheduler',
        "        pass  # mutation: the LR schedule restarts at a resume",
        (RESUME, "tests/integration/test_train_cli.py::test_stop_and_resume_equals_an_uninterrupted_run"),
        "a resumed run restarts the LR schedule (warmup again)",
    ),
)


def copy_tree(dest: Path, head: bool) -> None:
    """The files the tests need into ``dest``: this checkout's working tree (caches left out), or
    with ``head`` its last commit (``git archive HEAD``: nobody's uncommitted edits)."""
    if head:
        archive = subprocess.run(
            ["git", "archive", "HEAD", *COPIED], cwd=ROOT, capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
        return
    ignore = shutil.ignore_patterns("__pycache__", ".pytest_cache", "*.pyc")
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=ignore)
        elif src.exists():
            shutil.copy2(src, dest / name)


def apply(tree: Path, m: Mutation) -> str:
    """Write ``m`` into ``tree``; return the file's original text (for the restore)."""
    path = tree / m.path
    text = path.read_text()
    lines = text.split("\n")
    hits = [i for i, line in enumerate(lines) if line == m.original]
    if len(hits) != 1:
        raise SystemExit(
            f"mutation {m.name}: its original line is in {m.path} {len(hits)} times (expected once); "
            f"the source moved: update MUTATIONS in {Path(__file__).name}\n  line: {m.original!r}"
        )
    lines[hits[0]] = m.mutated
    path.write_text("\n".join(lines))
    return text


def run_tests(tree: Path, tests: tuple[str, ...]) -> tuple[int, float, str]:
    """pytest -x on ``tests`` in ``tree`` against its own src: (exit status, seconds, output tail)."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(tree / "src"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    )
    env.pop("PYTEST_ADDOPTS", None)
    start = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
            cwd=tree,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
        rc, out = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        rc, out = -1, f"timed out after {TIMEOUT_S} s\n{exc.stdout or ''}"
    return rc, time.perf_counter() - start, out


def failed_test(output: str) -> str:
    found = re.findall(r"^(?:FAILED|ERROR) (\S+)", output, flags=re.MULTILINE)
    return found[0] if found else ""


def first_error(output: str) -> str:
    """The first ``E`` line of pytest's report: what the catching test saw (an assertion, an error)."""
    found = re.search(r"^E +(.+)$", output, flags=re.MULTILINE)
    return found.group(1).strip()[:300] if found else ""


def verdict(rc: int) -> str:
    return {0: "survived", 1: "caught", -1: "timeout"}.get(rc, "error")


def check_imports_from_copy(tree: Path) -> None:
    """The tests must import the copy's turbotrain, not the checkout's (an editable install)."""
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    where = subprocess.run(
        [sys.executable, "-c", "import turbotrain; print(turbotrain.__file__)"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not Path(where).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(
            f"turbotrain imports from {where}, not from the copy in {tree}: mutations would test nothing"
        )


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("TT_COMMIT", "unknown")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run these mutations only (see --list)")
    parser.add_argument(
        "--json",
        type=Path,
        default=DEFAULT_JSON,
        help=f"where the report goes (default {DEFAULT_JSON.relative_to(ROOT)})",
    )
    parser.add_argument(
        "--no-baseline", action="store_true", help="skip running the tests once unmutated first"
    )
    parser.add_argument(
        "--head", action="store_true", help="mutate the last commit (git archive HEAD), not the working tree"
    )
    parser.add_argument("--list", action="store_true", help="list the mutations and their tests, and exit")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    unknown = set(args.only or ()) - {m.name for m in MUTATIONS}
    if unknown:
        parser.error(
            f"--only: no mutation named {', '.join(sorted(unknown))}; valid: {', '.join(m.name for m in MUTATIONS)}"
        )
    if args.list:
        for m in chosen:
            print(f"{m.name:42} {m.path}\n{'':42} {m.why}\n{'':42} tests: {' '.join(m.tests)}")
        return 0

    results: list[dict] = []
    baseline: dict = {"skipped": True}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tt-mutations-") as tmp:
        tree = Path(tmp)
        copy_tree(tree, args.head)
        check_imports_from_copy(tree)
        for m in chosen:  # every original line present before anything runs: a moved source fails at once
            (tree / m.path).write_text(apply(tree, m))
        # one pytest per test folder: the folders' conftest modules stay apart, as in CI's runs
        if not args.no_baseline:
            nodes = list(dict.fromkeys(t for m in chosen for t in m.tests))
            baseline = {"passed": True, "seconds": 0.0, "tests": nodes}
            for folder in dict.fromkeys(n.split("/")[1] for n in nodes):
                rc, seconds, out = run_tests(tree, tuple(n for n in nodes if n.split("/")[1] == folder))
                baseline["passed"] &= rc == 0
                baseline["seconds"] = round(baseline["seconds"] + seconds, 1)
                if rc != 0:
                    print(out[-3000:])
            print(
                f"baseline (unmutated): {'passed' if baseline['passed'] else 'FAILED'} in {baseline['seconds']:.0f} s",
                flush=True,
            )
        try:
            for m in chosen:
                original = apply(tree, m)
                try:
                    rc, seconds, out = run_tests(tree, m.tests)
                finally:
                    (tree / m.path).write_text(original)
                row = {
                    "name": m.name,
                    "file": m.path,
                    "why": m.why,
                    "verdict": verdict(rc),
                    "failed_test": failed_test(out),
                    "saw": first_error(out),
                    "seconds": round(seconds, 1),
                    "tests": list(m.tests),
                    "original": m.original,
                    "mutated": m.mutated,
                }
                if row["verdict"] == "error":
                    row["output_tail"] = out[-1500:]
                results.append(row)
                print(f"{row['verdict']:9} {m.name:42} {seconds:6.1f} s  {row['failed_test']}", flush=True)
        except KeyboardInterrupt:
            print("interrupted: the report holds the mutations run so far", file=sys.stderr)

    caught = sum(r["verdict"] in ("caught", "timeout") for r in results)
    report = {
        "command": "python tests/mutation/run_mutations.py"
        + (" --head" if args.head else "")
        + (f" --only {' '.join(args.only)}" if args.only else ""),
        "tree": "HEAD" if args.head else "working tree",
        "commit": git_commit(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "baseline": baseline,
        "mutations": len(results),
        "caught": caught,
        "survived": [r["name"] for r in results if r["verdict"] == "survived"],
        "errors": [r["name"] for r in results if r["verdict"] == "error"],
        "total_s": round(time.perf_counter() - started, 1),
        "results": results,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\n{'mutation':42} {'verdict':9} {'s':>6}  caught by")
    for r in results:
        print(f"{r['name']:42} {r['verdict']:9} {r['seconds']:6.1f}  {r['failed_test']}")
    print(f"\n{caught}/{len(results)} caught; report: {args.json}")
    ok = caught == len(results) == len(chosen) and baseline.get("passed", True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
