"""A run's checkpoints and records mirrored to a remote store (``run.remote``), and a resume from it
(docs/cluster.md). A checkpoint is uploaded after its local save finished, its marker last (an
object store has no atomic rename: one without its marker is half-uploaded, skipped by a resume).
The mirror runs in a thread of its own; a failing store is one warning and the next sync retries."""

from __future__ import annotations

import logging
import re
import threading
from pathlib import Path

from ...base.config import RunConfig
from ...base.errors import TurbotrainError
from ...base.rundir import (
    CHECKPOINTS,
    CONFIG_FILE,
    EXPERTS_FILE,
    METRICS_FILE,
    PLOTS_DIR,
    SUMMARY_FILE,
    SUMMARY_MD,
    TOKENIZER_FILE,
)
from ...base.storage import Store, why
from ..hooks import FitContext, Hook
from .format import MARKER, checkpoint_step, finished_checkpoints, verify_problem

log = logging.getLogger(__name__)

RECORDS = (CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, SUMMARY_MD, TOKENIZER_FILE, EXPERTS_FILE)
BEST = "best"  # checkpoints/best/: the best checkpoint (turbotrain.loop.best_checkpoint)
_REMOTE = re.compile(r"^step_(\d{8,})(?:(\.pt)(\.sha256)?|/(.+))$")  # under checkpoints/


def remote_checkpoints(files: dict[str, int]) -> dict[int, tuple[bool, list[str]]]:
    """The checkpoints among the store's ``files`` (under ``checkpoints/``): step -> (marker there, files)."""
    found: dict[int, tuple[bool, list[str]]] = {}
    for name in files:
        m = _REMOTE.match(name)
        if m is None:
            continue
        complete, names = found.get(int(m[1]), (False, []))
        complete |= bool(m[3]) or m[4] == MARKER
        found[int(m[1])] = (complete, [*names, name])
    return found


def _upload_order(path: Path) -> list[Path]:
    """The files of local checkpoint ``path`` in upload order: its data, its marker last."""
    if path.is_dir():
        return sorted((p for p in path.iterdir() if p.name != MARKER), key=lambda p: p.name) + [path / MARKER]
    return [path, path.with_name(path.name + ".sha256")]


