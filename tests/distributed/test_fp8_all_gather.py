"""FSDP2's float8 all-gather of weights (``precision.fp8_all_gather``) on 2 gloo processes, fp8
emulated (tests/distributed/fp8_gather_worker.py): the same losses as the bf16 all-gather within a
stated tolerance, plain float32 weights in its sharded checkpoint, an exact resume, and the
fallback to bf16-mixed unwrapping the weights so FSDP2 gathers plain tensors again."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from test_torchrun_train import _forked

from turbotrain.loop.checkpoint import finished_checkpoints, load_latest_weights, saved_model_tensors
from turbotrain.parts.models.gpt import GPT, GPTConfig

pytest.importorskip("torchao")

WORKER = Path(__file__).with_name("fp8_gather_worker.py")
STEPS = 6
# per-step loss, float8 all-gather against bf16 all-gather; measured 1.5e-3 (docs/precision.md)
TOLERANCE = 5e-3


def _run(tmp_path: Path) -> list[dict]:
    """The worker under torchrun: in a fork of this process, its 2 ranks forked."""
    out = tmp_path / "fp8"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(WORKER),
        str(out),
        str(STEPS),
    ]
    proc = _forked(cmd, tmp_path / "torchrun")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)]


def test_float8_all_gather_trains_like_the_bf16_gather_checkpoints_plain_weights_and_falls_back(tmp_path):
    """Off, FSDP2 all-gathers the float8 layers' weights in bf16 and each rank casts them to
    float8; on, each rank casts its fp32 shard to float8 (one scale per weight, its amax over both
    ranks) and FSDP2 gathers float8. Not bit-equal: the cast starts from fp32 instead of bf16
    weights, so rounding differs element by element. Measured over 6 steps: losses within 1.5e-3.
    A gather that lost a shard, or scaled by one rank's amax, would be far outside 5e-3."""
    ranks = _run(tmp_path)
    off, on = [r["off"] for r in ranks], [r["on"] for r in ranks]
    layers = on[0]["summary"]["fp8_converted"]
    assert len(layers) == 8 and on[0]["summary"]["fp8_all_gather"] and not off[0]["summary"]["fp8_all_gather"]
    for r_off, r_on in zip(off, on):
        assert set(r_off["shards"].values()) == {"Tensor"}  # off: plain shards
        assert {n for n, t in r_on["shards"].items() if t == "WeightWithDynamicFloat8CastTensor"} == set(
            layers
        )
        worst = max(abs(a - b) for a, b in zip(r_on["losses"], r_off["losses"]))
        assert len(r_on["losses"]) == STEPS and worst <= TOLERANCE, f"float8 all-gather differs by {worst}"
        # restored from its sharded checkpoint: the same losses, exactly
        assert r_on["resumed"] == r_on["after"]
        fallback = r_on["fallback"]
        assert fallback["precision"] == "bf16-mixed" and fallback["layers"] == ["Linear"]
        assert set(fallback["shards"].values()) == {"Tensor"}  # FSDP2 gathers plain (bf16) weights again
        assert all(math.isfinite(x) for x in fallback["losses"]) and fallback["losses"][0] < r_on["losses"][0]
    assert on[0]["losses"] == on[1]["losses"] and on[0]["losses"][-1] < on[0]["losses"][0] - 0.3

    folder = tmp_path / "fp8.ckpt"
    assert len(finished_checkpoints(folder)) == 1
    saved = saved_model_tensors(finished_checkpoints(folder)[0])
    assert {name: meta.properties.dtype for name, meta in saved.items() if name.endswith("weight")} == {
        name: torch.float32 for name in saved if name.endswith("weight")
    } and f"{layers[0]}.weight" in saved
    # in this process alone: tensors only, nothing of torchao's unpickled
    _, weights = load_latest_weights(folder)
    assert all(type(t) is torch.Tensor and t.dtype == torch.float32 for t in weights.values())
    plain = GPT(GPTConfig(vocab_size=64, n_layer=2, n_head=2, d_model=32, block_size=16))
    plain.load_state_dict(weights)  # a plain model's checkpoint
    tokens = torch.arange(17).unsqueeze(0) % 64
    with torch.no_grad():
        assert math.isfinite(float(plain(tokens[:, :-1], tokens[:, 1:])))
