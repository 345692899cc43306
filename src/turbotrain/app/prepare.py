"""A run resolved once, before anything is built (docs/architecture.md, "The prepared run"): a
:class:`PreparedRun`, which the assembly (:mod:`turbotrain.app.training`) builds from. :func:`start`
is the one place of the start-of-run decisions; nothing re-settles the config after it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..base.config import RunConfig, load_config, read_preset
from ..base.config_fields import said
from ..base.config_plugins import Start, start_hooks
from ..base.errors import ConfigError
from ..base.launch import Launch, Topology
from ..base.rundir import CHECKPOINTS, find_run_dir, new_run_dir, resume_config, run_name
from ..base.seeds import seed_all
from ..base.signals import StopSignals
from ..core.device import local_device, resolve_device
from ..core.engine import default_loss
from ..core.main_rank import decided_by_main
from ..core.plan import ParallelPlan
from ..loop.checkpoint import checkpoint_step, latest_verified
from ..loop.hooks import Hook
from ..parts.hardware import ram_bytes
from ..parts.models.registry import spec_for
from ..parts.models.spec import LossFn, ModelSpec, RunData
from ..parts.models.workload_spec import WorkloadSpec
from ..parts.workload import Workload
from .restart import keep_global_batch, named_for_restarts, relaunched_run
from .resume import local_copy, stored_run

Overrides = Mapping[str, Mapping[str, Any]]
# what trains: FILE.py:FUNC (or package.module:FUNC), FUNC itself, or a Workload built already
WorkloadLike = str | Callable[[], Any] | Workload


class StoppedBySignal(KeyboardInterrupt):
    """SIGTERM or SIGINT before the first step (a KeyboardInterrupt: no ``except Exception`` swallows it)."""

    def __init__(self, signame: str, run_dir: Path | None, resumable: bool) -> None:
        self.signame, self.run_dir, self.resumable = signame, run_dir, resumable
        super().__init__(self.line(f"--resume {run_dir or ''}".rstrip()))

    def line(self, resume: str) -> str:
        """The line that says so; ``resume``: the command that continues the run."""
        then = f"continue with {resume}" if self.resumable else "nothing was written; start it again"
        return f"stopped by {self.signame} during start-up, before the first step; {then}"


def stop_startup(name: str, run_dir: Path | None, resumable: bool) -> None:
    raise StoppedBySignal(name, run_dir, resumable)


def default_preset() -> str:
    """gpt2-small on a GPU, gpt-tiny (a few minutes) on CPU."""
    return "gpt2-small" if torch.cuda.is_available() else "gpt-tiny"


@dataclass(frozen=True)
class RunRequest:
    """What a caller asks to train."""

    preset: str | None = None  # a name or .toml path; None: the device's default (a workload: none)
    overrides: Overrides = field(default_factory=dict)  # {section: {key: value}}
    resume: str | None = None  # None: a new run; "": run.name, else the newest; or a run name or folder
    workload: WorkloadLike | None = None  # None: the preset's GPT
    relaunch: str = ""  # why a resume is its launcher's restart of the run (recorded as torchrun's are)
    # more hooks, made from the prepared run, after its own (integrations.ray reports checkpoints to Ray)
    hooks: Callable[[PreparedRun], Sequence[Hook]] | None = None

    @property
    def base_preset(self) -> str | None:
        """The preset of a new run: ``preset``, else the device's default (none for a workload)."""
        return self.preset or (None if self.workload is not None else default_preset())


@dataclass
class PreparedRun:
    """A run resolved once (see the module docstring)."""

    config: RunConfig  # as given (config.toml's): 'auto' stays unless a start decision settles it
    settings: RunConfig  # what it trains with: batch.global_size split into accumulation
    plan: ParallelPlan  # resolved and joined
    spec: ModelSpec
    device: torch.device  # this process's device
    run_dir: Path
    resume: bool = False
    relaunch: str = ""  # why this start continues its run by itself ("" when it does not)
    recorded: dict[str, Any] | None = None  # the job record of the start a relaunch continues
    batch_given: bool = False  # a resume whose command sets the batch (not refused at another world size)
    hooks: Callable[[PreparedRun], Sequence[Hook]] | None = None  # RunRequest.hooks
    starts: Sequence[PrepareStart] = ()  # the preparation's start hooks (:func:`start`), called once
    ends: Sequence[Callable[[], Any]] = ()  # what they do once the run has trained (train_prepared)

    @property
    def main(self) -> bool:
        """Rank 0: it alone writes the run's shared files and prints."""
        return self.plan.rank == 0


