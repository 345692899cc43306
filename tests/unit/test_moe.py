"""Mixture-of-experts GPT (models/moe/): the expert-compute paths agree, routing counts add up,
the capacity drops what it should, load balancing acts, FLOPs count active parameters, and bad
settings are one line."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from turbotrain import Engine, fit, load_config
from turbotrain.app.expert_report import markdown, read_experts, summarize, write_plots
from turbotrain.app.training import train
from turbotrain.base.errors import ConfigError
from turbotrain.base.rundir import EXPERTS_FILE
from turbotrain.cli import main
from turbotrain.loop.checkpoint import list_checkpoints, load_latest_weights
from turbotrain.loop.experts_monitor import ExpertsMonitor
from turbotrain.parts.models.gpt import GPT, GPTConfig
from turbotrain.parts.models.moe import MoE, MoEConfig, MoEGPT, MoEMLP, aux_loss, grown_order, regrown, route
from turbotrain.parts.models.moe.parallel import attach_optimizer
from turbotrain.parts.models.registry import build_model

SMALL = dict(vocab_size=64, n_layer=2, n_head=2, d_model=32, block_size=16, n_experts=4, top_k=2)


def _loss_and_grads(impl: str, **extra: object) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = MoEGPT(MoEConfig(**{**SMALL, **extra, "moe_impl": impl}))  # type: ignore[arg-type]
    idx = torch.randint(64, (3, 16), generator=torch.Generator().manual_seed(1))
    model.eval()
    logits = model(idx)
    model.train()
    loss = model(idx, idx)
    loss.backward()
    return (
        logits.detach(),
        loss.detach(),
        {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
    )


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["batched", "grouped"])
def test_vectorised_expert_paths_equal_the_per_expert_loop_in_fp32(impl: str):
    ref_logits, ref_loss, ref_grads = _loss_and_grads("loop")
    logits, loss, grads = _loss_and_grads(impl)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-5)
    assert grads.keys() == ref_grads.keys() and any("w1" in n for n in grads)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-5, msg=name)


def test_grouped_path_in_bf16_matches_the_loop_within_bf16_tolerance():
    torch.manual_seed(0)
    layer = MoEMLP(MoEConfig(**SMALL)).to(torch.bfloat16)  # type: ignore[arg-type]
    x = torch.randn(2, 16, 32, dtype=torch.bfloat16)
    layer.impl = "loop"
    ref = layer(x)
    layer.impl = "grouped"
    torch.testing.assert_close(layer(x), ref, rtol=2e-2, atol=2e-2)


def test_tokens_per_expert_sum_to_tokens_times_top_k_and_accumulate_until_read():
    torch.manual_seed(0)
    model = MoEGPT(MoEConfig(**{**SMALL, "top_k": 3}))  # type: ignore[arg-type]
    idx = torch.randint(64, (4, 16))
    for _ in range(2):
        model(idx, idx).backward()
    layers = model.moe_layers()
    assert len(layers) == 2
    for layer in layers:
        assert layer.last_counts is not None and int(layer.last_counts.sum()) == 4 * 16 * 3
        taken = layer.take_load()
        assert taken is not None and int(taken[0].sum()) == 2 * 4 * 16 * 3 and int(taken[1]) == 0
        assert int(layer.take_load()[0].sum()) == 0  # type: ignore[index]  # read = reset
    model.eval()
    model(idx, idx)
    assert int(layers[0].take_load()[0].sum()) == 0  # type: ignore[index]  # evaluation is not counted


def test_capacity_factor_drops_overflow_in_token_order():
    torch.manual_seed(0)
    cfg = MoEConfig(**{**SMALL, "capacity_factor": 0.5, "moe_impl": "batched"})  # type: ignore[arg-type]
    layer = MoEMLP(cfg)
    x = torch.randn(1, 40, 32)
    out = layer(x)[0]
    capacity = layer.capacity(40)
    assert capacity == 10  # ceil(0.5 x 40 x 2 / 4)
    # reference: visit tokens in order; an expert serves at most `capacity` of them
    weights, experts, _ = route(x[0], layer.router.weight, 2)
    seen, expected = [0] * 4, torch.zeros(40, 32)
    for n in range(40):
        for j in range(2):
            e = int(experts[n, j])
            if seen[e] < capacity:
                expected[n] += weights[n, j] * (
                    F.gelu(x[0, n] @ layer.w1[e], approximate="tanh") @ layer.w2[e]
                )
            seen[e] += 1
    dropped = sum(max(0, s - capacity) for s in seen)
    assert dropped > 0 and int(layer.last_dropped) == dropped  # type: ignore[arg-type]
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    layer.impl = "loop"  # the loop computes every row; dropped ones get weight 0: same result
    torch.testing.assert_close(layer(x)[0], expected, rtol=1e-4, atol=1e-5)


def test_aux_loss_only_in_training_and_bias_moves_against_the_load():
    torch.manual_seed(0)
    model = MoEGPT(MoEConfig(**{**SMALL, "aux_loss_coef": 1.0, "router_bias_update": 0.01}))  # type: ignore[arg-type]
    idx = torch.randint(64, (2, 16))
    model.train()
    with torch.no_grad():
        train_loss = model(idx, idx)
    layer = model.moe_layers()[0]
    assert layer.last_counts is not None and layer.last_aux is not None
    counts = layer.last_counts.clone()
    model.eval()
    with torch.no_grad():
        eval_loss = model(idx, idx)
    assert float(train_loss - eval_loss) == pytest.approx(
        float(torch.stack([m.last_aux for m in model.moe_layers()]).mean()), rel=1e-4
    )
    model.train()
    with torch.no_grad():
        model(idx, idx)  # applies the previous training forward's loads
    bias = layer.expert_bias
    assert float(bias[counts.argmax()]) < 0 < float(bias[counts.argmin()]) and abs(float(bias.sum())) < 1e-6


def test_flops_count_active_parameters():
    dense = GPT(GPTConfig(vocab_size=64, n_layer=2, n_head=2, d_model=32, block_size=16))
    moe = MoEGPT(MoEConfig(**{**SMALL, "n_experts": 8, "top_k": 2, "expert_hidden": 64}))  # type: ignore[arg-type]
    d = 32
    mlp_biases, routers = 2 * (4 * d + d), 2 * d * 8
    assert moe.num_active_params() == dense.num_params() - mlp_biases + routers
    assert moe.num_params() == moe.num_active_params() + 2 * 6 * (2 * d * 64)  # six experts per block idle
    assert moe.flops_per_token() == pytest.approx(dense.flops_per_token() + 6 * (routers - mlp_biases))


def test_moe_every_and_the_run_config_build_the_model():
    config = load_config("moe-tiny", ["--moe.every=2", "--moe.n_experts=4"])
    model = build_model(config, 256)
    assert isinstance(model, MoEGPT)
    kinds = [type(block.mlp).__name__ for block in model.blocks]
    assert kinds == ["Sequential", "MoEMLP", "Sequential", "MoEMLP"]


@pytest.mark.parametrize(
    "args, words",
    [
        (["--moe.top_k=9"], ["moe.top_k = 9", "moe.n_experts = 8"]),
        (["--distributed.expert_parallel=3"], ["distributed.expert_parallel = 3", "moe.n_experts = 8"]),
        (["--moe.impl=fast"], ["moe.impl", "grouped", "loop"]),
        (["--moe.grow_to=16"], ["moe.grow_to needs moe.grow_at_step", "--moe.grow_at_step="]),
        (["--moe.grow_at_step=5", "--moe.grow_to=8"], ["moe.grow_to = 8", "more than moe.n_experts = 8"]),
        (
            ["--moe.grow_at_step=5", "--moe.grow_to=11", "--distributed.expert_parallel=2"],
            ["distributed.expert_parallel = 2 must divide moe.grow_to = 11", "--moe.grow_to=12"],
        ),
        (["--moe.grow_at_step=-1"], ["moe.grow_at_step = -1", "outside its range [0, "]),
    ],
)
def test_bad_moe_settings_are_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], args: list[str], words: list[str]
):
    with pytest.raises(ConfigError):
        load_config("moe-tiny", args)
    assert main(["train", "--preset", "moe-tiny", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in err, err


@pytest.mark.slow
def test_experts_monitor_reads_at_the_log_cadence_and_the_report_draws_load_and_placement(tmp_path: Path):
    torch.manual_seed(0)
    model = MoEGPT(MoEConfig(**{**SMALL, "router_bias_update": 0.01}))  # type: ignore[arg-type]
    engine = Engine({"run": {"device": "cpu"}})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt, _ = engine.setup(model, opt)
    g = torch.Generator().manual_seed(2)
    batches = [(x[:, :-1], x[:, 1:]) for x in torch.randint(64, (7, 2, 17), generator=g)]
    monitor = ExpertsMonitor(model, interval=3, run_dir=tmp_path)
    fit(engine, model, opt, batches, max_steps=7, hooks=[monitor])
    data = read_experts(tmp_path)
    assert data is not None and (tmp_path / EXPERTS_FILE).is_file()
    assert [h["step"] for h in data["history"]] == [3, 6, 7]  # every 3 steps, and the end
    windows = [3, 3, 1]
    for h, n in zip(data["history"], windows):
        # steps x tokens x top_k
        assert len(h["load"]) == 2 and all(sum(row) == n * 2 * 16 * 2 for row in h["load"])
        assert h["max_mean"] >= 1.0
    assert data["placement"] == {"ep_degree": 1, "world": 1, "ranks": [[0, 1, 2, 3]]}
    section = summarize(data)
    assert sum(section["assignments_per_expert"]) == 7 * 2 * 16 * 2 * 2  # ... x MoE blocks
    assert any("max/mean" in line for line in markdown(section))
    assert write_plots(data, tmp_path / "plots") == ["plots/expert_load.png", "plots/expert_placement.png"]
    assert all(
        (tmp_path / "plots" / f).stat().st_size > 1000 for f in ("expert_load.png", "expert_placement.png")
    )


def test_expert_parallel_degree_that_does_not_divide_the_world_is_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
):
    text = tmp_path / "corpus.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 400)
    args = [
        "train",
        "--preset",
        "moe-tiny",
        f"--data.path={text}",
        f"--run.out_dir={tmp_path / 'runs'}",
        "--distributed.expert_parallel=2",
    ]
    assert main(args) == 2  # one plain process: the world size is 1
    err = capsys.readouterr().err.strip()
    assert (
        len(err.splitlines()) == 1 and "distributed.expert_parallel = 2 must divide the world size 1" in err
    ), err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())  # nothing left behind


@pytest.mark.slow
def test_resuming_with_more_experts_copies_existing_ones_with_noise_and_fresh_optimizer_state():
    torch.manual_seed(0)
    idx = torch.randint(64, (2, 16))
    small = MoEGPT(MoEConfig(**{**SMALL, "n_experts": 2, "top_k": 1}))  # type: ignore[arg-type]
    opt = torch.optim.AdamW(small.parameters(), lr=1e-3)
    small(idx, idx).backward()
    opt.step()
    big = MoEGPT(MoEConfig(**{**SMALL, "n_experts": 4, "top_k": 1}))  # type: ignore[arg-type]
    big_opt = torch.optim.AdamW(big.parameters(), lr=1e-3)
    attach_optimizer(big, big_opt)
    big.load_state_dict(small.state_dict())
    big_opt.load_state_dict(opt.state_dict())
    old, new = small.moe_layers()[0], big.moe_layers()[0]
    assert new.grew_from == 2 and new.w1.shape[0] == 4
    for name in ("w1", "w2"):
        a, b = getattr(old, name).detach(), getattr(new, name).detach()
        assert torch.equal(b[:2], a)  # the trained experts, unchanged
        diff = (b[2:] - a).abs().max()  # experts 2, 3 copy experts 0, 1 plus a little noise
        assert 0 < diff < 0.1 * float(a.std()) * 5
    assert torch.equal(new.router.weight[:2], old.router.weight) and not torch.equal(
        new.router.weight[2:], old.router.weight
    )
    moments = big_opt.state[new.w1]["exp_avg"]
    assert torch.equal(moments[:2], opt.state[old.w1]["exp_avg"]) and not moments[2:].any()
    big(idx, idx).backward()  # and it trains
    big_opt.step()


def test_router_bias_moves_with_the_global_batch_loads_under_data_parallel(monkeypatch):
    # two data-parallel ranks, the other one simulated: all_reduce adds its per-expert counts
    layer = MoEMLP(MoEConfig(**{**SMALL, "router_bias_update": 0.01}))  # type: ignore[arg-type]
    other_rank = torch.tensor([0, 4, 8, 12])
    reduced = []

    def all_reduce(t: torch.Tensor, op: object = None, group: object = None) -> None:
        reduced.append(op)
        t += other_rank

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    layer.pending = torch.tensor([10, 6, 2, 0])  # this rank alone: expert 0 over-loaded, 3 idle
    layer.update_bias(0.01)
    bias = layer.expert_bias  # together [10, 10, 10, 12]: expert 3 is the over-loaded one
    assert reduced == [torch.distributed.ReduceOp.SUM]
    assert float(bias[3]) < 0 < min(float(b) for b in bias[:3]) and abs(float(bias.sum())) < 1e-6


@pytest.mark.slow
def test_under_the_engine_the_router_bias_moves_once_per_optimizer_step_from_all_its_micro_batches():
    """Accumulation 2: the bias stays put between a step's micro-batches; the first forward of the
    next step applies the sum of both micro-batches' loads (one update); the checkpoint's extra
    state holds those loads and brings them back; a step the OOM policy discards leaves no loads."""
    torch.manual_seed(0)
    model = MoEGPT(MoEConfig(**{**SMALL, "router_bias_update": 0.01}))  # type: ignore[arg-type]
    engine = Engine({"run": {"device": "cpu"}, "batch": {"accumulation": 2}})
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights stay: only the bias moves
    model, opt, _ = engine.setup(model, opt)
    layer = model.moe_layers()[0]
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(64, (2, 16), generator=g) for _ in range(3)]
    loads = []
    for idx in batches[:2]:
        engine.backward(model(idx, idx))
        assert layer.last_counts is not None
        loads.append(layer.last_counts.clone())
        assert not bool(layer.expert_bias.any())  # not moved inside the step
    assert engine.step(opt) and layer.step_load is None
    assert torch.equal(layer.pending, loads[0] + loads[1])  # both micro-batches, for the next forward
    saved = model.state_dict()
    engine.backward(model(batches[2], batches[2]))
    total = (loads[0] + loads[1]).float()
    expected = 0.01 * torch.sign(total.mean() - total)
    torch.testing.assert_close(layer.expert_bias, expected - expected.mean())
    assert layer.pending is None and layer.step_load is not None
    engine.discard_step(model)  # the OOM policy drops the partial step: its loads go too
    assert layer.step_load is None and layer.pending is None
    fresh = MoEGPT(MoEConfig(**{**SMALL, "router_bias_update": 0.01}))  # type: ignore[arg-type]
    fresh.load_state_dict(saved)
    assert torch.equal(fresh.moe_layers()[0].pending, loads[0] + loads[1])


@pytest.mark.slow
def test_the_moe_layer_takes_vectors_and_tokens_and_the_engine_adds_its_load_balancing_loss():
    """Any model: (B, d) and (B, T, d) in, the same shape out; engine.backward(plain loss) trains
    on loss + aux_loss_coef x load-balancing loss (the router's gradient includes it), taken once;
    an own loop gets the same from aux_loss(model); checkpointing's recompute counts no token
    twice; a checkpoint with fewer experts grows into the layer."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), MoE(16, n_experts=4, top_k=2, hidden=32, aux_loss_coef=0.5)
    )
    twin = copy.deepcopy(model)
    x = torch.randn(6, 8)
    engine = Engine({"run": {"device": "cpu"}})
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt, _ = engine.setup(model, opt)
    out = model(x)
    assert out.shape == (6, 16) and model[1](torch.randn(2, 5, 16)).shape == (2, 5, 16)
    out = model(x)  # the last training forward's loss is the one added
    engine.backward(out.square().mean())
    y = twin(x)
    (y.square().mean() + aux_loss(twin)).backward()
    torch.testing.assert_close(model[1].router.weight.grad, twin[1].router.weight.grad)
    assert model[1].take_aux_loss() is None  # taken once
    engine.step(opt)
    aux = float(model[1].last_aux.detach())  # type: ignore[union-attr]
    assert float(engine.last_loss) == pytest.approx(float(out.detach().square().mean()) + 0.5 * aux, rel=1e-6)  # type: ignore[arg-type]
    assert twin[1].router.weight.grad.abs().sum() > 0 and aux_loss(twin) == 0.0
    layer = twin[1]
    layer.take_load()
    checkpoint(layer, torch.randn(6, 16, requires_grad=True), use_reentrant=False).sum().backward()
    assert int(layer.take_load()[0].sum()) == 6 * 2  # the forward's tokens x top_k, not the recompute's again
    layer.take_aux_loss()
    layer.eval()
    layer(torch.randn(3, 16))
    assert layer.take_aux_loss() is None and int(layer.take_load()[0].sum()) == 0  # evaluation adds nothing
    bigger = MoE(16, n_experts=8, top_k=2, hidden=32)
    bigger.load_state_dict(layer.state_dict())  # a resume with more experts grows them
    assert bigger.grew_from == 4 and torch.equal(bigger.w1[:4], layer.w1)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(n_experts=4, top_k=5), ["top_k=5", "n_experts = 4"]),
        (dict(impl="fast"), ["impl='fast'", "grouped", "loop"]),
        (dict(capacity_factor=-1.0), ["capacity_factor=-1.0", ">= 0"]),
    ],
)
def test_bad_moe_layer_arguments_are_one_line_naming_them(kwargs: dict, words: list[str]):
    with pytest.raises(ConfigError) as err:
        MoE(16, **kwargs)
    assert len(str(err.value).splitlines()) == 1 and all(w in str(err.value) for w in words), str(err.value)


