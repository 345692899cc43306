"""A resume: the newest finished checkpoint loaded, the data position after it and the schedule
re-planned; a global batch changed unasked, or one that would lose an epochs run's place, refused."""

from __future__ import annotations

import logging
import shutil
import time
import tomllib
from pathlib import Path
from typing import Any

from torch.optim.lr_scheduler import LambdaLR

from ..base.config import RunConfig, setting
from ..base.config_fields import said
from ..base.errors import TurbotrainError
from ..base.launch import Topology
from ..base.rundir import CHECKPOINTS, CONFIG_FILE
from ..base.storage import Store, why
from ..core.engine import Engine
from ..core.main_rank import ReportedByMainRank
from ..loop.checkpoint import RunState, finished_checkpoints, restore_latest
from ..loop.checkpoint import saved_world as saved_world_of
from ..loop.checkpoint.remote import fetch_run
from ..parts.data.batching import processes
from ..parts.models.spec import RunData

log = logging.getLogger(__name__)


def resume_from(
    c: RunConfig,
    run_dir: Path,
    state: RunState,
    engine: Engine,
    data: RunData,
    batch_given: bool,
    scheduler: Any = None,
) -> str:
    """Load ``run_dir``'s newest finished checkpoint, seek the data past it, re-plan; its name or ""."""
    rank, world = engine.strategy.rank, engine.strategy.world
    if not finished_checkpoints(run_dir / CHECKPOINTS):
        log.info(
            "%s has no finished checkpoint (it stopped before its first one): training from step 0", run_dir
        )
        return ""

    saved_configs: list[Any] = []

    def same_batch(path: Path, written_by: int, saved: dict[str, Any]) -> None:  # before anything loads
        saved_configs.append(saved.get("config"))
        # an epoch's steps are counted at the checkpoint's global batch, whatever the command asks
        if c.train.epochs:
            check_epochs_batch(path.name, saved.get("config"), written_by, c, world, rank)
        if data.split_invariant and not batch_given:
            check_resume_batch(path.name, saved.get("config"), written_by, c, world, rank)

    resumed = restore_latest(run_dir / CHECKPOINTS, state, before_load=same_batch)
    saved_world = saved_world_of(resumed) if resumed.is_dir() else 1
    engine.seek(data.start_after(engine.state.batches, engine.state.step, c, saved_world, world))
    if isinstance(scheduler, LambdaLR) and saved_configs:
        replan(_saved_table(saved_configs[-1]), c, engine.state.step, scheduler)
    elif scheduler is not None and saved_configs:
        kept_schedule(_saved_table(saved_configs[-1]), c)
    return resumed.name


