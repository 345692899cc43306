"""docs/plugins.md, done exactly as written: its files written into a scratch folder (each code block
names its file on its first line), imported, and its commands run there, outputs compared with the
page's. Neither example touches base/config.py, tune, doctor or bench: the plugin registers itself."""

from __future__ import annotations

import json
import os
import re
import runpy
import shlex
import sys
import tempfile
from pathlib import Path

import inprocess
import pytest
from conftest import HANG_S

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "plugins.md"


def blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", PAGE.read_text(), re.M | re.S)


def write_files(folder: Path) -> list[str]:
    """Every python block whose first line names a file (``# regression/spec.py``), written there."""
    names = []
    for body in blocks("python"):
        name = body.splitlines()[0].removeprefix("# ").strip()
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(body)
        names.append(name)
    return names


def console(marker: str) -> list[tuple[list[str], list[str]]]:
    """The console block holding ``marker``: each ``$ command`` with the output lines under it."""
    body = next(b for b in blocks("console") if marker in b)
    runs: list[tuple[list[str], list[str]]] = []
    for line in body.splitlines():
        if line.startswith("$ "):
            runs.append((shlex.split(line[2:]), []))
        else:
            runs[-1][1].append(line)
    return runs


def run(words: list[str], cwd: Path) -> inprocess.Result:
    """``python SCRIPT ARGS`` or ``python -c CODE ARGS`` in ``cwd``, as the page runs it (``cwd`` on
    the module path, its own cache), in a fork of this process (inprocess.fork): a process of its
    own, whose plugin registers nothing here, without the seconds an interpreter spends importing
    torch and turbotrain."""
    assert words[0] == "python"

    def command() -> None:
        os.chdir(cwd)
        os.environ["XDG_CACHE_HOME"] = str(cwd / "cache")
        sys.path.insert(0, str(cwd))
        if words[1] == "-c":
            sys.argv = ["-c", *words[3:]]
            exec(compile(words[2], "<string>", "exec"), {"__name__": "__main__"})
        else:
            sys.argv = words[1:]
            runpy.run_path(words[1], run_name="__main__")

    out = Path(tempfile.mkdtemp(prefix="run-", dir=cwd.parent))  # beside the folder, not in it
    return inprocess.completed(inprocess.fork(command, out / "stdout", out / "stderr"), HANG_S)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("plugins")
    names = write_files(d)
    assert {"fp16_static.py", "use_fp16_static.py", "regression/settings.py", "regression/spec.py"} <= set(
        names
    )
    assert "regression/__init__.py" in names
    return d


def test_the_pages_plugins_leave_the_shared_files_alone():
    for shared in ("base/config.py", "base/config_sections.py", "app/tune/space.py", "app/bench/variants.py"):
        text = (ROOT / "src" / "turbotrain" / shared).read_text()
        assert "fp16_static" not in text and "regression" not in text, shared


@pytest.mark.slow
def test_a_precision_is_one_file_with_its_settings_registered_by_defining_it(folder: Path):
    out = run(["python", "use_fp16_static.py"], folder)
    assert out.returncode == 0, out.stderr[-3000:]
    first, described = out.stdout.strip().splitlines()
    name, scale, _, loss = first.split()
    assert (name, scale) == ("FP16Static", "256.0") and float(loss) < 1.5, first  # it trained (y ~ N(0, 1))
    assert described.startswith("  --precision.fp16_static_scale=1024.0: mode 'fp16-static'")
    assert "(range [1, 16777216])" in described
    ((words, expected),) = console("fp16_static_scale")
    refused = run(words, folder)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == expected, refused.stderr


@pytest.mark.slow
def test_a_model_family_is_one_folder_and_one_registry_line(folder: Path):
    (train, quiet), (bad, expected) = console("--model.arch=regression")
    trained = run(train, folder)
    assert trained.returncode == 0 and not quiet, trained.stderr[-3000:]
    assert (folder / "runs" / "reg" / "summary.json").is_file()
    records = [json.loads(x) for x in (folder / "runs" / "reg" / "metrics.jsonl").read_text().splitlines()]
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(vals) == 2 and vals[-1] < vals[0], vals  # it learned: validation at step 10 and 20
    saved = (folder / "runs" / "reg" / "config.toml").read_text()
    assert "[regression]" in saved and "width = 32" in saved
    refused = run(bad, folder)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == expected, refused.stderr
