"""The public API (what ``import turbotrain`` exports, docs/api.md) and the old module paths of the
layout before the per-layer folders: each still imports, as the same object, with one
DeprecationWarning that names the import to write instead (issue 32 item 5)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from conftest import HANG_S

import turbotrain

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "turbotrain"

# What the README told users before the relayout (git show d919ea6^:README.md), as written.
DOCUMENTED_BEFORE = {
    "from turbotrain.workload import Workload": ("Workload", "from turbotrain import Workload"),
    "from turbotrain.tracking import track": ("track", "from turbotrain import track"),
    "from turbotrain.engine import Engine": ("Engine", "from turbotrain import Engine"),
    "from turbotrain.config import RunConfig": ("RunConfig", "from turbotrain import RunConfig, load_config"),
    "from turbotrain.optim import PlateauLR": ("PlateauLR", "from turbotrain import PlateauLR"),
    "from turbotrain.models.moe import aux_loss": (
        "aux_loss",
        "from turbotrain import MoE, aux_loss, end_optimizer_step",
    ),
}

SCRIPT = """
import importlib, json, sys, warnings
import turbotrain
out = {}
for old in sys.argv[1:]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module("turbotrain." + old)
    now = turbotrain.moved_to("turbotrain." + old)[1]
    out[old] = {"same": module is importlib.import_module(now) and getattr(turbotrain, old) is module,
                "warnings": [f"{w.category.__name__}: {w.message}" for w in caught]}
# a submodule of an old package is the same module, not a second copy loaded from the old path
import turbotrain.models.moe.layer as old_layer, turbotrain.parts.models.moe.layer as layer
out["submodule"] = [old_layer is layer, sys.modules["turbotrain.models.moe.layer"] is layer, layer.__spec__.name]
print(json.dumps(out))
"""


@pytest.mark.slow
def test_every_old_module_and_submodule_imports_as_the_same_module_with_one_warning_naming_the_new_path():
    names = sorted(turbotrain.MOVED)
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, *names], capture_output=True, text=True, timeout=HANG_S
    )
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.splitlines()[-1])
    assert seen.pop("submodule") == [True, True, "turbotrain.parts.models.moe.layer"]
    for old in names:
        new, advice = turbotrain.MOVED[old]
        assert seen[old]["same"], f"turbotrain.{old} is not the module turbotrain.{new}"
        mine = [w for w in seen[old]["warnings"] if f"turbotrain.{old} moved" in w]
        assert mine == [
            f"DeprecationWarning: turbotrain.{old} moved to turbotrain.{new} (turbotrain {turbotrain.__version__}); "
            f"write `{advice}`: the old path goes in the next release"
        ], seen[old]["warnings"]


def test_every_module_moved_inside_a_layer_imports_as_the_same_module_with_one_warning(monkeypatch):
    """turbotrain.MOVED_INSIDE (e.g. turbotrain.loop.sharded, now turbotrain.loop.checkpoint): every
    one, in this process (their packages are imported already; the old name is not)."""
    assert turbotrain.MOVED_INSIDE
    for old, (new, advice) in turbotrain.MOVED_INSIDE.items():
        monkeypatch.delitem(sys.modules, f"turbotrain.{old}", raising=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = importlib.import_module(f"turbotrain.{old}")
        assert module is importlib.import_module(f"turbotrain.{new}")
        assert [f"{w.category.__name__}: {w.message}" for w in caught] == [
            f"DeprecationWarning: turbotrain.{old} moved to turbotrain.{new} (turbotrain {turbotrain.__version__}); "
            f"write `{advice}`: the old path goes in the next release"
        ]


@pytest.mark.slow
def test_the_documented_old_imports_in_a_users_script_work_and_each_warning_points_at_its_line(tmp_path):
    """What the user sees: their script runs, gets the public objects, and Python's default filter
    shows each warning at their own import line (a warning attributed to importlib would be hidden)."""
    statements = sorted(DOCUMENTED_BEFORE)
    script = tmp_path / "old_script.py"
    script.write_text(
        "import turbotrain\n"
        + "".join(f"{s}\n" for s in statements)
        + "".join(f"assert {name} is turbotrain.{name}\n" for name, _ in DOCUMENTED_BEFORE.values())
        + "print('ok')\n"
    )
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=HANG_S)
    assert run.returncode == 0 and run.stdout == "ok\n", run.stderr[-2000:]
    warnings = [line for line in run.stderr.splitlines() if "DeprecationWarning" in line]
    assert len(warnings) == len(statements), run.stderr
    for line, (statement, warning) in enumerate(zip(statements, warnings), start=2):
        old = statement.split()[1].split(".")[1]
        assert warning.startswith(f"{script}:{line}: DeprecationWarning: turbotrain.{old} moved to "), warning
        assert f"write `{DOCUMENTED_BEFORE[statement][1]}`" in warning, warning


def test_the_old_names_shadow_no_module_and_point_at_modules_that_exist():
    """The finder runs before the path finder: an old name that became a real module again would
    hide it, and a target that moved again would be a ModuleNotFoundError behind a warning."""
    for old, (new, _) in turbotrain.MOVED.items():
        assert not (SRC / old).exists() and not (SRC / f"{old}.py").exists(), (
            f"turbotrain.{old} exists again: drop it from MOVED"
        )
        path = SRC / Path(*new.split("."))
        assert path.with_suffix(".py").is_file() or (path / "__init__.py").is_file(), (
            f"turbotrain.{new} does not exist"
        )
    assert (
        turbotrain.moved_to("turbotrain.base.config") is None and turbotrain.moved_to("torch.config") is None
    )


def test_the_public_names_resolve_and_an_unknown_one_is_an_attribute_error():
    for name in turbotrain.__all__:
        assert getattr(turbotrain, name) is not None
    assert set(turbotrain.__all__) <= set(dir(turbotrain))  # what tab completion offers
    assert not {"sys", "warnings", "importlib", "Any"} & set(dir(turbotrain))
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        turbotrain.nope  # noqa: B018


def test_docs_api_lists_every_public_name_and_every_old_module():
    text = (ROOT / "docs" / "api.md").read_text()
    missing = [n for n in turbotrain.__all__ if f"`{n}`" not in text]
    missing += [
        f"turbotrain.{old}"
        for old in turbotrain.MOVED
        if f"turbotrain.{old}" not in text and f"`{old}`" not in text
    ]
    assert not missing, f"docs/api.md does not list {missing}"
    assert "(docs/api.md)" in (ROOT / "README.md").read_text(), "the README links docs/api.md"


def test_every_name_an_old_module_path_gave_still_imports_from_it():
    """The names each old module gave (its module-level definitions at d919ea6^, less those already
    gone at 3cdcec4: tests/unit/old_module_names.json) resolve through its old path, which is the
    module now: a refactor that drops one breaks `from turbotrain.doctor import Check` and the like."""
    given = json.loads((Path(__file__).parent / "old_module_names.json").read_text())
    assert set(given) <= set(turbotrain.MOVED) and len(given) >= 40
    lost = {
        f"turbotrain.{old}": missing
        for old, names in given.items()
        for module in [importlib.import_module(f"turbotrain.{turbotrain.MOVED[old][0]}")]
        if (missing := [name for name in names if not hasattr(module, name)])
    }
    assert not lost, f"names the old paths gave, gone: {lost}"