def replan(saved: dict[str, Any], c: RunConfig, step: int, scheduler: LambdaLR) -> None:
    """The schedule of a resume at ``step`` whose ``optim.lr`` (the new peak) or ``train.max_steps``
    (re-planned over it, said in one line) is not its checkpoint's (``saved``, its config)."""
    old_lr, old_steps = saved.get("optim", {}).get("lr"), saved.get("train", {}).get("max_steps")
    if isinstance(old_lr, (int, float)) and old_lr > 0 and old_lr != c.optim.lr:
        scheduler.base_lrs = [b * c.optim.lr / old_lr for b in scheduler.base_lrs]  # asked: the new peak
    groups = scheduler.optimizer.param_groups
    was = groups[0]["lr"]  # the old schedule's, for the step after `step`
    for group, base, factor in zip(groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * factor(step)  # the next step trains at the new schedule's learning rate
    if not isinstance(old_steps, int) or old_steps == c.train.max_steps or c.optim.schedule == "constant":
        return
    now, end = groups[0]["lr"], scheduler.base_lrs[0] * c.optim.min_lr / c.optim.lr
    keep = ""
    if now > was * 1.001:
        keep = (
            f"; to keep decaying from {was:.3g} instead, resume with {setting('optim.lr', float(f'{was:.3g}'))} "
            f"{setting('optim.warmup_steps', step)} {setting('optim.min_lr', float(f'{was / 10:.3g}'))} "
            "(a new peak at this step and a lower floor)"
        )
    steps = c.train.max_steps
    log.info(
        f"train.max_steps {old_steps} -> {steps}: the {c.optim.schedule} schedule now spans {steps} steps: "
        f"the learning rate goes from {was:.3g} to {now:.3g} at step {step + 1}, then decays to {end:.3g} "
        f"at step {steps}{keep}"
    )


def kept_schedule(saved: dict[str, Any], c: RunConfig) -> None:
    """A schedule that follows the run (``plateau``) is restored as its checkpoint left it: a new
    ``optim.lr`` or ``train.max_steps`` does not re-plan it, said in one line."""
    old_lr, old_steps = saved.get("optim", {}).get("lr"), saved.get("train", {}).get("max_steps")
    pairs = (("optim.lr", old_lr, c.optim.lr), ("train.max_steps", old_steps, c.train.max_steps))
    changed = [setting(key, new) for key, old, new in pairs if old is not None and old != new]
    if changed:
        log.warning(
            "%s on a resume: optim.schedule = %s keeps the learning rate its checkpoint restored "
            "(a cosine, linear or constant schedule is re-planned)",
            " ".join(changed),
            c.optim.schedule,
        )


def local_copy(uri: str, out_dir: str, wait_s: float = 600.0) -> Path:
    """``--resume URI``: its local folder ``<out_dir>/<name>``, fetched by local rank 0 when none is here."""
    local = Path(out_dir) / uri.rstrip("/").rpartition("/")[2]
    if (local / CONFIG_FILE).is_file():
        return local
    if Topology.from_env().local_rank != 0:
        deadline = time.monotonic() + wait_s
        while not (local / CONFIG_FILE).is_file():
            if time.monotonic() > deadline:
                raise TurbotrainError(f"{_resume(uri)}: local rank 0 did not fetch the run into {local}")
            time.sleep(0.2)
        return local
    store = Store(uri, "--resume")
    partial = local.with_name(f".{local.name}.fetching")  # renamed into place once whole
    shutil.rmtree(partial, ignore_errors=True)
    try:
        name = fetch_run(store, partial)
    except TurbotrainError:
        raise
    except Exception as exc:  # noqa: BLE001 - the store refused: one line, the setting named
        raise TurbotrainError(
            f"{_resume(uri)}: the store cannot be read ({why(exc)}); check the URI, the credentials "
            "(the back-end's environment or config files) and the endpoint"
        ) from None
    if local.is_dir() and not any(local.iterdir()):
        local.rmdir()
    partial.rename(local)
    print(f"fetched {name or 'the config (no complete checkpoint)'} of {uri} into {local}")
    return local


def stored_run(config: RunConfig) -> Path | None:
    """The local copy of a named run in ``run.remote`` and not here (a pod on an empty disk), else None."""
    if not (config.run.remote and config.run.name):
        return None
    if (Path(config.run.out_dir) / config.run.name / CONFIG_FILE).is_file():
        return None
    uri = f"{config.run.remote.rstrip('/')}/{config.run.name}"
    try:
        Store(uri).read(CONFIG_FILE)
    except Exception:  # noqa: BLE001 - none there (or the store refuses: said at the start, in one line)
        return None
    local = local_copy(uri, config.run.out_dir)
    if Topology.from_env().rank == 0:
        print(f"continuing {uri}: run.remote holds a run named {config.run.name} and {local} held none")
    return local


def check_resume_batch(
    checkpoint: str, saved_config: Any, saved_world: int, c: RunConfig, world: int, rank: int = 0
) -> None:
    """Refuse a resume at another world size whose global batch is not ``checkpoint``'s, naming the
    settings that keep it or change it. A checkpoint without a readable config passes."""
    change = _batch_change(saved_config, saved_world, c, world, True) if saved_world != world else None
    if change is None:
        return
    old, new, trained, resumed, keep = change
    # the rows of step s come from (seed, s) and the global batch: any split of it keeps them
    kept = f"{old} (the same batches) with {' or '.join(keep)}" if keep else f"{old} with another batch.micro"
    _refuse(
        f"{checkpoint} was trained at a global batch of {old} ({trained}) and this resume would train at {new} "
        f"({resumed}); keep {kept}, or train at {new} with {setting('batch.micro', c.batch.micro)}",
        rank,
    )


def _batch_change(
    saved_config: Any, saved_world: int, c: RunConfig, world: int, by_accumulation: bool
) -> tuple[int, int, str, str, list[str]] | None:
    """(saved global batch, this resume's, how each is made, the settings keeping it); None: same, unknown."""
    if not isinstance(c.batch.micro, int):
        return None
    try:
        batch = _saved_table(saved_config).get("batch", {})
        micro = int(batch["micro"])
        accumulation = int(batch.get("accumulation", 1))
    except (KeyError, TypeError, ValueError, AttributeError):
        return None  # the checkpoint's saved config has no readable batch
    old, new = micro * accumulation * saved_world, c.batch.micro * c.batch.accumulation * world
    if old == new:
        return None
    trained = f"{processes(saved_world)} x batch.micro {micro} x accumulation {accumulation}"
    resumed = f"{processes(world)} x {c.batch.micro} x {c.batch.accumulation}"
    keep: list[str] = []  # the settings that train at the global batch old over world processes
    if old % (world * c.batch.accumulation) == 0:
        keep.append(setting("batch.micro", old // (world * c.batch.accumulation)))
    if old % (world * c.batch.micro) == 0:
        by = f" (by accumulation {old // (world * c.batch.micro)})" if by_accumulation else ""
        keep.append(f"{setting('batch.global_size', old)}{by}")
    return old, new, trained, resumed, keep


def _refuse(text: str, rank: int) -> None:
    """A refused resume, said by rank 0; the other ranks end quietly."""
    raise TurbotrainError(text) if rank == 0 else ReportedByMainRank(text)


def _saved_table(saved_config: Any) -> dict[str, Any]:
    """A checkpoint's saved config as tables; empty when it has none readable."""
    try:
        return tomllib.loads(saved_config) if isinstance(saved_config, str) else {}
    except tomllib.TOMLDecodeError:
        return {}


def check_epochs_batch(
    checkpoint: str, saved_config: Any, saved_world: int, c: RunConfig, world: int, rank: int = 0
) -> None:
    """Refuse to resume an epochs run at another global batch than ``checkpoint``'s, asked for or not
    (its place is a step count at that batch), naming the settings that keep the batch."""
    change = _batch_change(saved_config, saved_world, c, world, False)
    if change is None:
        return
    old, new, trained, resumed, keep = change
    kept = " or ".join(keep) if keep else f"another batch.micro whose global batch is {old}"
    _refuse(
        f"train.epochs: {checkpoint} was trained at a global batch of {old} ({trained}) and its place in the "
        f"epochs is counted in steps of that batch, so this resume at {new} ({resumed}) would lose its place "
        f"(samples trained twice or skipped); resume with {kept}, or start a new run to train at {new}",
        rank,
    )


def _resume(uri: str) -> str:
    return said(f"--resume {uri}", f"resume={uri!r}")
