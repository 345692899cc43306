"""The Hugging Face callback logs to the experiment trackers (issue 36 items 1 and 4): one ``Trainer``
run with ``TurbotrainCallback(trackers=("wandb", "mlflow", "trackio"))``, read back with each
tracker's own client: the metric history equals metrics.jsonl, the TrainingArguments are the
config, the summary and plots arrived. The run goes in a child process with its own
``TRACKIO_DIR`` (trackio reads it once, on import); the readers are test_trackers.py's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import HANG_S

pytest.importorskip("transformers")
pytest.importorskip("wandb")
pytest.importorskip("mlflow")
trackio = pytest.importorskip("trackio")

from test_trackers import expected_history, read_wandb_run  # noqa: E402

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    from turbotrain.integrations.hf import TurbotrainCallback

    torch.manual_seed(0)
    ids = torch.randint(0, 64, (48, 16))
    data = [{"input_ids": r, "labels": r} for r in ids]
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2))
    args = TrainingArguments(sys.argv[1], max_steps=8, per_device_train_batch_size=4, logging_steps=2,
                             save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=True)
    callback = TurbotrainCallback(sys.argv[1] + "/hf", trackers=("wandb", "mlflow", "trackio"), project="tt")
    Trainer(model=model, args=args, train_dataset=data, callbacks=[callback]).train()
    """
)


def test_hf_callback_logs_to_wandb_mlflow_and_trackio(tmp_path, monkeypatch):
    (tmp_path / "run.py").write_text(SCRIPT)
    env = {
        **os.environ,
        "TRACKIO_DIR": str(tmp_path / "trackio"),
        "WANDB_SILENT": "true",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "DO_NOT_TRACK": "1",
    }
    env.pop("MLFLOW_TRACKING_URI", None)
    done = subprocess.run(
        [sys.executable, "run.py", str(tmp_path / "out")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "out" / "hf"
    expected = expected_history(run)
    assert [s for s, _ in expected["loss"]] == [2, 4, 6, 8]
    ids = json.loads((run / "trackers.json").read_text())

    w = read_wandb_run(run, ids["wandb"]["id"])
    history, config, artifacts = w.history, w.config, w.artifacts
    assert history == expected
    assert config["training_args"]["per_device_train_batch_size"] == 4
    assert "summary.json" in artifacts and "plots/loss.png" in artifacts

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=ids["mlflow"]["uri"])
    info = client.get_run(ids["mlflow"]["run_id"])
    got = {
        key: [(m.step, m.value) for m in client.get_metric_history(ids["mlflow"]["run_id"], key)]
        for key in info.data.metrics
    }
    assert got == expected and info.info.status == "FINISHED"

    import trackio.sqlite_storage

    monkeypatch.setattr(trackio.sqlite_storage, "TRACKIO_DIR", tmp_path / "trackio")
    rows: dict[str, list] = {}
    for row in trackio.sqlite_storage.SQLiteStorage.get_logs("tt", "hf"):
        for key, value in row.items():
            if key not in ("step", "timestamp") and value is not None:
                rows.setdefault(key, []).append((row["step"], value))
    assert {k: sorted(v) for k, v in rows.items()} == expected
