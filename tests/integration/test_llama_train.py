"""The Llama-style family through the CLI as a user runs it (issue 42 item 4): it trains, stops,
resumes to the same losses, samples text, and `memory` estimates it."""

import json
from pathlib import Path

from conftest import tiny_overrides

from turbotrain.cli import main


def _train(tmp_path: Path, text_file: Path, *extra: str) -> list[str]:
    o = tiny_overrides(tmp_path, data={"path": str(text_file)}, train={"max_steps": 4})
    args = [
        "train",
        "--preset",
        "llama-tiny",
        "--no-progress",
        "--llama.n_kv_head=1",
        "--monitor.log_every=1",
    ]
    for section, values in o.items():
        args += [f"--{section}.{k}={v}" for k, v in values.items() if k != "progress"]
    return args + list(extra)


def _losses(run: Path) -> dict[int, tuple[float | None, float | None]]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r.get("loss"), r.get("val_loss")) for r in records}


def test_llama_tiny_trains_resumes_exactly_samples_and_is_estimated(tmp_path, text_file, capsys):
    assert main(_train(tmp_path / "a", text_file)) == 0
    straight = tmp_path / "a" / "runs" / "t"
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 4
    resolved = summary["resolved"]
    assert (
        resolved["model_family"] == "llama" and "2 query / 1 key-value heads, rotary" in resolved["attention"]
    )
    # tied 256 x 32 embedding; per block q, kv (1 head of 16), proj, SwiGLU 128 wide (8/3 x 32 up to 64s), 2 norms
    assert (
        resolved["params"] == 256 * 32 + 2 * (32 * 32 + 2 * 16 * 32 + 32 * 32 + 32 * 256 + 128 * 32 + 64) + 32
    )
    assert summary["flops_source"].startswith("model.flops_per_token")

    assert main(_train(tmp_path / "b", text_file, "--train.stop_after_steps=2")) == 0
    out = str(tmp_path / "b" / "runs")
    assert (
        main(
            [
                "train",
                "--resume",
                "--run.out_dir",
                out,
                "--run.name=t",
                "--train.stop_after_steps=0",
                "--no-progress",
            ]
        )
        == 0
    )
    resumed = tmp_path / "b" / "runs" / "t"
    assert json.loads((resumed / "summary.json").read_text())["resumed_from"] == "step_00000002.pt"
    after = {s: v for s, v in _losses(straight).items() if s > 2}
    assert after and {s: _losses(resumed)[s] for s in after} == after  # the same losses, to the bit

    capsys.readouterr()
    assert main(["sample", str(straight), "--tokens", "20", "--prompt", "def "]) == 0
    assert capsys.readouterr().out.startswith("def ")
    assert main(["memory", "--preset", "llama-tiny", "--micro", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["seq_len"] == 128 and report["estimate"]["off"]["params_bytes"] == 4 * 820352