@dataclass(frozen=True)
class Begun:
    """What a start hook of the preparation decided."""

    changes: Overrides = field(default_factory=dict)  # to the config as given and its settings (choose's)
    end: Callable[[], Any] | None = None  # called once the run has trained (the compile warm start's save)


# a start hook of the preparation: the prepared run (its decisions so far) and its settings -> Begun
PrepareStart = Callable[[PreparedRun, RunConfig], Begun]


def prepare_run(
    request: RunRequest, signals: StopSignals, starts: Sequence[PrepareStart] = ()
) -> PreparedRun:
    """The run ``request`` asks for, resolved once in this process, with the preparation's start
    hooks ``starts``. A mistake raises a ConfigError on every rank, before any joins the process group."""
    topology = Topology.from_env()
    signals.on_first(lambda name: stop_startup(name, None, request.resume is not None))
    make, overrides = _request_overrides(request)
    base, found, relaunch, recorded = _starting_config(request, overrides, topology)
    resume = found is not None
    if found is not None:
        signals.on_first(lambda name: stop_startup(name, found, True))
    spec = WorkloadSpec(base.model.workload, make=make) if make is not None else spec_for(base)
    if not resume and isinstance(spec, WorkloadSpec) and not _micro_given(request, overrides):
        base = base.replace(batch={"micro": spec.micro_batch(base.run.seed) or base.batch.micro})
    plan, device = _plan_and_join(base, topology, spec)
    # Rank 0 finds or names the run (a timestamped name, a resumed run's saved config); all use its answer.
    run_dir, config = decided_by_main(lambda: (found, base) if found is not None else _new_run(base))
    # a resume at another world size keeps the checkpoint's global batch unless the command sets the batch
    # (a relaunch repeats the first start's command: its batch settings are no choice made for this resume)
    batch_set = {"micro", "global_size", "accumulation"} & set(overrides.get("batch", {}))
    given = resume and not relaunch and bool(batch_set)
    return PreparedRun(
        config, resolve_accumulation(config, plan), plan, spec, device, run_dir, resume, relaunch, recorded,
        given, request.hooks, starts,
    )  # fmt: skip


def _starting_config(
    request: RunRequest, overrides: dict[str, dict[str, Any]], topology: Topology
) -> tuple[RunConfig, Path | None, str, dict[str, Any] | None]:
    """The config the run starts from; for a resume (asked, or a relaunched or stored run continuing
    by itself) its folder, why a relaunch continues it and the job record it keeps."""
    launch = Launch.from_env()
    resume_at, relaunch, recorded = request.resume, request.relaunch, None
    if resume_at is None:
        fresh = load_config(request.base_preset, overrides)
        found = relaunched_run(fresh, topology, launch)
        stored = stored_run(fresh) if found is None else None
        if found is None and stored is None:
            return named_for_restarts(fresh, launch), None, "", None
        found_dir, relaunch, recorded = found or (stored, "", None)
        resume_at = str(found_dir)
        overrides.get("run", {}).pop("name", None)  # named by the path now
    # the run to resume (named, or run.name, in run.out_dir, else the latest there) and its saved config with
    # the overrides applied, validated as a whole (not against a preset it never used): what the resume trains
    given = overrides.get("run", {})
    out_dir = given.get("out_dir") or load_config(request.preset or default_preset()).run.out_dir
    if "://" in resume_at:  # a run in a store (run.remote): its local copy, fetched when not here
        resume_at = str(local_copy(resume_at, out_dir))
    run_dir = find_run_dir(out_dir, resume_at or given.get("name", ""))
    base = resume_config(run_dir, overrides)
    if relaunch:
        base = keep_global_batch(base, recorded, topology)
    return base, run_dir, relaunch, recorded


