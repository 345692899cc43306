"""L3 loop: fit (the reference loop), hooks and the one builder of a run's hook chain,
checkpoints, the monitor.

Layers import only downward (the README's "Architecture"; tests/unit/test_layers.py holds it).
"""

from . import early_stop  # noqa: F401 - registers the [best] settings: a config that holds them parses anywhere
