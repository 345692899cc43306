"""MkDocs hook: ``reference/metrics.md``, every field a run writes to ``metrics.jsonl`` and ``summary.json``,
read from the code that writes them (never a hand-kept list):

- ``metrics.jsonl``: the keys the monitor (``Monitor.observe``) and each of its probes (their ``__call__``)
  put into a record, in ``src/turbotrain/loop/monitor/``;
- ``summary.json``: the fields of ``RunFacts`` (``app/summary.py``), the keywords ``turbotrain train`` adds
  through ``engine_facts(...)``, and the figures ``summarize_records`` reads off the records.

Each row names the code that writes the key and carries the comment written beside it there.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import io
import re
import tokenize
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

from turbotrain.app.summary import RunFacts

SRC = Path(__file__).resolve().parents[2] / "src" / "turbotrain"
MONITOR = SRC / "loop" / "monitor"
WRITERS = ("observe", "_rates", "__call__")  # the monitor's record (_rates: its rates) and each probe's


def _comments(path: Path) -> dict[int, str]:
    """Line number -> the ``#`` comment on that line (not the notes on the code's own syncs)."""
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    found = {t.start[0]: t.string.lstrip("# ").strip() for t in tokens if t.type == tokenize.COMMENT}
    return {line: text for line, text in found.items() if "sync point" not in text}


def _module(path: Path) -> Any:
    return importlib.import_module("turbotrain." + ".".join(path.relative_to(SRC).with_suffix("").parts))


def _key(node: ast.AST, module: Any) -> str | None:
    """A record key written as a string, an f-string (``final_<...>``) or a module constant."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name) and isinstance(getattr(module, node.id, None), str):
        return getattr(module, node.id)
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "<metric>" for v in node.values)
    return None


def _written(func: ast.AST, module: Any) -> list[tuple[str, int]]:
    """(key, line) of every key ``func`` writes: ``x["k"] = ...``, ``x.update(k=...)``, ``{"k": ...}``."""
    found = []
    for node in ast.walk(func):
        if isinstance(node, ast.Assign):
            found += [(_key(t.slice, module), t.lineno) for t in node.targets if isinstance(t, ast.Subscript)]
        elif (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update"
        ):
            found += [(k.arg, k.value.lineno) for k in node.keywords if k.arg]
        elif isinstance(node, ast.Dict):
            found += [(_key(k, module), k.lineno) for k in node.keys if k is not None]
    return [(k, line) for k, line in found if k and k.replace("_", "").replace("<metric>", "").isalnum()]


def metrics_rows() -> list[tuple[str, str, str]]:
    """(key, written by, the comment beside it) for every key of a ``metrics.jsonl`` step record."""
    rows: dict[str, tuple[str, str, str]] = {}
    for path in sorted(
        MONITOR.glob("*.py"), key=lambda p: (p.name != "hook.py", p.name)
    ):  # the Monitor first
        tree, module, notes = ast.parse(path.read_text()), _module(path), _comments(path)
        for cls in [n for n in tree.body if isinstance(n, ast.ClassDef)]:
            fields = [
                n
                for n in cls.body
                if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "FIELDS"
            ]
            for f in fields:  # a sampler's table: the device's name -> the record's key
                rows.update({v.value: (v.value, cls.name, notes.get(v.lineno, "")) for v in f.value.values})
            for func in [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in WRITERS]:
                for key, line in _written(func, module):
                    rows.setdefault(key, (key, f"{cls.name}.{func.name}", notes.get(line, "")))
    return list(rows.values())


def _found(node: ast.AST, name: str, own: set[str]) -> list[tuple[str | None, int]]:
    """(key, line) that one call adds to summary.json: ``engine_facts``' keywords, ``RunFacts``'
    ``more={...}``, ``write_summary``'s keywords (and a ``**{...}`` among them); ``known["k"] = ...``."""
    if isinstance(node, ast.Call) and name in ("engine_facts", "write_summary", "RunFacts"):
        keys = [(k.arg, k.lineno) for k in node.keywords if k.arg and k.arg not in own | {"more"}]
        extra = [k.value for k in node.keywords if k.arg in (None, "more")]
        dicts = [d for v in extra for d in ast.walk(v) if isinstance(d, ast.Dict)]
        return keys + [(_key(k, None), k.lineno) for d in dicts for k in d.keys if k is not None]
    if isinstance(node, ast.Assign):
        subs = [
            t for t in node.targets if isinstance(t, ast.Subscript) and getattr(t.value, "id", "") == "known"
        ]
        return [(_key(t.slice, None), t.lineno) for t in subs]
    return []


def _run_keywords() -> list[tuple[str, str, str]]:
    """What runs add to summary.json's top level beyond RunFacts' fields (:func:`_found`), with the
    modules that add them."""
    own = {f.name for f in dataclasses.fields(RunFacts)}
    rows: dict[str, tuple[str, str, str]] = {}
    for path in sorted(SRC.rglob("*.py")):
        tree, notes = ast.parse(path.read_text()), _comments(path)
        where = ".".join(path.relative_to(SRC).with_suffix("").parts)
        for node in ast.walk(tree):
            # known["k"] = ...: the facts a module hands write_summary (app.report)
            name = getattr(node.func, "id", "") if isinstance(node, ast.Call) else "write_summary"
            for key, line in _found(node, name, own):
                if not key or key in own:
                    continue
                if key in rows:
                    rows[key] = (key, f"{rows[key][1]}, {where}", rows[key][2] or notes.get(line, ""))
                else:
                    rows[key] = (key, f"{name} in {where}", notes.get(line, ""))
    return list(rows.values())