def _request_overrides(
    request: RunRequest,
) -> tuple[Callable[[], Any] | Workload | None, dict[str, dict[str, Any]]]:
    """(the live workload or FUNC, the overrides with its reference), refusing what a resume cannot take."""
    overrides = {section: dict(values) for section, values in request.overrides.items()}
    ref, make = _workload_ref(request.workload)
    if ref and request.resume is not None and make is None:
        raise ConfigError(
            said("--model", "a workload") + " names the workload of a new run; a resume trains the run's own "
            "(its config.toml's model.workload): "
            + said("leave --model out", "call turbotrain.train(resume=...) without one")
        )
    if ref and request.resume is None:
        overrides.setdefault("model", {})["workload"] = ref
    if request.resume and "name" in overrides.get("run", {}):
        raise ConfigError(
            "name the run to resume once: "
            + said("--resume RUN or --resume --run.name NAME", "resume=RUN or run.name, with resume=True")
            + ", not both"
        )
    return make, overrides


def prepare_config(
    config: RunConfig,
    run_dir: Path | None = None,
    *,
    resume: bool = False,
    batch_given: bool = False,
    workload: WorkloadLike | None = None,
) -> PreparedRun:
    """A run of ``config`` as it is (no preset, relaunch search or start hooks) in ``run_dir`` (else
    one named by rank 0): what ``training.train(config)``, ``measure`` and tune trials prepare."""
    _, make = _workload_ref(workload)
    spec = WorkloadSpec(config.model.workload, make=make) if make is not None else spec_for(config)
    plan, device = _plan_and_join(config, None, spec)
    if run_dir is None:
        run_dir = decided_by_main(lambda: new_run_dir(config))
    settings = resolve_accumulation(config, plan)
    return PreparedRun(config, settings, plan, spec, device, run_dir, resume, batch_given=batch_given)


def prepare_process(config: RunConfig) -> tuple[RunConfig, ParallelPlan, torch.device]:
    """Settings, joined plan and device of a model the caller built, with no run directory (bench's)."""
    plan, device = _plan_and_join(config, None, None)
    return resolve_accumulation(config, plan), plan, device


@dataclass(frozen=True)
class Started:
    """What :func:`start` decided: the run as started, its settings, its model, facts for ``resolved``."""

    run: PreparedRun
    config: RunConfig
    model: nn.Module
    facts: dict[str, Any]


def start(run: PreparedRun, config: RunConfig, data: RunData, loss_fn: LossFn | None) -> Started:
    """The start-of-run decisions, the data open: the preparation's start hooks (once per run: a
    restart does not call them again), then the generators seeded (nothing a hook measured draws
    from the run's), then the plugins' (:func:`~turbotrain.base.config_plugins.register_start`):
    ``build`` hooks decide the config the model is built from, ``settle`` hooks the final settings."""
    ends = list(run.ends)
    for begin in run.starts:  # in order: each one's changes go to the config as given, settings and config
        begun = begin(run, config)
        if begun.changes:
            changes = begun.changes
            run = dataclasses.replace(
                run, config=run.config.replace(**changes), settings=run.settings.replace(**changes)
            )
            config = config.replace(**changes)
        if begun.end is not None:
            ends.append(begun.end)
    run = dataclasses.replace(run, starts=(), ends=tuple(ends))
    seed_all(config.run.seed)  # torch, random and numpy: a user's model or loss may draw from any of them
    hooks = start_hooks(config)
    at = Start(config, run.run_dir, run.device, lambda: _resume_step(run))
    built = config
    for hook in hooks:
        built = hook.build(dataclasses.replace(at, config=built)) if hook.build else built
    model = run.spec.build(built, data)
    at = dataclasses.replace(at, model=model, example=data.example, loss_fn=loss_fn or default_loss)
    facts: dict[str, Any] = {}
    for hook in hooks:
        if hook.settle is not None:
            config, more = hook.settle(dataclasses.replace(at, config=config))
            facts.update(more)
    return Started(run, config, model, facts)


