"""The mixture-of-experts family's own ``[moe]`` settings (the experts; the GPT backbone is
``[model]``'s), the expert-compute choices (:data:`MOE_IMPLS`, which the
:class:`~turbotrain.parts.models.moe.layer.MoE` layer of any model takes too), the rules that span
them and the names they had in ``[model]``. Its start hook (:func:`grown`) builds a resume past
``moe.grow_at_step`` with the grown experts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ....base.config import MAX_STEPS, RunConfig, knob, register_settings, setting
from ....base.config_plugins import Start, register_start
from ....base.errors import ConfigError
from ..gpt.settings import GPTSettings, check_gpt, gpt_settings, unused_family

MOE_IMPLS = ("auto", "grouped", "batched", "loop")


@dataclass(frozen=True)
class MoESettings:
    """The mixture-of-experts family's own settings (``model.arch = 'moe'``)."""

    n_experts: int = knob(8, "experts per MoE block", min=1, max=4096)
    top_k: int = knob(2, "experts each token is routed to (at most n_experts)", min=1, max=4096)
    every: int = knob(
        1,
        "every k-th block is a MoE block (1 = all, 2 = blocks 2, 4, ...; at most model.n_layer)",
        min=1,
        max=1024,
    )
    expert_hidden: int = knob(0, "hidden width of each expert's MLP; 0 = 4 x model.d_model", min=0, max=2**20)
    aux_loss_coef: float = knob(
        0.01, "weight of the load-balancing loss added to the training loss; 0 = off", min=0.0, max=100.0
    )
    capacity_factor: float = knob(
        0.0,
        "expert slots = factor x tokens x top_k / n_experts, overflow dropped; 0 = dropless",
        min=0.0,
        max=4096.0,
    )
    router_bias_update: float = knob(
        0.0,
        "DeepSeek-V3 aux-loss-free balancing, the expert-bias step per optimizer step; 0 = off",
        min=0.0,
        max=1.0,
    )
    impl: str = knob(
        "auto",
        "expert compute, 'auto' (grouped GEMM on CPU and on CUDA with bf16, else batched), "
        "'grouped', 'batched' or 'loop' (one matmul per expert: the reference)",
        choices=MOE_IMPLS,
    )
    grow_at_step: int = knob(
        0,
        "grow every MoE block to moe.grow_to experts after this optimizer step (new experts on the "
        "expert-parallel rank holding the fewest); 0 = never",
        min=0,
        max=MAX_STEPS,
    )
    grow_to: int = knob(
        0,
        "experts per MoE block from moe.grow_at_step on (more than moe.n_experts); 0 = no growth",
        min=0,
        max=4096,
    )


def grows(c: RunConfig) -> bool:
    """Whether ``c`` is a MoE GPT run whose experts grow at a step (``moe.grow_at_step``)."""
    return c.model.arch == "moe" and not c.model.workload and bool(c.table(MoESettings).grow_at_step)


def grown(start: Start) -> RunConfig:
    """The family's start hook: the config the model is built from, ``start.config`` itself, or for
    a run whose experts grow that resumes from a checkpoint at or after ``grow_at_step`` (the one
    the resume loads: a damaged newer one is skipped as the resume skips it), the config with
    ``moe.n_experts = grow_to`` and no growth left (:mod:`turbotrain.app.experts_growth`)."""
    c = start.config
    if not grows(c):
        return c
    e = c.table(MoESettings)
    n = e.grow_to if start.resume_step() >= e.grow_at_step else e.n_experts  # grown from grow_at_step on
    return c if n == e.n_experts else c.replace(moe={"n_experts": n, "grow_at_step": 0, "grow_to": 0})


def check_moe(config: RunConfig) -> None:
    """The [moe] rules that span fields (for the family that uses them)."""
    m, e = gpt_settings(config), config.table(MoESettings)
    if m.workload:
        return
    if e.top_k > e.n_experts:
        raise ConfigError(
            f"moe.top_k = {e.top_k} must be at most moe.n_experts = {e.n_experts}, "
            f"e.g. {setting('moe.top_k', min(2, e.n_experts))}"
        )
    if e.every > m.n_layer:
        raise ConfigError(
            f"moe.every = {e.every} must be at most model.n_layer = {m.n_layer}: every "
            f"moe.every-th block is a MoE block, so there would be none; e.g. {setting('moe.every', 1)}"
        )
    if e.capacity_factor > e.n_experts / e.top_k:
        raise ConfigError(
            f"moe.capacity_factor = {e.capacity_factor:g} must be at most moe.n_experts / moe.top_k = "
            f"{e.n_experts / e.top_k:g} (there every expert has a slot for every token); 0 = dropless, e.g. "
            f"{setting('moe.capacity_factor', 0)}"
        )
    if bool(e.grow_at_step) != bool(e.grow_to):
        given, other = (
            ("moe.grow_at_step", "moe.grow_to") if e.grow_at_step else ("moe.grow_to", "moe.grow_at_step")
        )
        raise ConfigError(
            f"{given} needs {other} too: grow to moe.grow_to experts after optimizer step moe.grow_at_step, e.g. "
            f"{setting('moe.grow_at_step', e.grow_at_step or 100)} {setting('moe.grow_to', e.grow_to or 2 * e.n_experts)}"
        )
    if e.grow_to and e.grow_to <= e.n_experts:
        raise ConfigError(
            f"moe.grow_to = {e.grow_to} must be more than moe.n_experts = {e.n_experts} (the experts grow), "
            f"e.g. {setting('moe.grow_to', 2 * e.n_experts)}"
        )
    # a dense model with expert_parallel > 1 is refused by the run's plan (its spec says 0 experts): an
    # own loop's Engine takes this config's distributed section for its own MoE model
    degree = config.distributed.expert_parallel
    if degree > 1 and e.n_experts % degree:
        raise ConfigError(f"distributed.expert_parallel = {degree} must divide moe.n_experts = {e.n_experts}")
    if degree > 1 and e.grow_to % degree:
        raise ConfigError(
            f"distributed.expert_parallel = {degree} must divide moe.grow_to = {e.grow_to} (every rank holds "
            f"as many experts), e.g. {setting('moe.grow_to', e.grow_to + degree - e.grow_to % degree)}"
        )


def unused_moe(config: RunConfig, given: Sequence[str]) -> str:
    """``--moe.*`` settings for a run of another family would do nothing: one line."""
    fix = "a workload's MoE layers take their own arguments (turbotrain.MoE(...)) in your FUNC"
    return unused_family(config, given, "moe", fix)


register_settings("model", GPTSettings, when="model.arch=moe", check=check_gpt)  # the GPT backbone
register_settings(
    "moe",
    MoESettings,
    when="model.arch=moe",
    after="model",
    check=check_moe,
    unused=unused_moe,
    moved={
        "model.n_experts": "n_experts",
        "model.top_k": "top_k",
        "model.moe_every": "every",
        "model.expert_hidden": "expert_hidden",
        "model.aux_loss_coef": "aux_loss_coef",
        "model.capacity_factor": "capacity_factor",
        "model.router_bias_update": "router_bias_update",
        "model.moe_impl": "impl",
    },
    model_shape=True,
)
register_start("moe", "model.arch=moe", build=grown)
