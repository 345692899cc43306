"""A run resolved once, and the one call from Python (issue 33 item 3, issue 37 item 3).

``turbotrain train`` prepares its run once per process: the parallel plan is resolved and joined
once, the model spec is made once and a workload's FUNC is called once. ``turbotrain.train()``
from Python trains a workload to the same losses as ``turbotrain train --model`` with the same
settings, evaluates and predicts with the trained model, and gets the automatic restart of a
requeued job (resume, restart record) as the command does."""

from __future__ import annotations

import gc
import importlib.util
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import turbotrain
from turbotrain.base.errors import ConfigError
from turbotrain.cli import main
from turbotrain.core.plan import ParallelPlan

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CNN = EXAMPLES / "workload_cnn.py"
QUICK = {  # the same settings for the command line and for Python
    "train.max_steps": 6,
    "train.eval_every": 3,
    "train.checkpoint_every": 3,
    "train.eval_batches": 2,
    "monitor.log_every": 3,
    "monitor.progress": False,
}


def _flags(settings: dict[str, Any]) -> list[str]:
    return [f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in settings.items()]


def _sections(settings: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for key, value in settings.items():
        section, _, name = key.partition(".")
        out.setdefault(section, {})[name] = value
    return out


def _losses(run: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def _cnn_module() -> Any:
    """examples/workload_cnn.py as a module (its ``make`` is what a notebook would pass)."""
    spec = importlib.util.spec_from_file_location("workload_cnn", CNN)
    assert spec is not None and spec.loader is not None
    module = sys.modules.get("workload_cnn") or importlib.util.module_from_spec(spec)
    if "workload_cnn" not in sys.modules:
        sys.modules["workload_cnn"] = module
        spec.loader.exec_module(module)
    return module


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts, in this process, the plan resolutions and the model specs made: every spec class,
    wherever a module names it, replaced by a subclass that counts (a join of a plan joined
    already is a no-op the strategy may ask for: not counted)."""
    counts = {"resolve": 0, "spec": 0}
    resolve = ParallelPlan.resolve.__func__  # type: ignore[attr-defined]

    def counted_resolve(cls: type, *args: Any, **kwargs: Any) -> ParallelPlan:
        counts["resolve"] += 1
        return resolve(cls, *args, **kwargs)

    monkeypatch.setattr(ParallelPlan, "resolve", classmethod(counted_resolve))
    # by name, not identity: a test that reloads turbotrain's modules leaves classes of both ages
    modules = [m for name, m in list(sys.modules.items()) if name.startswith("turbotrain.")]
    classes: dict[type, type] = {}
    for module in modules:
        for value in vars(module).values():
            if isinstance(value, type) and value.__name__ != "ModelSpec" and _is_spec(value):
                classes.setdefault(value, _counting(value, counts))
    for module in modules:  # the names of the classes, and the registries (dicts) that hold them
        for attr, value in list(vars(module).items()):
            if isinstance(value, type) and value in classes:
                monkeypatch.setattr(module, attr, classes[value])
            elif isinstance(value, dict):
                for key, item in list(value.items()):
                    if isinstance(item, type) and item in classes:
                        monkeypatch.setitem(value, key, classes[item])
    return counts


def _is_spec(cls: type) -> bool:
    return any(base.__name__ == "ModelSpec" for base in cls.__mro__)


def _counting(cls: type, counts: dict[str, int]) -> type:
    """A subclass of ``cls`` that counts its instances in ``counts['spec']``."""

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        counts["spec"] += 1
        cls.__init__(self, *args, **kwargs)

    return type(cls.__name__, (cls,), {"__init__": init})


def _open_token_files() -> set[str]:
    """The token files (``*.bin``) this process holds open."""
    fds = Path("/proc/self/fd")
    names = set()
    for fd in fds.iterdir() if fds.is_dir() else ():
        try:
            names.add(str(fd.readlink()))
        except OSError:  # closed meanwhile (the listing's own descriptor)
            continue
    return {name for name in names if name.endswith(".bin")}


def test_turbotrain_train_resolves_the_plan_and_the_spec_once(tmp_path: Path, counted: dict[str, int]):
    tiny = ["--preset", "gpt-tiny", "--model.n_layer=1", "--model.d_model=32", "--model.n_head=2"]
    args = ["--train.max_steps=2", "--train.eval_every=0", "--no-progress", "--run.out_dir", str(tmp_path)]
    before = _open_token_files()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        assert main(["train", *tiny, *args]) == 0
        gc.collect()  # what a reference cycle holds is finalised here, not in a later test
    assert counted == {"resolve": 1, "spec": 1}
    # the run's token file is closed when it ends, not left to the garbage collector (issue 45 item 1:
    # an "unclosed file .../bytes-*.bin" ResourceWarning, an open descriptor per run in a notebook)
    assert [str(w.message) for w in caught if ".bin" in str(w.message)] == []
    if Path("/proc/self/fd").is_dir():
        assert _open_token_files() - before == set()

    # a workload: the same, and its FUNC is called once (the spec builds it once for data, model, loss)
    workload = tmp_path / "counted_workload.py"
    workload.write_text(
        f"import sys\nsys.path.insert(0, {str(EXAMPLES)!r})\nimport workload_cnn\nCALLS = []\n\n"
        "def make():\n    CALLS.append(1)\n    return workload_cnn.make()\n"
    )
    counted.update(resolve=0, spec=0)
    assert main(["train", "--model", f"{workload}:make", *args, "--train.eval_every=2"]) == 0
    assert counted == {"resolve": 1, "spec": 1}
    assert sys.modules["counted_workload"].CALLS == [1]


def test_train_from_python_matches_the_command_evaluates_and_predicts(tmp_path: Path):
    cli = [
        "train",
        "--model",
        f"{CNN}:make",
        *_flags(QUICK),
        "--run.out_dir",
        str(tmp_path),
        "--run.name=cli",
    ]
    assert main(cli) == 0
    cnn = _cnn_module()
    sections = _sections(QUICK)
    run = turbotrain.train(cnn.make, out_dir=str(tmp_path), name="py", **sections)
    assert run["status"] == "completed" and run["steps"] == 6 and run.run_dir == tmp_path / "py"
    assert _losses(tmp_path / "py") == _losses(tmp_path / "cli")  # the same steps to the bit
    command = json.loads((tmp_path / "cli" / "summary.json").read_text())
    assert run["final_val_loss"] == command["final_val_loss"]
    assert run["final_val_accuracy"] == command["final_val_accuracy"]
    assert (tmp_path / "py" / "summary.md").is_file()  # the report, as the command writes it
    # the last evaluation's batches: the same loss and accuracy through evaluate, and predict's argmax
    batches = list(cnn.make().eval_loader)[: QUICK["train.eval_batches"]]
    got = run.evaluate(batches)
    assert got["loss"] == pytest.approx(run["final_val_loss"], rel=1e-6)
    assert got["accuracy"] == pytest.approx(run["final_val_accuracy"], rel=1e-6)
    outputs = run.predict(batches)
    assert [o.shape for o in outputs] == [torch.Size([64, 10])] * len(batches)
    right = sum((o.argmax(1) == y).sum().item() for o, (_, y) in zip(outputs, batches))
    assert right / (64 * len(batches)) == pytest.approx(got["accuracy"], rel=1e-6)
    assert run.engine.precision.name == run["resolved"]["precision"]

    with pytest.raises(ConfigError, match="mode= is a field of several sections"):
        turbotrain.train(cnn.make, mode="fp32")  # two sections have a field 'mode': said in one line


def test_a_requeued_job_resumes_its_run_from_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys):
    """The restart logic sits below the command line: a script that calls turbotrain.train() in a
    SLURM job that is requeued continues its run by itself, records the restart, and ends at the
    losses of the run that was never stopped."""
    cnn = _cnn_module()
    sections = _sections(QUICK)
    full = turbotrain.train(cnn.make, out_dir=str(tmp_path), name="full", **sections)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    first = turbotrain.train(cnn.make, out_dir=str(tmp_path), name="job", stop_after_steps=3, **sections)
    assert (
        first["steps"] == 3
        and json.loads((tmp_path / "job" / ".launch.json").read_text())["slurm_job"] == "4242"
    )
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # SLURM requeued the job: the same call again
    capsys.readouterr()
    again = turbotrain.train(cnn.make, out_dir=str(tmp_path), name="job", stop_after_steps=3, **sections)
    assert "resuming" in capsys.readouterr().out
    assert again["steps"] == 6 and again["resumed_from"] == "step_00000003.pt"
    assert _losses(tmp_path / "job") == _losses(tmp_path / "full")
    assert again["final_val_loss"] == full["final_val_loss"]
    restarts = [
        json.loads(line)
        for line in (tmp_path / "job" / "metrics.jsonl").read_text().splitlines()
        if '"restart"' in line
    ]
    assert [(r["step"], r["why"]) for r in restarts] == [(3, "SLURM requeued the job: SLURM_RESTART_COUNT=1")]
