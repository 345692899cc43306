"""GPU checks of issue 35's levers (skipped without CUDA): syncs located on a real device queue,
the fused loss's memory and parity in bf16, fp8 per-layer timing on a float8 GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from turbotrain.app.profile.syncs import SyncLocator
from turbotrain.core.precision.fp8 import FP8
from turbotrain.parts.models import loss as loss_module

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)


def _step(x: torch.Tensor, host: torch.Tensor) -> None:
    x.sum().item()  # item-line
    (x > 0).nonzero()  # nonzero-line
    host.sum().item()  # a host tensor: no sync
    torch.cuda.synchronize()  # explicit-line


def test_syncs_on_cuda_are_located_and_host_reads_are_not_counted():
    x, host = torch.randn(64, device="cuda"), torch.randn(4)
    with SyncLocator("cuda") as loc:
        _step(x, host)
    wheres = {s["where"].rsplit(":", 1)[1]: s for s in loc.sources(1)}
    lines = [s["code"] for s in loc.sources(1)]
    assert any("# item-line" in c for c in lines) and any("# nonzero-line" in c for c in lines)
    assert any("# explicit-line" in c for c in lines)  # torch.cuda.set_sync_debug_mode's report
    assert not any("host.sum()" in c for c in lines)
    assert all(s["sync"] and s["per_step"] == 1 for s in wheres.values()) and len(wheres) == 3  # each once
    assert torch.cuda.get_sync_debug_mode() == 0  # restored


@pytest.mark.skipif(not loss_module.FUSED_AVAILABLE, reason=loss_module.FUSED_MISSING)
def test_the_fused_loss_matches_full_in_bf16_and_peaks_lower_on_gpt2_vocab():
    torch.manual_seed(0)
    h = torch.randn(8 * 1024, 768, device="cuda", requires_grad=True)
    w = torch.randn(50304, 768, device="cuda", requires_grad=True) * 0.02
    w = w.detach().requires_grad_()
    t = torch.randint(50304, (8 * 1024,), device="cuda")
    peaks, losses = {}, {}
    for name, fn in {
        "full": lambda: F.cross_entropy((h @ w.t()).float(), t),
        "fused": lambda: loss_module.fused_cross_entropy(h, w, t),
    }.items():
        h.grad = w.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fn()
        loss.backward()
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() - base
        losses[name] = float(loss)
    print(
        f"loss step peak over inputs: full {peaks['full'] / 2**20:.0f} MiB, fused {peaks['fused'] / 2**20:.0f} MiB"
    )
    assert abs(losses["fused"] - losses["full"]) < 0.02 * abs(losses["full"])
    assert peaks["fused"] < peaks["full"] / 2


def test_fp8_per_layer_timing_runs_on_a_float8_gpu():
    pytest.importorskip("torchao")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 needs compute capability >= 8.9")
    from turbotrain.core.precision.fp8_choice import choose_fp8_layers, linear_timer

    model = torch.nn.Sequential(
        torch.nn.Linear(768, 3072), torch.nn.GELU(), torch.nn.Linear(3072, 768)
    ).cuda()
    choice = choose_fp8_layers(
        model, 16 * 1024, FP8(), linear_timer(torch.device("cuda"), compile=True, repeats=10)
    )
    print(choice.line)
    print(choice.table())
    assert len(choice.layers) == 2 and all(
        set(c.ms) == {"bf16", "tensorwise", "rowwise"} for c in choice.layers
    )
    assert all(v > 0 for c in choice.layers for v in c.ms.values())
