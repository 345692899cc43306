"""L3 loop: fit, hooks and the one builder of a run's hook chain, checkpoints, the monitor."""

from . import early_stop  # noqa: F401 - registers the [best] settings: a config that holds them parses anywhere