@pytest.mark.slow
def test_compiled_moe_layer_and_gpt_have_no_graph_breaks():
    """fullgraph=True raises at the first graph break: the layer on vectors and tokens (grouped
    GEMM in fp32; the batched path of CUDA fp32/fp16 with a capacity), and a training MoE GPT."""
    torch.manual_seed(0)
    for impl, shapes in (("auto", ((6, 16), (2, 3, 16))), ("batched", ((6, 16),))):
        layer = MoE(
            16, n_experts=4, top_k=2, hidden=32, impl=impl, capacity_factor=1.0 if impl == "batched" else 0.0
        )
        compiled = torch.compile(layer, backend="eager", fullgraph=True)
        for shape in shapes:
            x = torch.randn(shape)
            y = compiled(x)
            y.sum().backward()
            torch.testing.assert_close(y, layer(x), rtol=1e-5, atol=1e-6)
    model = MoEGPT(MoEConfig(**SMALL))  # type: ignore[arg-type]
    idx = torch.randint(64, (2, 16))
    torch.compile(model, backend="eager", fullgraph=True)(idx, idx).backward()
    torch._dynamo.reset()


def test_new_experts_go_to_the_rank_holding_the_fewest_and_old_ones_stay_on_theirs():
    # 4 experts over 2 ranks grow to 6: experts 0, 1 stay on rank 0, 2, 3 on rank 1, one new each
    assert grown_order(4, 6, 2) == [(0, False), (1, False), (0, True), (2, False), (3, False), (1, True)]
    # 3 experts (a one-process checkpoint) into 2 ranks of 2: dealt 0 -> r0, 1 -> r1, 2 -> r0; the new
    # one goes to rank 1, which holds fewer
    assert grown_order(3, 4, 2) == [(0, False), (2, False), (1, False), (0, True)]
    assert grown_order(2, 4) == [(0, False), (1, False), (0, True), (1, True)]  # one process: appended
    # per-expert figures from before the growth, in the grown numbering (new experts 0)
    assert regrown([5, 7], 4, 2) == [5, 0, 7, 0] and regrown([5, 7, 1, 2], 4, 2) == [5, 7, 1, 2]