def summary_rows() -> list[tuple[str, str, str]]:
    """(key, written by, the comment beside it) for summary.json: RunFacts, engine_facts' keywords,
    then summarize_records' figures (``steady_state.*`` inside its dict)."""
    path = SRC / "app" / "summary.py"
    tree, module, notes = ast.parse(path.read_text()), _module(path), _comments(path)
    facts = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RunFacts")
    rows = [
        (n.target.id, f"RunFacts ({ast.unparse(n.annotation)})", notes.get(n.lineno, ""))
        for n in facts.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.target.id != "more"
    ]
    rows += _run_keywords()
    func = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "summarize_records")
    ret = next(n.value for n in ast.walk(func) if isinstance(n, ast.Return) and isinstance(n.value, ast.Dict))
    for k, v in zip(ret.keys, ret.values, strict=True):
        if k is None:  # ** a dict: its keys, or the dict it builds
            inner = (
                v
                if isinstance(v, (ast.Dict, ast.DictComp))
                else next((d for d in ast.walk(v) if isinstance(d, ast.Dict)), None)
            )
            keys = (
                [(_key(inner.key, module), inner.key.lineno)]
                if isinstance(inner, ast.DictComp)
                else [(_key(ik, module), ik.lineno) for ik in (inner.keys if inner else []) if ik is not None]
            )
            rows += [(key, "summarize_records", notes.get(line, "")) for key, line in keys if key]
        elif isinstance(v, ast.Dict):
            name = _key(k, module)
            rows.append((name, "summarize_records", notes.get(k.lineno, "")))
            inner = [
                pair
                for ik, iv in zip(v.keys, v.values, strict=True)
                for pair in ([(_key(ik, module), ik.lineno)] if ik is not None else _listed_keys(iv, tree))
            ]
            rows += [(f"{name}.{key}", "summarize_records", notes.get(line, "")) for key, line in inner]
        else:
            rows.append((_key(k, module), "summarize_records", notes.get(k.lineno, "")))
    return rows


def _listed_keys(node: ast.AST, tree: ast.Module) -> list[tuple[str, int]]:
    """(key, line) of a ``**{k: ... for k in NAME}`` whose NAME is a module-level tuple of strings."""
    if not (isinstance(node, ast.DictComp) and isinstance(node.generators[0].iter, ast.Name)):
        return []
    name = node.generators[0].iter.id
    for n in tree.body:
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in n.targets):
            elts = n.value.elts if isinstance(n.value, (ast.Tuple, ast.List)) else []
            return [
                (e.value, e.lineno) for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str)
            ]
    return []


def _docstrings() -> dict[str, str]:
    """Class or function name -> the first paragraph of its docstring, over the package (first found)."""
    found: dict[str, str] = {}
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and ast.get_docstring(node):
                text = ast.get_docstring(node).split("\n\n")[0].replace("\n", " ")
                found.setdefault(node.name, re.sub(r":\w+:`~?([^`]+)`", r"`\1`", text).replace("``", "`"))
    return found


def _tables(rows: list[tuple[str, str, str]], docs: dict[str, str]) -> list[str]:
    """One table per writer (its docstring's first paragraph above it), in the order they first write."""
    groups: dict[str, list[tuple[str, str, str]]] = {}
    for row in rows:
        groups.setdefault(re.split(r"[ .(]", row[1])[0], []).append(row)
    out = []
    for name, group in groups.items():
        out += [
            "",
            f"### `{name}`",
            "",
            docs.get(name, ""),
            "",
            "| Key | Written by | Note (from the code) |",
        ]
        out += [
            "|---|---|---|",
            *(f"| `{k}` | `{w}` | {n.replace('|', chr(92) + '|')} |" for k, w, n in group),
        ]
    return out


def metrics_reference() -> str:
    """Markdown: the keys of ``metrics.jsonl`` records and of ``summary.json``."""
    docs = _docstrings()
    return (
        "\n".join(
            [
                "# Metrics and summary fields",
                "",
                "Generated from the code that writes them (`docs/hooks/records.py` reads its source). Every run "
                "(`turbotrain train`, `track()`, the trainer callbacks) writes one record to `runs/NAME/metrics.jsonl` "
                "every `monitor.log_every` steps and `summary.json` at its end. A key appears only when it applies "
                "(`mfu` with a known peak, `mem_*` on CUDA, `val_*` at an evaluation). Your own "
                "`engine.log(name, value)` adds `train_<name>`, a workload's `metrics_fn` `val_<name>`; what MFU "
                "counts: [mfu.md](../mfu.md).",
                "",
                "## `metrics.jsonl`: a step record",
                *_tables(metrics_rows(), docs),
                "",
                "Records with an `event` key (`epoch`, `restart`) are not step records: the report keeps them apart.",
                "",
                "## `summary.json`",
                *_tables(summary_rows(), docs),
            ]
        )
        + "\n"
    )


def on_files(files: Files, config: Any) -> Files:
    files.append(File.generated(config, "reference/metrics.md", content=metrics_reference()))
    return files
