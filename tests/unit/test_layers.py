"""The architecture holds: each of turbotrain's layers is a folder, its modules import only
downward, never late, never in a circle, in chains inside a layer no longer than the picture says,
and ``import turbotrain`` stays light.

The layers are the picture in docs/architecture.md (section "Layers"), read from there: one line per layer,
``L<n> <folder>/ [<depth>]  <what it holds>``. A module's layer is the folder it sits in (the
package root's ``__init__`` and ``__main__`` are the top layer); ``depth`` is the longest chain of
imports allowed between modules of that layer (``a`` imports ``b`` imports ``c``: 2). Imports under
``if TYPE_CHECKING:`` are checked for direction but not for cycles or depth (they never run).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "turbotrain"
PICTURE = ROOT / "docs" / "architecture.md"  # the layer picture (the README links it)
DATA_FOLDERS = {"presets"}  # folders of the package root that hold data, not modules
# the package root's own modules: its __init__ (the public API), __main__, and plugins (the stable
# names extenders import, docs/plugins.md: the layer folders may move their modules)
ROOT_MODULES = ("", "__main__", "plugins")


@dataclass
class Layer:
    number: int
    folder: str  # "" for the package root
    depth: int  # the longest same-layer import chain allowed
    text: str  # what the picture says it holds


def picture() -> dict[str, Layer]:
    """The layer picture of docs/architecture.md, by folder: the first code block of section "Layers"."""
    text = PICTURE.read_text()
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```", 2)[1]
    layers: dict[str, Layer] = {}
    current: Layer | None = None
    for line in block.splitlines():
        m = re.match(r"^L(\d+) (\S+?)/? +\[(\d+)\] +(.*)$", line)
        if m:
            folder = "" if m[2] == "turbotrain" else m[2]
            current = layers[folder] = Layer(int(m[1]), folder, int(m[3]), m[4])
        elif line.startswith(" ") and current is not None:
            current.text += " " + line.strip()
        elif line.strip():
            raise AssertionError(
                f"docs/architecture.md, the layer picture: cannot read {line!r} "
                "(a layer is 'L<n> <folder>/ [<depth>]  <what it holds>', continued indented)"
            )
    assert layers, "docs/architecture.md: no layer picture in section Layers"
    return layers


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str, layers: dict[str, Layer]) -> Layer:
    folder = "" if module in ROOT_MODULES else module.split(".")[0]
    if folder not in layers or (folder and module == folder and not (SRC / folder / "__init__.py").exists()):
        raise AssertionError(
            f"turbotrain.{module} is in no layer's folder: move it into the folder of its layer "
            "(the layer picture in docs/architecture.md names them)"
        )
    return layers[folder]


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
            base = node.module[len("turbotrain") :].lstrip(".")
        else:
            parts = package.split(".") if package else []
            up = node.level - 1
            parts = parts[: len(parts) - up] if up else parts
            base = ".".join(p for p in [*parts, *(node.module.split(".") if node.module else [])] if p)
        targets = []
        for alias in node.names:  # ``from . import bench`` names a submodule
            sub = f"{base}.{alias.name}" if base else alias.name
            targets.append(
                sub
                if (SRC / Path(*sub.split("."))).exists() or (SRC / f"{sub.replace('.', '/')}.py").exists()
                else base
            )
        return targets

    def visit(nodes: list[ast.stmt], where: str) -> None:
        for node in nodes:
            if isinstance(node, ast.ImportFrom):
                out.extend((t, node.lineno, where) for t in resolve(node))
            elif isinstance(node, ast.Import):
                out.extend(
                    (a.name[len("turbotrain") :].lstrip("."), node.lineno, where)
                    for a in node.names
                    if a.name.split(".")[0] == "turbotrain"
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


def test_every_module_sits_in_the_folder_of_its_layer():
    """Every module is in a layer's folder (or is the package root's __init__ / __main__), every
    folder of the package root is a layer's or data, and the picture names each module and
    package a layer folder holds, so ``ls`` and the picture show the same architecture."""
    layers = picture()
    assert sorted(l.number for l in layers.values()) == list(range(len(layers))), (
        "the layers are L0, L1, ... without gaps"
    )
    wrong = []
    for path in sorted(SRC.rglob("*.py")):
        module = module_name(path)
        if module not in ROOT_MODULES and (
            len(path.relative_to(SRC).parts) < 2 or module.split(".")[0] not in layers
        ):
            wrong.append(f"turbotrain.{module} is in no layer's folder: move it into the folder of its layer")
    folders = {
        p.name for p in SRC.iterdir() if p.is_dir() and p.name != "__pycache__" and p.name not in DATA_FOLDERS
    }
    wrong += [
        f"{f}/ is a folder of the package but no layer of the picture" for f in sorted(folders - set(layers))
    ]
    wrong += [f"the picture's {f}/ is no folder of the package" for f in sorted(set(layers) - folders - {""})]
    for folder, layer in sorted(layers.items()):
        if not folder:
            continue
        for child in sorted((SRC / folder).iterdir()):
            name = (
                child.stem
                if child.suffix == ".py"
                else child.name
                if (child / "__init__.py").exists()
                else None
            )
            if name and name != "__init__" and not re.search(rf"(?<![\w/]){re.escape(name)}\b", layer.text):
                wrong.append(
                    f"{folder}/{child.name}: the picture's L{layer.number} {folder}/ does not name {name}"
                )
    assert not wrong, "\n".join(wrong)


def test_imports_go_only_downward_and_never_late():
    layers = picture()
    wrong = []
    for module, imports in all_imports().items():
        me = layer_of(module, layers).number
        for target, line, where in imports:
            if where == "late":
                wrong.append(f"turbotrain.{module}:{line} imports turbotrain.{target} inside a function")
            elif target != module and layer_of(target, layers).number > me:
                wrong.append(
                    f"turbotrain.{module}:{line} (layer {me}) imports turbotrain.{target} "
                    f"(layer {layer_of(target, layers).number})"
                )
    assert not wrong, "\n".join(wrong)


def runtime_graph() -> dict[str, set[str]]:
    """module -> the turbotrain modules it imports when it runs (not under TYPE_CHECKING)."""
    return {
        m: {t for t, _, where in imports if where != "type-checking" and t != m}
        for m, imports in all_imports().items()
    }


def test_no_import_cycles():
    graph = runtime_graph()
    # A package's __init__ runs before its submodules: "cli" importing "cli.bench" is no cycle.
    state: dict[str, int] = {}
    cycles: list[str] = []

    def dfs(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*stack[stack.index(nxt) :], nxt]))
            elif nxt not in state:
                dfs(nxt, [*stack, nxt])
        state[node] = 2

    for m in sorted(graph):
        if m not in state:
            dfs(m, [m])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def longest_chains(graph: dict[str, set[str]], layers: dict[str, Layer]) -> dict[str, list[str]]:
    """Per layer folder, its longest chain of imports between modules of that layer (the first
    in sorted order among equally long ones; a cycle is cut where it closes, the test above
    reports it)."""
    best: dict[str, list[str]] = {}
    memo: dict[str, list[str]] = {}

    def chain(node: str, on_stack: frozenset[str]) -> list[str]:
        if node in memo:
            return memo[node]
        here = layer_of(node, layers).folder
        longest = [node]
        for nxt in sorted(graph.get(node, ())):
            if nxt not in on_stack and layer_of(nxt, layers).folder == here:
                candidate = [node, *chain(nxt, on_stack | {node})]
                if len(candidate) > len(longest):
                    longest = candidate
        memo[node] = longest
        return longest

    for m in sorted(graph):
        c = chain(m, frozenset())
        folder = layer_of(m, layers).folder
        if len(c) > len(best.get(folder, [])):
            best[folder] = c
    return best


def test_chains_inside_a_layer_are_no_deeper_than_the_picture_allows():
    """Inside a layer, modules may import each other, but in chains no longer than the number in
    brackets in the layer picture: a deeper chain is a layer growing a layer inside it."""
    layers = picture()
    wrong = []
    for folder, chain in sorted(longest_chains(runtime_graph(), layers).items()):
        layer = layers[folder]
        if len(chain) - 1 > layer.depth:
            wrong.append(
                f"L{layer.number} {folder or 'turbotrain'}/: a chain of {len(chain) - 1} imports, the picture "
                f"allows {layer.depth}: "
                + " -> ".join(f"turbotrain.{m}".rstrip(".") for m in chain)
                + " (flatten it, or raise the number in docs/architecture.md's picture and say why)"
            )
    assert not wrong, "\n".join(wrong)


FAKE_PICTURE = """# fake

