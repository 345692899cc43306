"""``[choose]``: how ``turbotrain train`` decides the settings left at ``auto`` by measuring them
(:mod:`turbotrain.app.choose.session`). Registered as a section of its own on ``import turbotrain``
(this module imports nothing heavy)."""

from __future__ import annotations

from dataclasses import dataclass

from ...base.config import knob, register_settings
from ...base.config_sections import AUTO

CHOOSE_MODES = ("auto", "always", "off")


@dataclass(frozen=True)
class ChooseSettings:
    measure: str = knob(
        AUTO,
        "settings left at 'auto' (compile.scope, precision.mode) chosen by timing candidates on your model "
        "before a new run trains (turbotrain train): 'auto' when the planned run is long enough to pay for it, "
        "'always', or 'off' (fixed rules)",
        choices=CHOOSE_MODES,
    )
    budget: float = knob(
        0.05,
        "measuring may cost at most this fraction of the planned run's time in eager",
        min=0.001,
        max=1.0,
    )
    warmup: int = knob(3, "untimed steps per candidate (compilation happens here)", min=1, max=1000)
    steps: int = knob(10, "timed steps per candidate (the median counts)", min=2, max=10_000)
    min_speedup: float = knob(
        1.03, "a candidate must be this many times faster than plain eager to be kept", min=1.0, max=100.0
    )


register_settings("choose", ChooseSettings, after="distributed")
