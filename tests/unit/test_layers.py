"""The architecture holds: turbotrain's modules import only downward, never in a circle, and
``import turbotrain`` stays light.

The layer picture is the README's (section "Architecture"); this table is its executable form. A
module is placed by its longest matching prefix. Imports under ``if TYPE_CHECKING:`` are checked
for direction but not for cycles (they never run).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "turbotrain"

LAYERS: dict[str, int] = {
    # L0 foundation
    "errors": 0, "config": 0, "version": 0, "atomic": 0, "batch": 0, "units": 0, "rundir": 0, "runlock": 0,
    "process": 0, "signals": 0, "failure": 0, "launch": 0,
    # L1 facts and building blocks
    "hardware": 1, "models": 1, "data": 1, "workload": 1,
    # L2 core: what a step runs
    "precision": 2, "transforms": 2, "compile_guard": 2, "oom": 2, "optim": 2, "distributed": 2, "engine": 2, "assembly": 2,
    # L3 loop
    "hooks": 3, "run_hooks": 3, "epochs": 3, "lr_plateau": 3, "loop": 3, "checkpoint": 3, "sharded": 3, "monitor": 3, "experts_monitor": 3,
    # L4 tools
    "memory": 4,
    # L5 application
    "training": 5, "tracking": 5, "report": 5, "expert_report": 5, "doctor": 5, "precision_check": 5, "bench": 5,
    "measure": 5, "profile": 5, "tune": 5,  # short measured runs need run assembly (training) and bench's clock
    # L6 command line
    "cli": 6,
    # the package root (public API) and ``python -m turbotrain``
    "": 7, "__main__": 7,
}


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> int:
    if not module:
        return LAYERS[""]
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        key = ".".join(parts[:n])
        if key in LAYERS:
            return LAYERS[key]
    raise AssertionError(f"turbotrain.{module} has no layer: add it to LAYERS (and to the README's picture)")


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(path: Path) -> list[tuple[str, int, str]]:
    """(imported turbotrain module, line, where) for every import in ``path``; where is
    'top', 'type-checking' or 'late' (inside a function or class body)."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out: list[tuple[str, int, str]] = []

    def resolve(node: ast.ImportFrom) -> list[str]:
        if node.level == 0:
            if not (node.module or "").startswith("turbotrain"):
                return []
            base = node.module[len("turbotrain"):].lstrip(".")
        else:
            parts = package.split(".") if package else []
            up = node.level - 1
            parts = parts[: len(parts) - up] if up else parts
            base = ".".join(p for p in [*parts, *(node.module.split(".") if node.module else [])] if p)
        targets = []
        for alias in node.names:  # ``from . import bench`` names a submodule
            sub = f"{base}.{alias.name}" if base else alias.name
            targets.append(sub if (SRC / Path(*sub.split("."))).exists() or (SRC / f"{sub.replace('.', '/')}.py").exists() else base)
        return targets

    def visit(nodes: list[ast.stmt], where: str) -> None:
        for node in nodes:
            if isinstance(node, ast.ImportFrom):
                out.extend((t, node.lineno, where) for t in resolve(node))
            elif isinstance(node, ast.Import):
                out.extend(
                    (a.name[len("turbotrain"):].lstrip("."), node.lineno, where)
                    for a in node.names if a.name.split(".")[0] == "turbotrain"
                )
            elif isinstance(node, ast.If) and _is_type_checking(node):
                visit(node.body, "type-checking")
                visit(node.orelse, where)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(node.body, "late")
            else:
                for field in ("body", "orelse", "finalbody", "handlers"):
                    visit([n for n in getattr(node, field, []) if isinstance(n, ast.AST)], where)

    visit(ast.parse(path.read_text(), str(path)).body, "top")
    return out


def all_imports() -> dict[str, list[tuple[str, int, str]]]:
    return {module_name(p): imports_of(p) for p in sorted(SRC.rglob("*.py"))}


def test_every_module_has_a_layer():
    for module in all_imports():
        layer_of(module)


def test_imports_go_only_downward_and_never_late():
    wrong = []
    for module, imports in all_imports().items():
        for target, line, where in imports:
            if where == "late":
                wrong.append(f"turbotrain.{module}:{line} imports turbotrain.{target} inside a function")
            elif target != module and layer_of(target) > layer_of(module):
                wrong.append(
                    f"turbotrain.{module}:{line} (layer {layer_of(module)}) imports turbotrain.{target} "
                    f"(layer {layer_of(target)})"
                )
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles():
    graph = {
        m: {t for t, _, where in imports if where != "type-checking" and t != m}
        for m, imports in all_imports().items()
    }
    # A package's __init__ runs before its submodules: "cli" importing "cli.bench" is no cycle.
    state: dict[str, int] = {}
    cycles: list[str] = []

    def dfs(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*stack[stack.index(nxt):], nxt]))
            elif nxt not in state:
                dfs(nxt, [*stack, nxt])
        state[node] = 2

    for m in sorted(graph):
        if m not in state:
            dfs(m, [m])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_checker_sees_late_upward_and_circular_imports(tmp_path, monkeypatch):
    """The checks above can fail: a late import, an upward import and a cycle are all caught."""
    fake = tmp_path / "turbotrain"
    (fake / "memory").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "errors.py").write_text("from .engine import Engine\n")  # L0 -> L2: upward, and a cycle
    (fake / "engine.py").write_text("from .errors import X\n\ndef f():\n    from .memory import finder\n")
    (fake / "memory" / "__init__.py").write_text("")
    (fake / "memory" / "finder.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "SRC", fake)
    with pytest.raises(AssertionError, match="errors:1 .layer 0. imports turbotrain.core.engine"):
        test_imports_go_only_downward_and_never_late()
    with pytest.raises(AssertionError, match="engine:4 imports turbotrain.tools.memory.finder inside a function"):
        test_imports_go_only_downward_and_never_late()
    with pytest.raises(AssertionError, match="engine -> errors -> engine"):
        test_no_import_cycles()


HEAVY = ("turbotrain.tools.memory", "turbotrain.tools.memory.finder", "turbotrain.tools.memory.stats", "turbotrain.app.bench",
         "turbotrain.app.report", "turbotrain.app.training", "turbotrain.app.doctor", "matplotlib",
         "turbotrain.app.measure", "turbotrain.app.profile", "turbotrain.app.tune", "optuna", "torchao", "transformers")
# ~0.7 s of a 2.8 s import (issue 22): imported where an fsdp run, a sharded checkpoint or a
# progress bar needs them, never by a one-process Engine
DISTRIBUTED_HEAVY = ("torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed.checkpoint",
                     "rich.progress")

LIGHT_RUN = f"""
import sys, torch, turbotrain
print([m for m in {HEAVY + DISTRIBUTED_HEAVY!r} if m in sys.modules])
engine = turbotrain.Engine()
model, _, _ = engine.setup(torch.nn.Linear(4, 4))
with engine.autocast():
    loss = model(torch.randn(2, 4)).sum()
engine.backward(loss)
print([m for m in {DISTRIBUTED_HEAVY!r} if m in sys.modules])
"""


def test_import_turbotrain_stays_light():
    """``import turbotrain`` (the Engine and fit) loads none of the tools, the report, matplotlib,
    FSDP/DTensor/DCP or rich.progress; nor does a one-process Engine's setup, forward and backward.
    (A torch optimizer is left out: its constructor imports torch._dynamo, which imports FSDP.)"""
    out = subprocess.run([sys.executable, "-c", LIGHT_RUN], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "[]", f"import turbotrain loaded {out[0]}"
    assert out[1] == "[]", f"a one-process Engine loaded {out[1]}"
