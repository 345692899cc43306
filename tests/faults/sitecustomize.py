"""Fault injection for ``python -m turbotrain train`` subprocesses (tests and
benchmarks/fault_injection.py put this folder on PYTHONPATH; Python imports ``sitecustomize`` at
start-up). ``TT_FAULT=POINT:N`` acts at the N-th time the program reaches POINT:

- ``step``: SIGKILL inside the N-th optimizer step (``Engine.train_window``, before its forward)
- ``ckpt-mid-write``: SIGKILL after half of the N-th checkpoint's bytes reached its temp file
- ``ckpt-before-rename``: SIGKILL after the N-th checkpoint's temp file is complete and fsynced
- ``ckpt-before-sidecar``: SIGKILL after the N-th checkpoint is renamed, before its .sha256
- ``sidecar-before-rename``: SIGKILL with the N-th .sha256 written to its temp file only
- ``prune``: SIGKILL after the N-th old checkpoint is deleted, before its .sha256
- ``metrics-torn``: SIGKILL after half of the N-th metrics record is written and flushed
- ``eval``: SIGKILL inside the N-th validation pass
- ``summary``: SIGKILL while summary.json is being written (N-th time)
- ``startup``: SIGKILL when the run starts being built (N-th time)
- ``best-link``: SIGKILL before the N-th best checkpoint is linked into ``checkpoints/best/``
- ``best-sidecar``: SIGKILL with the N-th best checkpoint linked into ``best/``, before its .sha256
- ``cache-mid-write``: SIGKILL after half of the N-th byte-token cache write
- ``remote-before-marker``: SIGKILL when the N-th checkpoint marker is about to be uploaded to
  ``run.remote`` (its data is in the store): a half-uploaded checkpoint
- ``finder-step-ms``: the batch finder's trials (real steps, their peaks measured) report N ms a
  step, not the time measured (a loaded CPU's would pass the 1 s step budget and move the answer)
- ``oom``: a real torch.OutOfMemoryError in optimizer step N, after its last micro-batch's
  forward (oom.py), for the out-of-memory policy
- ``pause-step`` / ``pause-startup`` / ``pause-choose`` (a new run's settings about to be measured) / ``pause-fit`` (the run built and its files written, the
  loop not started yet) / ``pause-report`` (trained, summary.json written, the report not yet): create ``$TT_FAULT_MARKER`` and wait (in 20 ms sleeps) until the test
  deletes it; the process stays signalable.

Several points, comma-separated (``pause-step:8,remote-before-marker:2``), each count their own.
Nothing here runs unless TT_FAULT is set.
"""

import os
import signal
import time

_SPEC = os.environ.get("TT_FAULT", "")