GROW = [
    "--model.n_layer=1",
    "--model.n_head=2",
    "--model.d_model=32",
    "--model.block_size=16",
    "--moe.n_experts=2",
    "--moe.top_k=1",
    "--moe.expert_hidden=32",
    "--moe.grow_at_step=3",
    "--moe.grow_to=4",
    "--train.max_steps=6",
    "--batch.micro=4",
    "--monitor.log_every=1",
    "--train.eval_every=0",
    "--train.eval_batches=1",
    "--train.checkpoint_every=100",
    "--monitor.nvml=false",
    "--data.num_workers=0",
    "--run.device=cpu",
]


def _step_losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


@pytest.mark.slow
def test_experts_grow_at_a_step_of_a_run_that_resumes_exactly_and_plots_them(tmp_path: Path):
    """moe.grow_at_step = 3, grow_to = 4 (from 2): the run trains on with 4 experts from step 4, the
    new ones routed to; a run stopped after the growth (step 5) and resumed gives the same losses
    at every step; experts.json (and so the load plot) has the new experts from step 4 on.
    (The training function ``turbotrain train`` calls, without its report: 1 s a run.)"""
    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"def f{i}(x):\n    return x * {i}\n\n" for i in range(300)))
    runs = tmp_path / "runs"
    config = load_config("moe-tiny", [*GROW, f"--data.path={text}", f"--run.out_dir={runs}"])
    whole = train(config.replace(run={"name": "whole"}), progress=False)
    assert whole["status"] == "completed" and whole["max_steps"] == 6
    stopped = config.replace(train={"stop_after_steps": 5}, run={"name": "stopped"})
    assert train(stopped, progress=False)["stop_reason"] == "stop_after_steps = 5"
    assert train(stopped, resume_dir=runs / "stopped", progress=False)["status"] == "completed"
    losses = _step_losses(runs / "whole")
    assert sorted(losses) == list(range(1, 7)) and _step_losses(runs / "stopped") == losses  # bit for bit
    data = read_experts(runs / "whole")
    assert data is not None and data["n_experts"] == 4
    assert data["grown"] == [{"step": 3, "from": 2, "to": 4, "new": [2, 3]}]
    loads = {h["step"]: h["load"][0] for h in data["history"]}
    assert all(len(row) == 4 for row in loads.values())
    assert all(loads[s][2] == loads[s][3] == 0 for s in (1, 2, 3))  # before: no new expert
    assert sum(loads[s][2] + loads[s][3] for s in (4, 5, 6)) > 0  # after: tokens reach them
    assert "plots/expert_load.png" in write_plots(data, tmp_path / "plots")