class RemoteMirror:
    """Keeps ``store`` a copy of run directory ``run_dir``; rank 0 alone."""

    def __init__(self, store: Store, run_dir: Path, keep_last: int) -> None:
        self.store, self.run_dir, self.keep_last = store, run_dir, keep_last
        self._sent: dict[str, tuple[int, int]] = {}  # name -> (size, mtime_ns) of the copy in the store
        self._complete: set[int] = set()  # steps whose checkpoint is complete in the store
        self._failing = ""  # why the last sync failed ("" it did not)
        self._wake, self._stop, self._lock = threading.Event(), False, threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="turbotrain-remote-mirror", daemon=True)
        self._thread.start()

    def request(self) -> None:
        """A sync soon, in the mirror's thread (never blocks)."""
        self._wake.set()

    def _loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._stop:
                return
            self._try_sync()

    def _try_sync(self) -> bool:
        with self._lock:
            try:
                self.sync()
            except Exception as exc:  # noqa: BLE001 - the store failing must not stop training
                if not self._failing:
                    log.warning(
                        "%s=%s: uploads fail (%s); training goes on with the local checkpoints in %s and "
                        "the uploads are retried",
                        self.store.setting,
                        self.store.url(),
                        why(exc),
                        self.run_dir,
                    )
                self._failing = why(exc)
                return False
            if self._failing:
                log.info("%s=%s: uploads resumed", self.store.setting, self.store.url())
            self._failing = ""
            return True

    def sync(self) -> None:
        """Upload what is not in the store yet, prune its old checkpoints; raises when the store fails."""
        for name in RECORDS:  # the config first: a run in the store is resumable from its first checkpoint
            self._upload_changed(self.run_dir / name, name)
        folder = self.run_dir / CHECKPOINTS
        listing = self.store.files(CHECKPOINTS)
        remote = remote_checkpoints({n[len(CHECKPOINTS) + 1 :]: s for n, s in listing.items()})
        self._complete = {step for step, (complete, _) in remote.items() if complete}
        for path in finished_checkpoints(folder):
            step = checkpoint_step(path)
            if step not in self._complete and self._upload_checkpoint(path, listing):
                self._complete.add(step)
        self._prune(remote)
        self._upload_tree(folder / BEST, f"{CHECKPOINTS}/{BEST}", last="best.json")
        self._upload_tree(self.run_dir / PLOTS_DIR, PLOTS_DIR)

    def _upload_checkpoint(self, path: Path, listing: dict[str, int]) -> bool:
        """Upload checkpoint ``path``, its marker last (data already there with its size is kept);
        False when a local prune removed it meanwhile."""
        try:
            for file in _upload_order(path):
                name = f"{CHECKPOINTS}/{file.relative_to(path.parent).as_posix()}"
                if (
                    file.name == MARKER
                    or file.suffix == ".sha256"
                    or listing.get(name) != file.stat().st_size
                ):
                    self.store.put(file, name)
        except FileNotFoundError:
            if path.exists():
                raise
            return False
        return True

    def _prune(self, remote: dict[int, tuple[bool, list[str]]]) -> None:
        """``train.keep_last`` in the store, marker first."""
        kept = sorted(self._complete)[-self.keep_last :]
        for step, (_, names) in sorted(remote.items()):
            if kept and step < kept[0]:
                markers = [n for n in names if n.endswith((".sha256", f"/{MARKER}"))]
                for name in markers + [n for n in names if n not in markers]:
                    self.store.remove(f"{CHECKPOINTS}/{name}")
        self._complete &= set(kept)

    def _upload_changed(self, local: Path, name: str) -> None:
        try:
            st = local.stat()
        except FileNotFoundError:
            return
        if self._sent.get(name) != (st.st_size, st.st_mtime_ns):
            self.store.put(local, name)
            self._sent[name] = (st.st_size, st.st_mtime_ns)

    def _upload_tree(self, folder: Path, prefix: str, last: str = "") -> None:
        """The files of ``folder`` that changed since they were sent (``last`` after the others)."""
        if not folder.is_dir():
            return
        files = sorted((p for p in folder.rglob("*") if p.is_file()), key=lambda p: (p.name == last, str(p)))
        for file in files:
            self._upload_changed(file, f"{prefix}/{file.relative_to(folder).as_posix()}")

    def missing(self) -> list[str]:
        """What of the run directory is not in the store as it is locally (names)."""
        steps = finished_checkpoints(self.run_dir / CHECKPOINTS)
        out = [p.name for p in steps if checkpoint_step(p) not in self._complete]
        for name in RECORDS:
            local = self.run_dir / name
            if local.is_file() and self._sent.get(name) != (local.stat().st_size, local.stat().st_mtime_ns):
                out.append(name)
        return out

    def close(self) -> list[str]:
        """Stop the thread, sync a last time and say in one line what did not reach the store."""
        self._stop = True
        self._wake.set()
        self._thread.join()
        self._try_sync()
        missing = self.missing()
        if missing:
            log.warning(
                "%s=%s: not in the store (%s): %s; they are in %s",
                self.store.setting,
                self.store.url(),
                self._failing or "not uploaded",
                ", ".join(missing),
                self.run_dir,
            )
        return missing


class MirrorHook(Hook):
    """Wakes the mirror when ``ctx.metrics['checkpoint']`` changed."""

    def __init__(self, mirror: RemoteMirror) -> None:
        self.mirror, self.seen = mirror, ""

    def on_step_end(self, ctx: FitContext) -> None:
        written = ctx.metrics.get("checkpoint", "")
        if written != self.seen:
            self.seen = written
            self.mirror.request()


def remote_store(config: RunConfig, run_dir: Path) -> Store | None:
    """The store of run ``run_dir``, checked writable now (one-line error); None without ``run.remote``."""
    if not config.run.remote:
        return None
    store = Store(f"{config.run.remote.rstrip('/')}/{run_dir.name}")
    store.probe()
    return store


def fetch_run(store: Store, local: Path) -> str:
    """Download run ``store``'s config, records and newest complete checkpoint that verifies into
    ``local``; returns its name ("" none)."""
    files = store.files()
    if CONFIG_FILE not in files:
        raise TurbotrainError(f"--resume {store.url()}: no run there (no {CONFIG_FILE}); check the URI")
    for name in RECORDS:
        if name in files:
            store.get(name, local / name)
    remote = remote_checkpoints(
        {n[len(CHECKPOINTS) + 1 :]: s for n, s in files.items() if n.startswith(f"{CHECKPOINTS}/")}
    )
    for step, (complete, names) in sorted(remote.items(), reverse=True):
        if not complete:
            name = names[0].partition("/")[0].removesuffix(".sha256")
            log.warning(
                "skipped %s: its upload did not finish (no marker)", store.url(f"{CHECKPOINTS}/{name}")
            )
            continue
        for name in sorted(names, key=lambda n: n.endswith((".sha256", f"/{MARKER}"))):
            store.get(f"{CHECKPOINTS}/{name}", local / CHECKPOINTS / name)
        path = (
            local / CHECKPOINTS / (names[0].partition("/")[0] if "/" in names[0] else f"step_{step:08d}.pt")
        )
        problem = verify_problem(path)
        if not problem:
            return path.name
        log.warning("skipped %s: %s", store.url(f"{CHECKPOINTS}/{path.name}"), problem)
    return ""
