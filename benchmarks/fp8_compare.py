"""W1 fp8 against bf16, same protocol: two `turbotrain train` runs (gpt_extra.sh's phase w1-fp8) read
back from their summary.json, printed as one JSON object.

    python benchmarks/fp8_compare.py RUNS/gpt2-small-bf16 RUNS/gpt2-small-fp8

Per run: steady tokens/s, step time, MFU against the bf16 dense peak (both rows, so they compare;
the fp8 run's own summary measures it against the fp8 peak too), the train and validation loss at the end,
and for fp8 the layers converted. Where the fp8 run did not run (no torchao, no float8 tensor
cores), the row says why instead.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from turbotrain.app.bench.variants import fp8_unavailable
from turbotrain.base.version import collect_git


def row(run: Path) -> dict[str, Any]:
    path = run / "summary.json"
    if not path.exists():
        return {
            "status": "skipped",
            "reason": fp8_unavailable("cuda") or f"no summary.json in {run} (see the step's log)",
        }
    s = json.loads(path.read_text())
    steady = s.get("steady_state") or {}
    sheet = (s.get("hardware") or {}).get("datasheet") or {}
    bf16_peak = sheet.get("bf16_tflops")
    tflops = steady.get("tflops")
    opts = s.get("optimizations") or {}
    return {
        "status": s.get("status"),
        "precision": opts.get("precision"),
        "steps": s.get("steps"),
        "tokens_per_s": steady.get("tokens_per_s"),
        "step_ms": steady.get("step_ms"),
        "tflops": tflops,
        "mfu_vs_bf16_peak": tflops / bf16_peak if tflops and bf16_peak else None,
        "mfu_own_peak": steady.get("mfu"),
        "first_step_s": s.get("first_step_s"),
        "final_train_loss": s.get("final_train_loss"),
        "final_val_loss": s.get("final_val_loss"),
        "fp8": opts.get("fp8"),
        "fp8_converted": opts.get("fp8_converted"),
    }


def main(bf16_dir: str, fp8_dir: str) -> dict[str, Any]:
    bf16, fp8 = row(Path(bf16_dir)), row(Path(fp8_dir))
    out: dict[str, Any] = {"bf16": bf16, "fp8": fp8, "git": collect_git()}
    if bf16.get("tokens_per_s") and fp8.get("tokens_per_s"):
        out["fp8_speedup"] = fp8["tokens_per_s"] / bf16["tokens_per_s"]
        out["loss_difference"] = fp8["final_train_loss"] - bf16["final_train_loss"]
        if fp8.get("final_val_loss") is not None and bf16.get("final_val_loss") is not None:
            out["val_loss_difference"] = fp8["final_val_loss"] - bf16["final_val_loss"]
    return out


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:3]), indent=2))