## Layers

```
L3 turbotrain/ [0]  the package root
L2 tools/      [0]  memory/
L1 core/       [0]  engine
L0 base/       [{base_depth}]  errors, config, atomic, units
```
"""


def fake_tree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, files: dict[str, str], base_depth: int = 2
) -> None:
    fake = tmp_path / "turbotrain"
    for name, text in {
        "__init__.py": "",
        "base/__init__.py": "",
        "core/__init__.py": "",
        "tools/__init__.py": "",
        **files,
    }.items():
        (fake / name).parent.mkdir(parents=True, exist_ok=True)
        (fake / name).write_text(text)
    (tmp_path / "architecture.md").write_text(FAKE_PICTURE.format(base_depth=base_depth))
    monkeypatch.setattr(sys.modules[__name__], "SRC", fake)
    monkeypatch.setattr(sys.modules[__name__], "PICTURE", tmp_path / "architecture.md")


def test_the_checker_sees_late_upward_and_circular_imports(tmp_path, monkeypatch):
    """The checks above can fail: a late import, an upward import and a cycle are all caught."""
    fake_tree(
        tmp_path,
        monkeypatch,
        {
            "base/errors.py": "from ..core.engine import Engine\n",  # L0 -> L1: upward, and a cycle
            "core/engine.py": "from ..base.errors import X\n\ndef f():\n    from ..tools.memory import finder\n",
            "tools/memory/__init__.py": "",
            "tools/memory/finder.py": "",
        },
    )
    with pytest.raises(
        AssertionError, match="base.errors:1 .layer 0. imports turbotrain.core.engine .layer 1."
    ):
        test_imports_go_only_downward_and_never_late()
    with pytest.raises(
        AssertionError, match="core.engine:4 imports turbotrain.tools.memory.finder inside a function"
    ):
        test_imports_go_only_downward_and_never_late()
    with pytest.raises(AssertionError, match="base.errors -> core.engine -> base.errors"):
        test_no_import_cycles()


def test_the_checker_sees_a_module_outside_the_layer_folders_and_a_folder_outside_the_picture(
    tmp_path, monkeypatch
):
    fake_tree(
        tmp_path,
        monkeypatch,
        {
            "stray.py": "",
            "base/errors.py": "",
            "base/config.py": "",
            "base/atomic.py": "",
            "base/units.py": "",
            "base/launch.py": "",
            "core/engine.py": "",
            "tools/memory/__init__.py": "",
            "misc/__init__.py": "",
        },
    )
    with pytest.raises(AssertionError) as caught:
        test_every_module_sits_in_the_folder_of_its_layer()
    assert "turbotrain.stray is in no layer's folder" in str(caught.value)
    assert "misc/ is a folder of the package but no layer of the picture" in str(caught.value)
    assert "base/launch.py: the picture's L0 base/ does not name launch" in str(caught.value)
    with pytest.raises(AssertionError, match=r"turbotrain.(stray|misc) is in no layer's folder"):
        test_imports_go_only_downward_and_never_late()


def test_the_checker_sees_a_chain_inside_a_layer_deeper_than_the_picture(tmp_path, monkeypatch):
    """errors <- config <- atomic <- units is a chain of 3 imports inside L0: allowed at [3], not at [2]
    (a TYPE_CHECKING import, a late one and an import of a lower layer do not lengthen it)."""
    files = {
        "base/errors.py": "",
        "base/config.py": "from .errors import E\n",
        "base/atomic.py": "from .config import C\n",
        "base/units.py": "from .atomic import A\n",
        "core/engine.py": "from typing import TYPE_CHECKING\nfrom ..base.units import U\n"
        "if TYPE_CHECKING:\n    from ..base import units\n",
        "tools/memory/__init__.py": "from ...core.engine import Engine\n",
    }
    fake_tree(tmp_path, monkeypatch, files, base_depth=3)
    test_chains_inside_a_layer_are_no_deeper_than_the_picture_allows()
    assert longest_chains(runtime_graph(), picture())["base"] == [
        "base.units",
        "base.atomic",
        "base.config",
        "base.errors",
    ]
    fake_tree(tmp_path, monkeypatch, files, base_depth=2)
    with pytest.raises(
        AssertionError,
        match=r"L0 base/: a chain of 3 imports, the picture allows 2: "
        r"turbotrain.base.units -> turbotrain.base.atomic -> turbotrain.base.config "
        r"-> turbotrain.base.errors",
    ):
        test_chains_inside_a_layer_are_no_deeper_than_the_picture_allows()


HEAVY = (
    "turbotrain.tools.memory",
    "turbotrain.tools.memory.finder",
    "turbotrain.tools.memory.stats",
    "turbotrain.app.bench",
    "turbotrain.app.report",
    "turbotrain.app.training",
    "turbotrain.app.doctor",
    "matplotlib",
    "turbotrain.app.measure",
    "turbotrain.app.profile",
    "turbotrain.app.tune",
    "optuna",
    "torchao",
    "transformers",
)
# ~0.7 s of a 2.8 s import (issue 22): imported where an fsdp run, a sharded checkpoint or a
# progress bar needs them, never by a one-process Engine
DISTRIBUTED_HEAVY = (
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "rich.progress",
)

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


@pytest.mark.slow
def test_import_turbotrain_stays_light():
    """``import turbotrain`` (the Engine and fit) loads none of the tools, the report, matplotlib,
    FSDP/DTensor/DCP or rich.progress; nor does a one-process Engine's setup, forward and backward.
    (A torch optimizer is left out: its constructor imports torch._dynamo, which imports FSDP.)"""
    out = subprocess.run(
        [sys.executable, "-c", LIGHT_RUN], capture_output=True, text=True, check=True
    ).stdout.split("\n")
    assert out[0] == "[]", f"import turbotrain loaded {out[0]}"
    assert out[1] == "[]", f"a one-process Engine loaded {out[1]}"