def _install(point: str, n: int) -> None:
    import pathlib
    import tempfile

    import torch

    import turbotrain.app.training as training
    import turbotrain.core.engine as engine
    import turbotrain.loop.checkpoint as checkpoint
    import turbotrain.loop.monitor.sinks as monitor
    import turbotrain.parts.data.sources as sources

    calls = {"n": 0}

    def due() -> bool:
        calls["n"] += 1
        return calls["n"] == n

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def pause() -> None:
        marker = pathlib.Path(os.environ["TT_FAULT_MARKER"])
        marker.write_text(str(os.getpid()))
        while marker.exists():
            time.sleep(0.02)

    def wrap(owner, name, before=None, after=None):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            if before is not None:
                before(*args, **kwargs)
            out = original(*args, **kwargs)
            if after is not None:
                after(*args, **kwargs)
            return out

        setattr(owner, name, wrapper)

    def half_then_die(write_all):
        def writer(f):
            with tempfile.TemporaryFile() as buf:  # a real file: numpy's tofile needs a descriptor
                write_all(buf)
                buf.flush()
                buf.seek(0)
                data = buf.read()
            f.write(data[: len(data) // 2])
            f.flush()
            os.fsync(f.fileno())
            die()

        return writer

    if point == "finder-step-ms":
        from turbotrain.tools.memory import step_trial

        measure = step_trial.StepTrial.__call__
        step_trial.StepTrial.__call__ = lambda self, micro: step_trial.TrialResult(
            measure(self, micro).peak_bytes, n / 1000
        )
    elif point == "oom":
        from oom import install

        install(n)  # every Engine of this process armed, to its end
    elif point in ("step", "pause-step"):
        act = die if point == "step" else pause
        wrap(engine.Engine, "train_window", before=lambda *a, **k: due() and act())
    elif point == "pause-fit":
        wrap(training.Training, "run", before=lambda *a, **k: due() and pause())
    elif point == "pause-choose":
        import turbotrain.app.choose.session as choose

        wrap(choose, "decide_for_run", before=lambda *a, **k: due() and pause())
    elif point == "pause-report":
        import turbotrain.app.run as run

        wrap(run, "write_report", before=lambda *a, **k: due() and pause())
    elif point == "eval":
        wrap(engine.Engine, "evaluate", before=lambda *a, **k: due() and die())
    elif point in ("startup", "pause-startup"):
        act = die if point == "startup" else pause
        wrap(training, "build_training", before=lambda *a, **k: due() and act())
    elif point == "summary":
        original_summary = training.write_summary

        def summary(run_dir, *args, **kwargs):
            if due():
                tmp = pathlib.Path(run_dir) / f".summary.json.tmp{os.getpid()}"
                tmp.write_text('{"half": ')
                die()
            return original_summary(run_dir, *args, **kwargs)

        training.write_summary = summary
    elif point in ("ckpt-mid-write", "ckpt-before-rename"):
        original_save = torch.save

        def save(obj, f, *args, **kwargs):
            if isinstance(obj, dict) and "format" in obj and due():
                if point == "ckpt-mid-write":
                    return half_then_die(lambda buf: original_save(obj, buf, *args, **kwargs))(f)
                original_save(obj, f, *args, **kwargs)
                f.flush()
                os.fsync(f.fileno())
                die()
            return original_save(obj, f, *args, **kwargs)

        torch.save = save
    elif point == "ckpt-before-sidecar":
        wrap(checkpoint, "sha256_of", before=lambda *a, **k: due() and die())
    elif point == "sidecar-before-rename":
        original_replace = os.replace

        def replace(src, dst, *args, **kwargs):
            if str(dst).endswith(".sha256") and due():
                die()
            return original_replace(src, dst, *args, **kwargs)

        os.replace = replace
    elif point == "prune":
        original_unlink = pathlib.Path.unlink

        def unlink(self, *args, **kwargs):
            out = original_unlink(self, *args, **kwargs)
            if self.name.endswith(".pt") and due():
                die()
            return out

        pathlib.Path.unlink = unlink
    elif point in ("best-link", "best-sidecar"):
        import turbotrain.loop.best_checkpoint as best

        if point == "best-link":
            wrap(best, "_link_in", before=lambda *a, **k: due() and die())
        else:
            wrap(
                best,
                "_link_or_copy",
                before=lambda src, dest: src.name.endswith(".sha256") and due() and die(),
            )
    elif point == "metrics-torn":

        def write(self, record):
            line = monitor.json.dumps(record, allow_nan=False, default=str) + "\n"
            if due():
                self.file.write(line[: len(line) // 2])
                self.file.flush()
                die()
            self.file.write(line)
            self.file.flush()

        monitor.JsonlSink.write = write
    elif point == "cache-mid-write":
        original_write = sources.atomic_write

        def atomic_write(path, content):
            if callable(content) and due():
                return original_write(path, half_then_die(content))
            return original_write(path, content)

        sources.atomic_write = atomic_write
    elif point == "remote-before-marker":
        import turbotrain.base.storage as storage

        def marker(self, local, name):
            if name.endswith((".sha256", "/finished.json")) and due():
                die()

        wrap(storage.Store, "put", before=marker)
    else:
        raise SystemExit(f"TT_FAULT: unknown point {point!r}")


for _one in filter(None, _SPEC.split(",")):  # several points: POINT:N,POINT:N
    _point, _, _n = _one.partition(":")
    _install(_point, int(_n or 1))