def _resume_step(run: PreparedRun) -> int:
    """The step of the newest checkpoint that verifies (the one a resume loads); 0: none, a new run."""
    if not run.resume:
        return 0
    usable = latest_verified(run.run_dir / CHECKPOINTS)  # remembered: the resume does not hash it again
    return checkpoint_step(usable) if usable is not None else 0


def _plan_and_join(
    config: RunConfig, topology: Topology | None, spec: ModelSpec | None
) -> tuple[ParallelPlan, torch.device]:
    """This process's plan (:func:`plan_run`; no spec: strategy and batch only), joined on its device."""
    if spec is None:
        plan = ParallelPlan.resolve(config.distributed, topology)
        resolve_accumulation(config, plan)  # its mistakes, before any process joins
    else:
        _, plan = plan_run(config, topology, spec)
    device = local_device(resolve_device(config.run.device), plan.topology)
    plan.join(device)
    return plan, device


def plan_run(
    config: RunConfig, topology: Topology | None = None, spec: ModelSpec | None = None
) -> tuple[RunConfig, ParallelPlan]:
    """``config`` checked against the launch, and its parallel plan, without any communication: every
    rank finds the same mistake before joining the process group. ``spec``: None: the config's."""
    spec = spec or spec_for(config)
    plan = ParallelPlan.resolve(config.distributed, topology, spec.experts(config))
    # weights alone past this machine's memory (sizes each in range can multiply into that): one line
    total, _ = ram_bytes()
    count = spec.weight_count(config)
    if total and 4 * count > total:
        raise ConfigError(
            f"the model config describes at least {count:,} parameters: {4 * count / 2**30:,.1f} "
            f"GiB of float32 weights alone, more than this machine's {total / 2**30:,.1f} GiB of memory; make "
            "model.n_layer, model.d_model, moe.n_experts or moe.expert_hidden smaller"
        )
    return resolve_accumulation(config, plan), plan


def resolve_accumulation(config: RunConfig, plan: ParallelPlan) -> RunConfig:
    """``config`` with the accumulation ``batch.global_size`` asks for over the plan's data dimension
    (unchanged without one, or with ``batch.micro = 'auto'``: the search decides)."""
    b = config.batch
    if not isinstance(b.micro, int):
        return config
    accumulation = plan.accumulation_for(b.micro, b.global_size, b.accumulation)
    return config if accumulation == b.accumulation else config.replace(batch={"accumulation": accumulation})


def _workload_ref(workload: WorkloadLike | None) -> tuple[str, Callable[[], Any] | Workload | None]:
    """(the ``model.workload`` the config records, the live workload or FUNC; None for a reference).
    A FUNC is recorded as FILE.py:FUNC or module:FUNC, so that ``--resume`` can import it again."""
    if workload is None:
        return "", None
    if isinstance(workload, str):
        return workload, None
    if isinstance(workload, Workload):
        return workload.source or "python:Workload", workload
    if not callable(workload):
        raise ConfigError(
            f"train() takes FILE.py:FUNC, a function that returns a turbotrain.Workload, or a Workload; "
            f"not a {type(workload).__name__}"
        )
    module, name = getattr(workload, "__module__", "") or "", getattr(workload, "__qualname__", "workload")
    source = None
    if "." not in module and inspect.isfunction(workload):  # a script's (or __main__'s): by its file
        with contextlib.suppress(TypeError):
            source = inspect.getsourcefile(workload)
    if source is not None and not Path(source).is_file():
        source = None  # code typed in (python -c, a notebook cell): no file to import it from
    return (f"{source}:{name}" if source else f"{module or 'python'}:{name}"), workload


def _micro_given(request: RunRequest, overrides: Mapping[str, Mapping[str, Any]]) -> bool:
    """Whether the request or its preset sets ``batch.micro`` (else a workload's loader does)."""
    preset = request.base_preset
    return "micro" in overrides.get("batch", {}) or (
        preset is not None and "micro" in read_preset(preset).get("batch", {})
    )


def _new_run(base: RunConfig) -> tuple[Path, RunConfig]:
    """A new run's directory and config, its automatic name fixed once."""
    config = base.replace(run={"name": run_name(base)})
    return new_run_dir(config), config
