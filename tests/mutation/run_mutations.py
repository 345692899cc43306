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

sys.path.insert(0, str(Path(__file__).parent))  # mutations.py beside this file, however it is run
from mutations import MUTATIONS, Mutation  # noqa: E402


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


def _source_lines(m: Mutation) -> list[str]:
    """The lines of the file ``m`` mutates, in this checkout (none when the file is gone)."""
    path = ROOT / m.path
    return path.read_text().split("\n") if path.is_file() else []


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
    parser.add_argument(
        "--check",
        action="store_true",
        help="only check that each mutation's original line is in the checkout's source once (seconds), and exit",
    )
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
    if args.check:
        moved = [m for m in chosen if _source_lines(m).count(m.original) != 1]
        for m in moved:
            print(
                f"mutation {m.name}: its original line is not in {m.path} once; update it\n  line: {m.original!r}"
            )
        print(f"{len(chosen) - len(moved)} of {len(chosen)} mutations find their line")
        return 1 if moved else 0

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
