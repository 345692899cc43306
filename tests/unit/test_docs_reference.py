"""The docs site's generated reference pages (issue 49 item 4) list what the code defines: the config
reference every field ``turbotrain train --help-config`` lists, with the same defaults and ranges; the CLI
reference every subcommand and flag of the parsers; the metrics reference every key a real run writes to
metrics.jsonl and summary.json; the results reference every result file. Fast: no site build, only the
hooks' functions (and two steps of a one-layer gpt-tiny)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
from pathlib import Path
from types import ModuleType

import pytest

from turbotrain.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("mkdocs", reason="the docs hook builds mkdocs File objects: pip install -e '.[docs]'")


def _hook(name: str = "reference") -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"docs_{name}_hook", ROOT / "docs" / "hooks" / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(markdown: str) -> list[list[str]]:
    """The table rows of a page (header and rule rows left out), cells unescaped and stripped."""
    rows = []
    for line in markdown.splitlines():
        if line.startswith("| ") and not line.startswith(("| Field |", "| Flag |")):
            cells = re.split(r"(?<!\\)\|", line.strip()[1:-1])
            rows.append([c.strip().replace("\\|", "|") for c in cells])
    return rows


def test_config_reference_lists_every_help_config_field_with_its_default_and_range(capsys):
    assert main(["train", "--help-config"]) == 0
    listed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  --")]
    rows = {
        key.strip("`"): (default.strip("`"), allowed)
        for key, _, default, allowed, _ in _rows(_hook().config_reference())
    }
    keys = [re.match(r"  (--[a-z0-9_.]+)=", line).group(1) for line in listed]
    assert keys == list(rows), "the reference lists the fields --help-config lists, in its order"
    assert len(keys) > 50
    for line, key in zip(listed, keys, strict=True):
        default, allowed = rows[key]
        assert line.startswith(f"  {key}={default}: "), (line, default)
        if allowed.startswith("one of: "):
            assert f"({allowed})" in line, (line, allowed)
        elif allowed:
            assert f"(range {allowed})" in line, (line, allowed)
        else:
            assert "(range [" not in line and "(one of: " not in line, line


def _commands(
    parser: argparse.ArgumentParser, prog: str = "turbotrain"
) -> dict[str, argparse.ArgumentParser]:
    out = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out[f"{prog} {name}"] = sub
                out.update(_commands(sub, f"{prog} {name}"))
    return out


def test_cli_reference_lists_every_subcommand_and_flag_of_the_parsers():
    page = _hook().cli_reference()
    sections = dict(re.findall(r"^## `([^`]+)`\n(.*?)(?=^## |\Z)", page, flags=re.M | re.S))
    commands = _commands(build_parser())
    assert {"turbotrain train", "turbotrain bench", "turbotrain tune"} <= set(commands)
    assert set(sections) == set(commands)
    for prog, parser in commands.items():
        flags = {
            f
            for row in _rows(sections[prog])
            for f in re.findall(r"--?[a-zA-Z][\w-]*", row[0].split(" {")[0])
        }
        wanted = {
            s for a in parser._actions if not isinstance(a, argparse._HelpAction) for s in a.option_strings
        }
        assert wanted and wanted <= flags, (prog, wanted - flags)


@pytest.mark.slow  # trains two steps and writes the report (8 s on a quiet 2-core CPU)
def test_metrics_reference_lists_every_key_a_real_run_writes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    args = ["--model.n_layer=1", "--train.max_steps=2", "--train.eval_every=2", "--train.eval_batches=1"]
    assert main(["train", "--preset", "gpt-tiny", "--run.name=keys", "--monitor.log_every=1", *args]) == 0
    run = tmp_path / "runs" / "keys"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run / "summary.json").read_text())
    listed = set(re.findall(r"^\| `([^`]+)`", _hook("records").metrics_reference(), flags=re.M))
    written = {k for r in records if "event" not in r for k in r}
    written |= {
        k for k in summary if not k.startswith("final_") or k in ("final_train_loss", "final_val_loss")
    }
    written |= {f"steady_state.{k}" for k in summary["steady_state"]}
    assert {"loss", "tokens_per_s", "val_loss", "steady_state.mfu", "resolved"} <= written
    assert not written - listed, f"written by a run, missing from reference/metrics.md: {written - listed}"


def test_results_reference_shows_every_result_file():
    page = _hook("results").results_reference()
    results = ROOT / "benchmarks" / "results"
    for path in results.rglob("*"):
        if path.suffix == ".md" or (path.suffix == ".json" and not path.with_suffix(".md").exists()):
            assert f"### `{path.name}`" in page, path
    table = (results / "cpu" / "gpt-tiny-to-loss.md").read_text().splitlines()
    assert table[0].startswith("## turbotrain bench --to-loss") and table[4] in page
    assert "Command: `turbotrain bench --workload gpt-tiny --to-loss 2.8" in page