def test_a_resume_that_falls_back_past_the_growth_builds_the_experts_of_the_checkpoint_it_loads(
    tmp_path: Path,
):
    """#44 item 2: checkpoints at 2, 3 (the growth), 4 and 5 of a run stopped at 5; 3, 4 and 5
    damaged: the resume loads step 2 (2 experts) into a model of 2 experts, grows at step 3 as
    the uninterrupted run did, and every step's loss and the final weights are the uninterrupted
    run's (before: built with 4 experts for step 5, step 2 grew into them at once)."""
    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"def f{i}(x):\n    return x * {i}\n\n" for i in range(300)))
    runs = tmp_path / "runs"
    every = ["--train.checkpoint_every=2", "--train.keep_last=10"]
    config = load_config("moe-tiny", [*GROW, *every, f"--data.path={text}", f"--run.out_dir={runs}"])
    assert train(config.replace(run={"name": "whole"}), progress=False)["status"] == "completed"
    stopped = config.replace(train={"stop_after_steps": 5}, run={"name": "stopped"})
    assert train(stopped, progress=False)["steps"] == 5
    saved = list_checkpoints(runs / "stopped" / "checkpoints")
    assert [p.name for p in saved] == [f"step_0000000{s}.pt" for s in (2, 3, 4, 5)]
    for path in saved[1:]:  # damaged: the checksum no longer matches
        data = bytearray(path.read_bytes())
        data[len(data) // 2 : len(data) // 2 + 64] = bytes(
            b ^ 0xFF for b in data[len(data) // 2 : len(data) // 2 + 64]
        )
        path.write_bytes(bytes(data))
    resumed = train(
        stopped.replace(train={"stop_after_steps": 0}), resume_dir=runs / "stopped", progress=False
    )
    assert resumed["status"] == "completed"  # resumed_from: step 3, where it grew (and resumed again)
    losses = _step_losses(runs / "whole")
    assert sorted(losses) == list(range(1, 7)) and _step_losses(runs / "stopped") == losses  # bit for bit
    (_, got), (_, want) = (
        load_latest_weights(runs / "stopped" / "checkpoints"),
        load_latest_weights(runs / "whole" / "checkpoints"),
    )
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    data = read_experts(runs / "stopped")
    assert data is not None and data["grown"] == [{"step": 3, "from": 2, "to": 4, "new": [2, 3]}]
